"""``turnbus.sse``: the one SSE parser, as a browser's EventSource reads a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

from turnbus.sse import SseMessage, SseParser, aiter_sse, iter_sse


def _triples(messages: list[SseMessage]) -> list[tuple[str | None, str, str]]:
    return [(m.id, m.event, m.data) for m in messages]


def test_ids_events_multiline_data_and_pings() -> None:
    lines = [
        ": ping - 2026-01-01",
        "",
        "id: 1-0",
        "event: text.delta",
        'data: {"a":',
        "data: 1}",
        "",
        "id: 2-0",
        "data: x",
        "",
    ]
    assert _triples(list(iter_sse(lines))) == [
        ("1-0", "text.delta", '{"a":\n1}'),
        ("2-0", "message", "x"),
    ]


def test_chunks_cut_anywhere_read_as_the_whole_stream() -> None:
    raw = 'id: 1-0\r\nevent: text.delta\r\ndata: {"t":"héllo ✓"}\r\n\r\n: ping\r\n\r\ndata: b\rdata:c\n\n'
    expected = [("1-0", "text.delta", '{"t":"héllo ✓"}'), (None, "message", "b\nc")]
    data = raw.encode()
    for cut in range(len(data) + 1):
        parser = SseParser()
        got = parser.feed(data[:cut]) + parser.feed(data[cut:])
        assert _triples(got) == expected, cut
    parser = SseParser()
    one_byte_at_a_time = [m for i in range(len(data)) for m in parser.feed(data[i : i + 1])]
    assert _triples(one_byte_at_a_time) == expected


def test_crlf_cr_and_lf_framing_in_one_chunk_or_line_by_line() -> None:
    raw = 'id: 1-0\r\nevent: resync\r\ndata: {"type":"resync"}\r\n\r\ndata: b\rdata:c\n\n'
    expected = [("1-0", "resync", '{"type":"resync"}'), (None, "message", "b\nc")]
    assert _triples(list(iter_sse([raw]))) == expected
    assert _triples(list(iter_sse(raw.splitlines(keepends=True)))) == expected
    assert next(iter_sse([raw])).json() == {"type": "resync"}


def test_an_event_without_data_is_not_dispatched_and_ids_do_not_carry_over() -> None:
    lines = ["id: 5-0", "event: nothing", "", "data: y", "", "id: bad\0id", "data: z", ""]
    assert _triples(list(iter_sse(lines))) == [(None, "message", "y"), (None, "message", "z")]


async def test_the_async_parser_reads_the_same() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in ["id: 1-0", "data: a", "", ": ping", "data: b", ""]:
            yield line

    assert _triples([m async for m in aiter_sse(lines())]) == [
        ("1-0", "message", "a"),
        (None, "message", "b"),
    ]


def test_the_gateways_frames_read_back_as_written() -> None:
    from turnbus.gateway.sse import encode_sse

    frames = [
        ('{"type":"text.delta","text":"hi"}', "text.delta", "1-0"),
        ("first\nsecond\r\nthird\rfourth", "note", "2-0"),
        ("x", "bad\nevent", "3-\r0"),
    ]
    parser = SseParser()
    messages = parser.feed(b"".join(encode_sse(*frame) for frame in frames))
    assert _triples(messages) == [
        ("1-0", "text.delta", '{"type":"text.delta","text":"hi"}'),
        ("2-0", "note", "first\nsecond\nthird\nfourth"),
        ("3-0", "badevent", "x"),
    ]
