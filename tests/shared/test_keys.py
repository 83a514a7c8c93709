from __future__ import annotations

import re

import pytest
from redis.crc import key_slot as redis_key_slot

from turnbus.shared.keys import SLOTS, InvalidId, Keys, key_slot, slot_tag, validate_id, work_slot


def _tag(key: str) -> str:
    match = re.search(r"\{([^}]*)\}", key)
    assert match is not None, key
    return match.group(1)


def test_every_session_key_shares_one_hash_tag() -> None:
    k = Keys("tb")
    session_keys = [
        *k.session_keys("u1", "s1"),
        k.turn("u1", "s1", "t1"),
        k.turn_events("u1", "s1", "t1"),
        k.idempotency("u1", "s1", "abc"),
    ]
    assert {_tag(key) for key in session_keys} == {"u1:s1"}
    assert all(key.startswith("tb:{u1:s1}:") for key in session_keys)
    assert len(set(session_keys)) == len(session_keys)


def test_prefix_is_a_setting() -> None:
    assert Keys("acme").env("u", "s") == "acme:{u:s}:env"
    assert Keys("acme").work(3) == "acme:{04w}:turns:3"
    assert Keys("acme").legacy_work(3) == "acme:turns:3"
    with pytest.raises(ValueError, match="prefix"):
        Keys("a{b}")


@pytest.mark.parametrize(
    "bad",
    ["", "a{b", "a}b", "a:b", "a b", "a\tb", "a\nb", "a\x00b", "a\x7fb", "a\u200bb", "x" * 129],
)
def test_ids_that_could_break_out_of_their_key_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidId):
        validate_id(bad)
    with pytest.raises(InvalidId):
        Keys().env(bad, "s")
    with pytest.raises(InvalidId):
        Keys().env("u", bad)
    with pytest.raises(InvalidId):
        Keys().turn("u", "s", bad)


@pytest.mark.parametrize(
    "good", ["u1", "alice@example.com", "auth0|123", "s_" + "f" * 24, "x" * 128]
)
def test_ordinary_ids_pass(good: str) -> None:
    assert validate_id(good) == good


def test_non_string_id_is_rejected_with_a_clear_message() -> None:
    with pytest.raises(InvalidId, match="invalid user id: must be a string"):
        validate_id(5, "user")


def test_shard_is_stable_and_in_range() -> None:
    shards = {Keys.shard_for("u", f"s{i}", 4) for i in range(100)}
    assert shards == {0, 1, 2, 3}
    assert Keys.shard_for("u", "s1", 4) == Keys.shard_for("u", "s1", 4)
    assert Keys.shard_for("u", "s1", 1) == 0


def test_a_session_s_outbox_sits_on_the_session_s_slot() -> None:
    k = Keys("tb")
    for user, session in [("u1", "s1"), ("alice@example.com", "s_" + "f" * 24), ("a", "b")]:
        slot = redis_key_slot(k.env(user, session).encode())
        assert redis_key_slot(k.outbox(user, session).encode()) == slot
        assert redis_key_slot(k.webhook_outbox(user, session).encode()) == slot
        assert key_slot(f"{user}:{session}") == slot
    assert all(key_slot(slot_tag(slot)) == slot for slot in range(0, SLOTS, 97))


def test_work_streams_spread_over_the_masters_of_a_three_way_split() -> None:
    k = Keys("tb")
    # The standard split of `redis-cli --cluster create` with 3 masters.
    masters = [range(0, 5461), range(5461, 10923), range(10923, SLOTS)]

    def master(shard: int) -> int:
        slot = redis_key_slot(k.work(shard).encode())
        assert slot == work_slot(shard)
        return next(i for i, r in enumerate(masters) if slot in r)

    assert sorted(master(n) for n in range(3)) == [0, 1, 2]
    assert sorted(master(n) for n in range(6)) == [0, 0, 1, 1, 2, 2]
    assert len({work_slot(n) for n in range(64)}) == 64


@pytest.mark.parametrize(
    "key",
    ["tb:{u1:s1}:env", "{u1:s1}", "u1:s1", "tb:{}:x", "tb:{:x", "a{b}{c}", b"tb:{u:s}:log", "é{ü}"],
)
def test_the_one_slot_function_follows_redis_hash_tags(key: str | bytes) -> None:
    raw = key.encode() if isinstance(key, str) else key
    assert key_slot(key) == redis_key_slot(raw)
