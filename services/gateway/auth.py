"""Bearer tokens: JWT HS256 with ``sub`` = the user id, a numeric ``exp`` required, and a
lifetime no longer than ``TURNBUS_TOKEN_MAX_TTL_S``."""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jwt
import msgspec
from jwt.warnings import InsecureKeyLengthWarning
from starlette.requests import Request

from turnbus.gateway.errors import ApiError, unauthorized
from turnbus.shared.keys import InvalidId, validate_id
from turnbus.shared.quotas import CLAIM_NAMES
from turnbus.shared.settings import Settings

__all__ = [
    "RECOMMENDED_SECRET_BYTES",
    "InvalidToken",
    "TokenTtlTooLong",
    "TokenVerifier",
    "check_secret",
    "mint_token",
    "quotas_claim",
    "request_user",
    "tools_claim",
    "verify_token",
]

log = logging.getLogger(__name__)

_ALGORITHM = "HS256"
# RFC 7518 3.2: an HS256 key should be at least as long as the hash.
RECOMMENDED_SECRET_BYTES = 32


def check_secret(secret: str) -> None:
    """Log once, at startup, when the secret is shorter than RFC 7518 recommends.

    PyJWT would otherwise warn on every encode and decode; the advice belongs in
    the operator's log once, not on the request path.
    """
    if len(secret.encode()) < RECOMMENDED_SECRET_BYTES:
        log.warning(
            "TURNBUS_JWT_SECRET is %d bytes; use at least %d random bytes",
            len(secret.encode()),
            RECOMMENDED_SECRET_BYTES,
        )


class InvalidToken(Exception):
    """A token that does not prove a user: bad signature, expired, malformed, no ``sub``."""


class TokenTtlTooLong(ValueError):
    """A token asked to live longer than the gateway accepts (``TURNBUS_TOKEN_MAX_TTL_S``)."""

    def __init__(self, ttl_s: int, max_ttl_s: int) -> None:
        super().__init__(
            f"a token may live at most {max_ttl_s} s (TURNBUS_TOKEN_MAX_TTL_S); asked for {ttl_s} s"
        )
        self.ttl_s = ttl_s
        self.max_ttl_s = max_ttl_s


DEFAULT_MAX_TTL_S = Settings.token_max_ttl_s
# ``exp - now`` may exceed the lifetime cap by this much: the clock of the host that
# minted the token may run a little ahead of ours.
CLOCK_SKEW_S = 60

_jws = jwt.PyJWS()
_claims_decoder = msgspec.json.Decoder(dict[str, Any])


def mint_token(
    secret: str, user: str, ttl_s: int = 3600, *, max_ttl_s: int = DEFAULT_MAX_TTL_S
) -> str:
    """A signed token for ``user`` that expires in ``ttl_s`` seconds.

    :class:`TokenTtlTooLong` when ``ttl_s`` is over ``max_ttl_s``: the gateway would refuse it.
    """
    if not secret:
        raise ValueError("a JWT secret is required")
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    if ttl_s > max_ttl_s:
        raise TokenTtlTooLong(ttl_s, max_ttl_s)
    validate_id(user, "user")
    now = int(time.time())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyLengthWarning)
        return jwt.encode(
            {"sub": user, "iat": now, "exp": now + ttl_s}, secret, algorithm=_ALGORITHM
        )


