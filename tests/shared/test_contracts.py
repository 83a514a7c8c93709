"""The contracts: the work entry's one struct, and the reasons the docs list."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from turnbus.shared.contracts import END_REASONS, FAILURE_REASONS, TIMEOUT_REASONS, WorkEntry
from turnbus.shared.events import (
    TurnFailed,
    decode_event,
    encode_event,
    is_terminal,
    terminal_event,
)
from turnbus.shared.keys import InvalidId, Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore

pytestmark = pytest.mark.timeout(10)

_API = Path(__file__).parents[2] / "docs" / "api.md"


def test_a_work_entry_round_trips_through_its_struct() -> None:
    entry = WorkEntry(user="u1", session="s1", turn="t_1", interrupts="t_0", traceparent="00-a")
    fields = entry.fields()
    assert fields == {
        "user": "u1",
        "session": "s1",
        "turn": "t_1",
        "interrupts": "t_0",
        "traceparent": "00-a",
    }
    # As XREADGROUP answers it: bytes values, and fields a newer writer may add.
    raw = {k: v.encode() for k, v in fields.items()} | {"later": b"1"}
    assert WorkEntry.decode(raw) == entry
    assert entry.trace() == {"traceparent": "00-a"}
    assert WorkEntry(user="u1", session="s1", turn="t_1").trace() is None


def test_a_work_entry_written_before_the_struct_is_read() -> None:
    """The wire format is the three ids as plain fields, as it has always been."""
    assert WorkEntry.decode({"user": "u", "session": "s", "turn": "t"}) == WorkEntry(
        user="u", session="s", turn="t"
    )


@pytest.mark.parametrize(
    "fields", [{"user": "u", "session": "s"}, {"user": "u", "session": "s{x}", "turn": "t"}]
)
def test_a_malformed_work_entry_is_refused(fields: dict[str, str]) -> None:
    with pytest.raises(InvalidId):
        WorkEntry.decode(fields)


def _documented_reasons() -> list[str]:
    text = _API.read_text(encoding="utf-8")
    section = text.split("<!-- reasons -->", 2)[1]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)


def test_the_api_docs_list_every_end_reason_and_no_other() -> None:
    assert _documented_reasons() == list(END_REASONS)


def test_a_failed_turns_reason_is_one_of_the_listed_ones() -> None:
    for reason in FAILURE_REASONS:
        event = terminal_event("t", "failed", at=1, reason=reason)
        assert decode_event(encode_event(event)) == event
    assert terminal_event("t", "failed", at=1, reason="not_a_reason") == TurnFailed(
        turnId="t", reason="internal", at=1
    )
    assert terminal_event("t", "timed_out", at=1, reason=TIMEOUT_REASONS[1]).reason == (
        "action_timeout"
    )
    unlisted = msgspec.json.encode({"type": "turn.failed", "turnId": "t", "reason": "later"})
    # A reason a newer writer added: the event still ends the turn for an older reader.
    assert is_terminal(decode_event(unlisted))


async def test_the_submits_work_entry_is_read_back_by_the_one_decoder(
    redis: aioredis.Redis, keys: Keys, settings: Settings
) -> None:
    """What the gateway appends to the work stream is what a worker decodes."""
    turns = TurnStore(redis, keys, settings)
    trace = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    entry_id = await turns.enqueue("u1", "s1", "t_1", trace, interrupts="t_0")
    [(read_id, fields)] = await redis.xrange(keys.work(0))
    assert read_id == entry_id
    assert WorkEntry.decode(fields) == WorkEntry(
        user="u1", session="s1", turn="t_1", interrupts="t_0", traceparent=trace["traceparent"]
    )
