from __future__ import annotations

import logging
import time
import warnings
from collections.abc import AsyncIterator

import httpx
import jwt
import pytest
from gateway.app import create_app
from gateway.auth import InvalidToken, mint_token, verify_token
from gateway.server import AccessTokenRedactor, redact_tokens
from jwt.warnings import InsecureKeyLengthWarning

from shared.settings import Settings, SettingsError
from tests.gateway_server import LiveGateway


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


_LATER = int(time.time()) + 24 * 3600  # far enough that no run of the suite outlives it


@pytest.mark.parametrize(
    ("token", "why"),
    [
        (mint_token("other-secret" * 4, "alice"), "Signature verification failed"),
        (_encode({"sub": "alice"}, "s" * 32), '"exp"'),
        (_encode({"exp": _LATER}, "s" * 32), '"sub"'),
        (_encode({"sub": "a:b", "exp": _LATER}, "s" * 32), "not a usable user id"),
        (_encode({"sub": "alice", "exp": int(time.time()) - 10}, "s" * 32), "expired"),
        (_encode({"sub": "alice", "exp": _LATER}, "s" * 32, "HS512"), "alg"),
        ("not-a-jwt", "the token is invalid"),
    ],
)
def test_verify_refuses(token: str, why: str) -> None:
    with pytest.raises(InvalidToken, match=why):
        verify_token("s" * 32, token)


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
    assert checked == 12
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