def _signed_payload(secret: str, token: str) -> bytes:
    """The payload of a token whose HS256 signature checks out; our own sentences otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureKeyLengthWarning)
            payload: bytes = _jws.decode(token, secret, algorithms=[_ALGORITHM])
    except jwt.InvalidSignatureError:
        raise InvalidToken("the token's signature does not match this gateway's secret") from None
    except jwt.InvalidAlgorithmError:
        raise InvalidToken(f"the token must be signed with {_ALGORITHM}") from None
    except jwt.InvalidTokenError:
        raise InvalidToken(
            "the token is not a well-formed JWT (header.payload.signature, base64url JSON)"
        ) from None
    return payload


def _number(claims: dict[str, Any], name: str) -> float | None:
    value = claims.get(name)
    if value is None and name not in claims:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidToken(
            f"the token's {name!r} claim must be a number of seconds since the epoch"
        )
    return float(value)


def _tools_claim(claims: dict[str, Any]) -> str | None:
    """The optional ``tools`` claim (a list of tool names the user's turns may use at
    most, whatever a session's ``allowedTools`` says) as the turn record keeps it: a
    JSON array in a string."""
    if "tools" not in claims:
        return None
    tools = claims["tools"]
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise InvalidToken("the token's 'tools' claim must be a list of tool names")
    return _tools_encoder.encode(sorted(set(tools))).decode()


_tools_encoder = msgspec.json.Encoder()

# The ``quotas`` claim's names (shared.quotas.CLAIM_NAMES).
_QUOTA_NAMES = frozenset(CLAIM_NAMES)


def _quotas_claim(claims: dict[str, Any]) -> dict[str, int] | None:
    """The optional ``quotas`` claim: the user's own limits, e.g. ``{"runningTurns": 2}``,
    each a positive integer; the gateway applies each only below the deployment's cap."""
    if "quotas" not in claims:
        return None
    quotas = claims["quotas"]
    if not isinstance(quotas, dict):
        raise InvalidToken("the token's 'quotas' claim must be an object of limits")
    for name, value in quotas.items():
        if name not in _QUOTA_NAMES:
            known = ", ".join(CLAIM_NAMES)
            raise InvalidToken(f"the token's 'quotas' claim has {name!r}; known: {known}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidToken(f"the token's 'quotas.{name}' must be a positive integer")
    return dict(quotas)


class _Claims(msgspec.Struct, frozen=True):
    """What a verified token proves, as the verifier caches it."""

    user: str
    exp: float
    tools: str | None
    quotas: dict[str, int] | None


def _check_claims(payload: bytes, now: float, max_ttl_s: int) -> _Claims:
    """``(user, exp, tools claim)`` of a signed payload whose claims hold at ``now``."""
    try:
        claims = _claims_decoder.decode(payload)
    except msgspec.DecodeError:
        raise InvalidToken("the token's payload is not a JSON object") from None
    exp = _number(claims, "exp")
    if exp is None:
        raise InvalidToken("the token has no 'exp' claim; every token must expire")
    iat = _number(claims, "iat")
    nbf = _number(claims, "nbf")
    if exp <= now:
        raise InvalidToken("the token has expired")
    if nbf is not None and nbf > now:
        raise InvalidToken("the token is not yet valid (its 'nbf' is in the future)")
    # ``iat`` is not checked against the clock: a token minted on a host whose clock
    # runs a little ahead must not be refused. It bounds the token's lifetime.
    if exp - now > max_ttl_s + CLOCK_SKEW_S or (iat is not None and exp - iat > max_ttl_s):
        raise InvalidToken(
            f"the token lives longer than this gateway accepts ({max_ttl_s} s); mint a shorter one"
        )
    if "sub" not in claims:
        raise InvalidToken("the token has no 'sub' claim (the user id)")
    try:
        user = validate_id(claims["sub"], "user")
    except InvalidId as exc:
        raise InvalidToken(f"the token's subject is not a usable user id: {exc.reason}") from None
    return _Claims(user, exp, _tools_claim(claims), _quotas_claim(claims))


def verify_token(secret: str, token: str, *, max_ttl_s: int = DEFAULT_MAX_TTL_S) -> str:
    """The user id a token proves; :class:`InvalidToken` otherwise."""
    return _check_claims(_signed_payload(secret, token), time.time(), max_ttl_s).user


class TokenVerifier:
    """Verifies bearer tokens, each once per lifetime: a bounded LRU of tokens that passed,
    each entry good until the token's own ``exp``. Failures are never cached."""

    def __init__(
        self,
        secret: str,
        *,
        max_ttl_s: int = DEFAULT_MAX_TTL_S,
        cache_size: int = Settings.token_cache_size,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secret = secret
        self._max_ttl_s = max_ttl_s
        self._cache_size = cache_size
        self._clock = clock
        self._cache: OrderedDict[str, _Claims] = OrderedDict()
        self.verified = 0
        """Tokens checked in full (signature and claims), i.e. cache misses."""

    def __len__(self) -> int:
        return len(self._cache)

    def verify(self, token: str) -> str:
        """The user id ``token`` proves; :class:`InvalidToken` otherwise."""
        return self.verify_claims(token)[0]

    def verify_claims(self, token: str) -> tuple[str, str | None]:
        """The user id ``token`` proves and its ``tools`` claim (``None``: none)."""
        claims = self.verify_all(token)
        return claims.user, claims.tools

    def verify_all(self, token: str) -> _Claims:
        """Every claim of ``token`` the gateway uses; :class:`InvalidToken` otherwise."""
        now = self._clock()
        hit = self._cache.get(token)
        if hit is not None:
            if hit.exp > now:
                self._cache.move_to_end(token)
                return hit
            del self._cache[token]
            raise InvalidToken("the token has expired")
        self.verified += 1
        claims = _check_claims(_signed_payload(self._secret, token), now, self._max_ttl_s)
        if self._cache_size:
            self._cache[token] = claims
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return claims


def request_user(request: Request, tokens: TokenVerifier, *, allow_query: bool = False) -> str:
    """The authenticated user of a request, else :class:`ApiError` 401.

    ``allow_query`` accepts ``?access_token=`` for routes a browser's EventSource
    opens (it cannot set headers); the header wins when both are present.
    """
    header = request.headers.get("authorization")
    token: str | None = None
    if header is not None:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise unauthorized("the Authorization header must be 'Bearer <token>'")
        token = value.strip()
    elif allow_query:
        token = request.query_params.get("access_token") or None
    if token is None:
        raise unauthorized("a bearer token is required")
    try:
        claims = tokens.verify_all(token)
    except InvalidToken as exc:
        raise ApiError("unauthorized", str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
    if claims.tools is not None:
        request.state.tools_claim = claims.tools  # what tools_claim() answers
    if claims.quotas is not None:
        request.state.quotas_claim = claims.quotas  # what quotas_claim() answers
    return claims.user


def tools_claim(request: Request) -> str | None:
    """The authenticated token's ``tools`` claim (after :func:`request_user`), a JSON
    array of names in a string; ``None`` when the token has none."""
    return getattr(request.state, "tools_claim", None)


def quotas_claim(request: Request) -> dict[str, int] | None:
    """The authenticated token's ``quotas`` claim (after :func:`request_user`): the user's
    own limits by name; ``None`` when the token has none."""
    return getattr(request.state, "quotas_claim", None)
