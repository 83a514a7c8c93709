"""The redis-py internals the clients use: checked at import, with the pin beside them,
and imported nowhere else."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests import ROOT
from turnbus.shared import redispy

pytestmark = pytest.mark.timeout(10)


def test_the_installed_redis_py_has_every_internal_the_clients_use() -> None:
    redispy.check()  # what importing turnbus.shared.mux already did, said out loud


def test_the_pin_in_pyproject_is_the_range_the_check_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (redis_pin,) = [d for d in project["project"]["dependencies"] if d.startswith("redis[")]
    assert redis_pin == "redis[hiredis]" + redispy.SUPPORTED.removeprefix("redis")


def test_a_missing_internal_is_named_with_the_supported_range() -> None:
    def gone() -> bool:
        raise AttributeError("module 'redis._parsers.base' has no attribute 'BaseParser'")

    with pytest.raises(redispy.RedisInternalsError) as missing:
        redispy.check((("redis._parsers.base.BaseParser.parse_error: the reply reader", gone),))
    assert "lacks redis._parsers.base.BaseParser.parse_error" in str(missing.value)
    assert redispy.SUPPORTED in str(missing.value)

    with pytest.raises(redispy.RedisInternalsError) as changed:
        redispy.check((("redis.crc.key_slot: the slot of a key", lambda: False),))
    assert "changed redis.crc.key_slot" in str(changed.value)


# What redis-py does not promise: its private modules, the modules whose public names
# ``redis`` and ``redis.asyncio`` export (the rest of each is internal), and the
# undocumented functions, options and attributes turnbus's clients rely on.
_PRIVATE = re.compile(
    r"\bredis(\.asyncio)?\._\w+"
    r"|\bredis\.(crc|client)\b"
    r"|\bredis(\.asyncio)?\.connection\b"
    r"|\b(get_response_callbacks|parse_error|parse_url|can_get_connection|BaseParser"
    r"|pipeline_execute_command|auto_close_connection_pool|NEVER_DECODE|EMPTY_RESPONSE"
    r"|CaseInsensitiveDict|AbstractConnection)\b"
    r"|\.(connection_kwargs|connection_class|command_stack|ssl_context|response_callbacks)\b"
)


def test_no_module_but_redispy_uses_a_redis_py_internal() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for folder in ("shared", "services", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "shared" / "redispy.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _PRIVATE.search(line)
    ]
    assert found == [], "redis-py internals outside shared/redispy.py:\n" + "\n".join(found)


def test_the_check_finds_an_internal_written_outside_redispy() -> None:
    for line in (
        "from redis._parsers.base import BaseParser",
        "from redis.crc import key_slot",
        "from redis.client import NEVER_DECODE",
        "from redis.asyncio.connection import SSLConnection",
        "kwargs = pool.connection_kwargs",
        "stack, self.command_stack = self.command_stack, []",
    ):
        assert _PRIVATE.search(line), line
    for line in (
        "import redis.asyncio as aioredis",
        "from redis.asyncio import BlockingConnectionPool, Connection",
        "from redis.asyncio.client import Pipeline, PubSub",
        'options["connection_class"] = guarded_connection_class(cls)',
    ):
        assert not _PRIVATE.search(line), line
