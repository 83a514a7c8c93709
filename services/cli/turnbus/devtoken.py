"""``turnbus.dev_token``: a development token from a running ``turnbus up``, for
scripts and notebooks run from any folder."""

from __future__ import annotations

from pathlib import Path

from turnbus.stackfile import NoStack, find_data_dir, read_secret

__all__ = ["dev_token"]

DEV_TOKEN_TTL_S = 24 * 3600


def dev_token(data_dir: str | Path | None = None, *, user: str = "dev",
              ttl_s: int = DEV_TOKEN_TTL_S) -> str:  # fmt: skip
    """A token for ``user``, signed with the secret of the running ``turnbus up`` whose
    data dir is ``data_dir`` (default: found as :func:`turnbus.stackfile.find_data_dir`
    finds it: ``.turnbus`` here or in a parent folder, else the last stack started).

    For development only: whoever reads the data dir can sign in as anyone. Raises
    :class:`turnbus.stackfile.NoStack` when no running stack is found.
    """
    # The gateway's minting, imported only when called: `import turnbus` stays light.
    from turnbus.gateway.auth import mint_token

    found = find_data_dir(data_dir)
    secret = read_secret(found)
    if secret is None:
        raise NoStack(
            f"the stack in {found} has no jwt-secret (it was started with "
            "TURNBUS_JWT_SECRET): mint a token with that secret"
        )
    return mint_token(secret, user, ttl_s)
