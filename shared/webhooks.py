"""Webhooks: the receiver check at submit, the payload and the Standard Webhooks signature.

A turn's webhook is queued by the script that writes its terminal event (an outbox
mark in the session's slot, ``keys.webhook_outbox``) and sent by the workers' sender
(:mod:`turnbus.worker.webhooks`). Nothing here talks to Redis.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
from urllib.parse import urlsplit

import msgspec

from turnbus.shared.records import TurnRecord

__all__ = [
    "WebhookRefused",
    "check_webhook_url",
    "guarded_address",
    "host_key",
    "parse_secret",
    "payload",
    "sign",
    "webhook_id",
]

# Addresses no webhook goes to unless the allow-list names them: link-local (where the
# clouds' metadata services answer) and the metadata services' other addresses and names.
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "168.63.129.16")
)
_METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog"})
_URL_MAX_CHARS = 2048
_encoder = msgspec.json.Encoder()


class WebhookRefused(ValueError):
    """A webhook URL this deployment does not send to (HTTP 422 ``webhook_not_allowed``)."""


def webhook_id(turn_id: str) -> str:
    """The ``webhook-id`` of a turn's terminal webhook: one per turn, on every retry.
    (The scripts that queue a webhook build the same string.)"""
    return f"msg_{turn_id}"


def host_key(url: str) -> str:
    """``host:port`` of a URL: the unit of the sender's per-receiver bound."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{(parts.hostname or '').lower()}:{port}"


def guarded_address(address: str) -> bool:
    """Whether an address (or host name) is link-local or a metadata service's."""
    name = address.strip("[]").lower()
    if name in _METADATA_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip in _METADATA_ADDRESSES or any(ip in net for net in _LINK_LOCAL)


def check_webhook_url(url: str, allow: tuple[str, ...]) -> str:
    """Return ``url`` if a webhook may go there, else raise :class:`WebhookRefused`.

    An ``http`` or ``https`` URL whose host (``host``) or host and port
    (``host:port``) is in ``allow``; a link-local or metadata address only when the
    allow-list names it as written in the URL."""
    if len(url) > _URL_MAX_CHARS:
        raise WebhookRefused(f"the webhook URL is longer than {_URL_MAX_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise WebhookRefused("the webhook URL cannot be parsed") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused("the webhook URL must be an http or https URL with a host")
    if parts.username is not None or parts.password is not None:
        raise WebhookRefused("the webhook URL must not carry credentials")
    host = parts.hostname.lower()
    shown = f"[{host}]" if ":" in host else host
    named = {host, shown}
    if port is not None:
        named |= {f"{host}:{port}", f"{shown}:{port}"}
    if not named & set(allow):
        raise WebhookRefused(
            f"webhooks may not go to {shown}: it is not in this deployment's TURNBUS_WEBHOOK_ALLOW"
        )
    return url


def parse_secret(secret: str) -> bytes:
    """The signing key of a ``whsec_<base64>`` secret (the ``whsec_`` prefix optional)."""
    raw = secret.removeprefix("whsec_")
    try:
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except binascii.Error:
        raise ValueError("TURNBUS_WEBHOOK_SECRET must be whsec_ and a base64 key") from None
    if not key:
        raise ValueError("TURNBUS_WEBHOOK_SECRET must not be empty")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,`` and the base64 HMAC-SHA256 of
    ``{id}.{timestamp}.{body}``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def payload(record: TurnRecord) -> bytes:
    """The body POSTed for a finished turn: ``{"type": "turn.<status>", "turn": record}``,
    the record without its delivery state (so every retry sends the same bytes)."""
    turn = msgspec.structs.replace(record, webhook=None)
    return _encoder.encode({"type": f"turn.{record.status}", "turn": turn})
