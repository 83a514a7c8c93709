"""The receiver check, the secret, the signature and the payload (shared/webhooks.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json

import pytest

from turnbus.shared.records import TurnRecord, TurnWebhook, record_fields, record_from_hash
from turnbus.shared.webhooks import (
    WebhookRefused,
    check_webhook_url,
    guarded_address,
    host_key,
    parse_secret,
    payload,
    sign,
)


@pytest.mark.parametrize(
    ("url", "allow"),
    [
        ("https://hooks.example.com/turns", ("hooks.example.com",)),
        ("http://127.0.0.1:8123/x", ("127.0.0.1:8123",)),
        ("http://HOOKS.example.com:9000/", ("hooks.example.com",)),
        ("http://[::1]:81/", ("[::1]:81",)),
        ("http://169.254.169.254/latest", ("169.254.169.254",)),
    ],
)
def test_a_url_on_an_allowed_host_passes(url: str, allow: tuple[str, ...]) -> None:
    assert check_webhook_url(url, allow) == url


@pytest.mark.parametrize(
    ("url", "allow"),
    [
        ("https://evil.example.com/", ("hooks.example.com",)),
        ("http://127.0.0.1:8124/x", ("127.0.0.1:8123",)),
        ("http://169.254.169.254/latest/meta-data", ("hooks.example.com",)),
        ("http://[fe80::1]/", ("hooks.example.com",)),
        ("ftp://hooks.example.com/", ("hooks.example.com",)),
        ("https://user:pw@hooks.example.com/", ("hooks.example.com",)),
        ("not a url", ("hooks.example.com",)),
        ("https://hooks.example.com/", ()),
    ],
)
def test_a_url_elsewhere_is_refused(url: str, allow: tuple[str, ...]) -> None:
    with pytest.raises(WebhookRefused):
        check_webhook_url(url, allow)


def test_link_local_and_metadata_addresses_are_guarded() -> None:
    for address in (
        "169.254.169.254",
        "169.254.0.1",
        "fe80::1",
        "[fe80::abcd%eth0]",
        "::ffff:169.254.169.254",
        "fd00:ec2::254",
        "metadata.google.internal",
    ):
        assert guarded_address(address), address
    for address in ("127.0.0.1", "10.0.0.1", "hooks.example.com", "::1"):
        assert not guarded_address(address), address


def test_the_signature_is_the_standard_webhooks_one() -> None:
    key = b"0123456789abcdef0123456789abcdef"
    secret = "whsec_" + base64.b64encode(key).decode()
    assert parse_secret(secret) == key
    body = b'{"type":"turn.completed"}'
    expected = base64.b64encode(
        hmac.new(key, b"msg_t1.1700000000." + body, hashlib.sha256).digest()
    ).decode()
    assert sign(key, "msg_t1", 1700000000, body) == "v1," + expected
    with pytest.raises(ValueError):
        parse_secret("whsec_not base64!")


def test_host_key_names_the_port() -> None:
    assert host_key("https://a.example.com/x") == "a.example.com:443"
    assert host_key("http://A.example.com:8080/") == "a.example.com:8080"


def test_the_record_keeps_its_webhook_and_the_payload_leaves_it_out() -> None:
    record = TurnRecord(
        turnId="t1",
        sessionId="s1",
        userId="u1",
        status="completed",
        message="hi",
        createdAt=1,
        webhook=TurnWebhook(url="https://h.example.com/"),
    )
    back = record_from_hash(record_fields(record))
    assert back.webhook == TurnWebhook(url="https://h.example.com/")
    body = json.loads(payload(back))
    assert body["type"] == "turn.completed"
    assert body["turn"]["turnId"] == "t1" and "webhook" not in body["turn"]
