"""Bearer tokens: JWT HS256 with ``sub`` = the user id and ``exp`` required."""

from __future__ import annotations

import logging
import time
import warnings

import jwt
from jwt.warnings import InsecureKeyLengthWarning
from starlette.requests import Request

from gateway.errors import ApiError, unauthorized
from shared.keys import InvalidId, validate_id

__all__ = [
    "RECOMMENDED_SECRET_BYTES",
    "InvalidToken",
    "check_secret",
    "mint_token",
    "request_user",
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


def mint_token(secret: str, user: str, ttl_s: int = 3600) -> str:
    """A signed token for ``user`` that expires in ``ttl_s`` seconds."""
    if not secret:
        raise ValueError("a JWT secret is required")
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    validate_id(user, "user")
    now = int(time.time())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InsecureKeyLengthWarning)
        return jwt.encode(
            {"sub": user, "iat": now, "exp": now + ttl_s}, secret, algorithm=_ALGORITHM
        )


def verify_token(secret: str, token: str) -> str:
    """The user id a token proves; :class:`InvalidToken` otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureKeyLengthWarning)
            claims = jwt.decode(
                token,
                secret,
                algorithms=[_ALGORITHM],
                # ``iat`` is informational: a token minted on a host whose clock
                # runs a little ahead must not be refused; ``exp`` and ``nbf`` rule.
                options={"require": ["exp", "sub"], "verify_iat": False},
            )
    except jwt.ExpiredSignatureError:
        raise InvalidToken("the token has expired") from None
    except jwt.InvalidTokenError as exc:
        raise InvalidToken(f"the token is invalid: {exc}") from None
    user = claims.get("sub")
    try:
        return validate_id(user, "user")
    except InvalidId as exc:
        raise InvalidToken(f"the token's subject is not a usable user id: {exc.reason}") from None


def request_user(request: Request, secret: str, *, allow_query: bool = False) -> str:
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
        return verify_token(secret, token)
    except InvalidToken as exc:
        raise ApiError("unauthorized", str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
