"""The redis-py internals the clients use: checked at import, with the pin beside them."""

from __future__ import annotations

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
