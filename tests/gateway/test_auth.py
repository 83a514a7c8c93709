from __future__ import annotations

import logging
import time
import warnings
from collections.abc import AsyncIterator

import httpx
import jwt
import pytest
from jwt.warnings import InsecureKeyLengthWarning

from tests.gateway_server import LiveGateway
from turnbus.gateway.app import create_app
from turnbus.gateway.auth import (
    InvalidToken,
    TokenTtlTooLong,
    TokenVerifier,
    mint_token,
    verify_token,
)
from turnbus.gateway.server import AccessTokenRedactor, redact_tokens
from turnbus.shared.settings import Settings, SettingsError


@pytest.fixture
async def http(gw: LiveGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.base_url) as client:
        yield client


def _encode(claims: dict[str, object], secret: str, algorithm: str = "HS256") -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyLengthWarning)
        return jwt.encode(claims, secret, algorithm=algorithm)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_mint_and_verify_round_trip() -> None:
    token = mint_token("s" * 32, "alice", ttl_s=60)
    assert verify_token("s" * 32, token) == "alice"
    claims = jwt.decode(token, "s" * 32, algorithms=["HS256"])
    assert claims["sub"] == "alice"
    assert 59 <= claims["exp"] - int(time.time()) <= 60


_NOW = int(time.time())
_LATER = _NOW + 12 * 3600  # far enough that no run of the suite outlives it, within the cap
_S = "s" * 32


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (mint_token("other-secret" * 4, "alice"), "signature does not match"),
        (_encode({"sub": "alice"}, _S), "no 'exp' claim"),
        (_encode({"exp": _LATER}, _S), "no 'sub' claim"),
        (_encode({"sub": "a:b", "exp": _LATER}, _S), "not a usable user id"),
        (_encode({"sub": "alice", "exp": _NOW - 10}, _S), "expired"),
        (_encode({"sub": "alice", "exp": _LATER}, _S, "HS512"), "must be signed with HS256"),
        ("not-a-jwt", "not a well-formed JWT"),
        ("e30.e30.", "must be signed with HS256"),  # a header with no alg
        # exp (and iat, nbf) must be numbers: PyJWT alone takes a digit string.
        (_encode({"sub": "alice", "exp": str(_LATER)}, _S), "'exp' claim must be a number"),
        (_encode({"sub": "alice", "exp": True}, _S), "'exp' claim must be a number"),
        (_encode({"sub": "alice", "exp": None}, _S), "'exp' claim must be a number"),
        (_encode({"sub": "alice", "exp": [_LATER]}, _S), "'exp' claim must be a number"),
        (_encode({"sub": "alice", "exp": _LATER, "iat": "0"}, _S), "'iat' claim must be"),
        (_encode({"sub": "alice", "exp": _LATER, "nbf": "0"}, _S), "'nbf' claim must be"),
        # Longer-lived than the cap (default 24 h), with or without iat.
        (_encode({"sub": "alice", "exp": 9999999999}, _S), "lives longer"),
        (_encode({"sub": "alice", "exp": _NOW + 86400 + 120}, _S), "lives longer"),
        (_encode({"sub": "alice", "iat": _NOW - 86400, "exp": _NOW + 60}, _S), "lives longer"),
        (_encode({"sub": "alice", "exp": 1e308}, _S), "lives longer"),
    ],
)
def test_verify_refuses(token: str, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tokens were built at collection; check them at that moment, however long
    # the suite ran before this test.
    monkeypatch.setattr(time, "time", lambda: float(_NOW))
    with pytest.raises(InvalidToken, match=why) as caught:
        verify_token(_S, token)
    # Our own sentence, never the library's internals.
    message = str(caught.value)
    assert message.startswith("the token")
    for internal in (
        "Expecting value",
        "line 1 column",
        "Invalid header",
        "Signature verification",
    ):
        assert internal not in message


def test_the_lifetime_cap_is_a_setting() -> None:
    week = _encode({"sub": "alice", "iat": _NOW, "exp": _NOW + 7 * 86400}, _S)
    with pytest.raises(InvalidToken, match="lives longer"):
        verify_token(_S, week)
    assert verify_token(_S, week, max_ttl_s=7 * 86400) == "alice"
    day = mint_token(_S, "alice", ttl_s=86400)
    assert verify_token(_S, day) == "alice"


def test_mint_refuses_a_ttl_over_the_cap() -> None:
    with pytest.raises(TokenTtlTooLong) as caught:
        mint_token(_S, "alice", ttl_s=86401)
    assert caught.value.max_ttl_s == 86400
    assert mint_token(_S, "alice", ttl_s=7200, max_ttl_s=7200)
    with pytest.raises(TokenTtlTooLong):
        mint_token(_S, "alice", ttl_s=7201, max_ttl_s=7200)


def test_verifier_checks_each_token_once_and_keeps_a_bounded_cache() -> None:
    clock = [float(_NOW)]
    verifier = TokenVerifier(_S, cache_size=2, clock=lambda: clock[0])
    a = _encode({"sub": "alice", "exp": _NOW + 100}, _S)
    b = _encode({"sub": "bob", "exp": _NOW + 100}, _S)
    c = _encode({"sub": "carol", "exp": _NOW + 100}, _S)
    for _ in range(5):
        assert verifier.verify(a) == "alice"
    assert verifier.verified == 1
    assert verifier.verify(b) == "bob"
    assert verifier.verify(a) == "alice"  # a is now the most recent
    assert verifier.verify(c) == "carol"  # evicts b, the least recent
    assert len(verifier) == 2
    assert verifier.verified == 3
    assert verifier.verify(a) == "alice"
    assert verifier.verified == 3
    assert verifier.verify(b) == "bob"
    assert verifier.verified == 4
    # Failures are not cached: each is checked again, and refused again.
    forged = mint_token("other-secret" * 4, "alice")
    for _ in range(2):
        with pytest.raises(InvalidToken):
            verifier.verify(forged)
    assert verifier.verified == 6
    assert len(verifier) == 2


def test_a_cached_token_expires_at_its_own_exp() -> None:
    clock = [float(_NOW)]
    verifier = TokenVerifier(_S, clock=lambda: clock[0])
    token = _encode({"sub": "alice", "exp": _NOW + 100}, _S)
    assert verifier.verify(token) == "alice"
    clock[0] = _NOW + 99.5
    assert verifier.verify(token) == "alice"
    assert verifier.verified == 1
    clock[0] = _NOW + 100
    with pytest.raises(InvalidToken, match="expired"):
        verifier.verify(token)
    assert len(verifier) == 0


async def test_a_string_exp_is_401_with_our_own_sentence(
    http: httpx.AsyncClient, settings: Settings
) -> None:
    assert settings.jwt_secret
    for token in (
        _encode({"sub": "alice", "exp": str(_LATER)}, settings.jwt_secret),
        "eyJub3Qi.e30.x",  # a header that is not JSON
    ):
        r = await http.post("/v1/sessions", headers=_bearer(token))
        assert r.status_code == 401
        message = r.json()["error"]["message"]
        assert message.startswith("the token"), message
        assert "Expecting value" not in message
        assert "Invalid header" not in message


def test_a_token_minted_by_a_clock_ahead_is_accepted_until_it_expires() -> None:
    now = int(time.time())
    ahead = _encode({"sub": "alice", "iat": now + 30, "exp": now + 90}, "s" * 32)
    assert verify_token("s" * 32, ahead) == "alice"
    later = _encode({"sub": "alice", "nbf": now + 30, "exp": now + 90}, "s" * 32)
    with pytest.raises(InvalidToken, match="not yet valid"):
        verify_token("s" * 32, later)


def test_mint_refuses_bad_input() -> None:
    with pytest.raises(ValueError):
        mint_token("", "alice")
    with pytest.raises(ValueError):
        mint_token("s" * 32, "bad user")


def test_create_app_requires_a_secret(settings: Settings) -> None:
    with pytest.raises(SettingsError):
        create_app(Settings(redis_url=settings.redis_url, prefix=settings.prefix))


async def test_no_token_is_401(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/sessions")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"


async def test_malformed_authorization_header_is_401(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/sessions", headers={"Authorization": "Basic abc"})
    assert r.status_code == 401


async def test_bad_signature_is_401(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/sessions", headers=_bearer(mint_token("wrong-secret" * 4, "alice")))
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"


async def test_expired_token_is_401(http: httpx.AsyncClient, settings: Settings) -> None:
    assert settings.jwt_secret
    expired = _encode({"sub": "alice", "exp": int(time.time()) - 5}, settings.jwt_secret)
    r = await http.post("/v1/sessions", headers=_bearer(expired))
    assert r.status_code == 401
    assert "expired" in r.json()["error"]["message"]


async def test_other_users_session_is_404(http: httpx.AsyncClient, settings: Settings) -> None:
    assert settings.jwt_secret
    alice = _bearer(mint_token(settings.jwt_secret, "alice"))
    bob = _bearer(mint_token(settings.jwt_secret, "bob"))
    sid = (await http.post("/v1/sessions", headers=alice)).json()["sessionId"]
    for method, path in [
        ("GET", f"/v1/sessions/{sid}"),
        ("GET", f"/v1/sessions/{sid}/notes"),
        ("GET", f"/v1/sessions/{sid}/system"),
        ("GET", f"/v1/sessions/{sid}/messages"),
        ("GET", f"/v1/sessions/{sid}/events"),
        ("DELETE", f"/v1/sessions/{sid}"),
    ]:
        r = await http.request(method, path, headers=bob)
        assert r.status_code == 404, (method, path)
        assert r.json()["error"]["code"] == "not_found"
    r = await http.post(f"/v1/sessions/{sid}/turns", headers=bob, json={"message": "hi"})
    assert r.status_code == 404
    r = await http.put(f"/v1/sessions/{sid}/meta", headers=bob, json={"updatedAt": 1, "meta": {}})
    assert r.status_code == 404
    tid = (
        await http.post(f"/v1/sessions/{sid}/turns", headers=alice, json={"message": "x"})
    ).json()["turnId"]
    turn = f"/v1/sessions/{sid}/turns/{tid}"
    for method, path in [("GET", turn), ("POST", turn + "/cancel"), ("GET", turn + "/events")]:
        r = await http.request(method, path, headers=bob)
        assert r.status_code == 404, (method, path)
        assert r.json()["error"]["code"] == "not_found"
    # Bob's cancel changed nothing; alice's session and turn are as they were.
    assert (await http.get(turn, headers=alice)).json()["status"] == "queued"
    assert (await http.get(f"/v1/sessions/{sid}", headers=alice)).status_code == 200


async def test_every_protected_route_refuses_a_missing_or_forged_token(
    http: httpx.AsyncClient, settings: Settings
) -> None:
    assert settings.jwt_secret
    alice = _bearer(mint_token(settings.jwt_secret, "alice"))
    sid = (await http.post("/v1/sessions", headers=alice)).json()["sessionId"]
    tid = (
        await http.post(f"/v1/sessions/{sid}/turns", headers=alice, json={"message": "x"})
    ).json()["turnId"]
    forged = mint_token("not-the-secret" * 4, "alice")
    doc = (await http.get("/openapi.json")).json()
    checked = 0
    for template, item in doc["paths"].items():
        path = template.replace("{session_id}", sid).replace("{turn_id}", tid)
        for method, operation in item.items():
            if method == "parameters" or operation.get("security") == []:
                continue
            for headers, params in [
                ({}, {}),
                (_bearer(forged), {}),
                ({}, {"access_token": forged}),
            ]:
                r = await http.request(method.upper(), path, headers=headers, params=params)
                assert r.status_code == 401, (method, template, headers, params)
                assert r.json()["error"]["code"] == "unauthorized"
            checked += 1
    assert checked == 17
    # Nothing was changed by the refused requests.
    assert (await http.get(f"/v1/sessions/{sid}/turns/{tid}", headers=alice)).json()[
        "status"
    ] == "queued"


async def test_access_token_query_only_on_sse_routes(
    http: httpx.AsyncClient, settings: Settings
) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    sid = (await http.post("/v1/sessions", headers=_bearer(token))).json()["sessionId"]
    r = await http.get(f"/v1/sessions/{sid}", params={"access_token": token})
    assert r.status_code == 401
    async with http.stream(
        "GET", f"/v1/sessions/{sid}/events", params={"access_token": token}
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")


def test_access_tokens_are_redacted_from_access_logs() -> None:
    assert redact_tokens("/v1/x/events?after=1-0&access_token=abc.def.ghi") == (
        "/v1/x/events?after=1-0&access_token=***"
    )
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:1", "GET", "/v1/s/events?access_token=secret-token", "1.1", 200),
        None,
    )
    assert AccessTokenRedactor().filter(record)
    assert "secret-token" not in record.getMessage()
    assert "access_token=***" in record.getMessage()
