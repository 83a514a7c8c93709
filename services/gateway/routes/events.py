"""SSE: a turn's events (ends after the terminal event) and the session log (open-ended).

Each event carries ``id:`` = its stream entry id and ``event:`` = its type. A client
resumes with ``Last-Event-ID`` (or ``?after=``); the header wins when both are sent.
A cursor ahead of the stream's last entry is ``400 cursor_ahead``.

Every event that is ready at once (a catch-up page, a burst the hub read together)
goes out in one send of up to :data:`CHUNK_MAX_BYTES`, not one socket write per event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from turnbus.gateway.errors import ApiError, bad_request, not_found
from turnbus.gateway.hub import (
    CAUGHT_UP,
    FollowerDropped,
    HubItem,
    StreamEntry,
    id_order,
    normalize_cursor,
)
from turnbus.gateway.routes.spec import (
    CURSOR_SCHEMA,
    SESSION_PATH,
    TURN_PATH,
    Answer,
    Operation,
)
from turnbus.gateway.schemas import StreamDropped
from turnbus.gateway.sse import LastChunk, SseResponse, encode_sse
from turnbus.gateway.state import Gateway, authenticate, gateway_of, path_id
from turnbus.shared.events import (
    TERMINAL_TYPES,
    EnvelopePatched,
    Event,
    Resync,
    decode_event,
    encode_event,
    event_type,
    terminal_event,
)
from turnbus.shared.records import TurnRecord

__all__ = ["follow_turn", "session_events", "turn_events"]

log = logging.getLogger(__name__)

# A stuck client (nothing read, buffers full) is let go after this long.
SEND_TIMEOUT_S = 30.0
# Events ready together are joined into sends of at most this many bytes (one
# larger event goes alone).
CHUNK_MAX_BYTES = 64 * 1024

_encoder = msgspec.json.Encoder()


def _cursor(request: Request) -> str | None:
    raw = request.headers.get("last-event-id")
    name = "Last-Event-ID"
    if raw is None or not raw.strip():
        raw = request.query_params.get("after")
        name = "after"
    if raw is None or not raw.strip():
        return None
    try:
        return normalize_cursor(raw)
    except ValueError:
        raise bad_request(
            f"{name} must be a stream entry id like 1700000000000-0", field=name
        ) from None


async def _refuse_ahead(gateway: Gateway, key: str, cursor: str | None) -> str | None:
    """The stream's last entry id; ``400 cursor_ahead`` when ``cursor`` is past it.

    A client's ``Last-Event-ID`` is always an id it was sent, so one past the end
    is a made-up cursor: it is refused before the stream starts, for that client
    alone. (A stream that is gone has no end to compare with: it resyncs.)
    """
    if cursor is None:
        return None
    last = await gateway.hub.last_id(key)
    if last is not None and id_order(cursor) > id_order(last):
        raise ApiError(
            "cursor_ahead",
            f"the cursor {cursor} is past the stream's last event {last}; "
            "resume from an id you received, or follow without one",
            field="Last-Event-ID",
        )
    return last


def _is_turn_genesis(entry: StreamEntry) -> bool:
    return entry.type == "turn.queued"


def _is_log_genesis(entry: StreamEntry) -> bool:
    if entry.type != "envelope.patched":
        return False
    event = decode_event(entry.data)
    return isinstance(event, EnvelopePatched) and event.origin == "create"


def _terminal_from_record(record: TurnRecord) -> Event:
    """The terminal event a finished turn's record implies (its stream has expired)."""
    return terminal_event(
        record.turnId,
        record.status,
        at=record.endedAt or 0,
        reason=record.reason,
        message=record.error,
        stop_reason=record.stopReason,
        by=record.by if record.reason == "interrupted" else None,
    )


def _sse(entry: StreamEntry) -> bytes:
    return encode_sse(entry.data, entry.type, entry.id)


def _control(event: Event) -> bytes:
    # Control events carry no id, so a client's Last-Event-ID stays the last real entry.
    return encode_sse(encode_event(event).decode(), event_type(event))


def _dropped(reason: str, last: str | None) -> bytes:
    body = StreamDropped(reason=reason, lastEventId=last)
    return encode_sse(_encoder.encode(body).decode(), "stream.dropped")


def _chunks(events: list[bytes]) -> list[bytes]:
    """Encoded events joined into chunks of at most :data:`CHUNK_MAX_BYTES`."""
    if len(events) == 1:
        return events
    chunks: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for event in events:
        if current and size + len(event) > CHUNK_MAX_BYTES:
            chunks.append(b"".join(current))
            current, size = [], 0
        current.append(event)
        size += len(event)
    if current:
        chunks.append(b"".join(current))
    return chunks


async def _follow(
    gateway: Gateway,
    batches: AsyncIterator[list[HubItem]],
    record: TurnRecord | None,
) -> AsyncIterator[bytes]:
    """Hub batches as encoded SSE chunks; ``record`` set means a turn stream that ends."""
    metrics = gateway.metrics
    metrics.open_streams.inc()
    last: str | None = None
    resynced = False
    try:
        async for batch in batches:
            out: list[bytes] = []
            done = False
            for item in batch:
                if item is CAUGHT_UP:
                    if record is not None and record.terminal:
                        if resynced and last is None:
                            out.append(_control(_terminal_from_record(record)))
                        done = True
                        break
                    continue
                if isinstance(item, Resync):
                    resynced = True
                    metrics.sse_resyncs.inc()
                    out.append(_control(item))
                    continue
                assert isinstance(item, StreamEntry)
                last = item.id
                out.append(_sse(item))
                if record is not None and item.type in TERMINAL_TYPES:
                    done = True
                    break
            chunks = _chunks(out)
            if done and chunks:
                chunks[-1] = LastChunk(chunks[-1])  # sent with the response's end
            for chunk in chunks:
                yield chunk
            if done:
                return
    except FollowerDropped as exc:
        yield _dropped(exc.reason, last)
    except (RedisError, OSError):
        log.warning("SSE stream ended: Redis is unreachable", exc_info=True)
        yield _dropped("unavailable", last)
    finally:
        metrics.open_streams.dec()
        aclose = getattr(batches, "aclose", None)
        if aclose is not None:
            await aclose()


def _response(
    gateway: Gateway,
    body: AsyncIterator[bytes],
    headers: dict[str, str] | None = None,
    *,
    turn_key: str | None = None,
) -> Response:
    """The SSE response; ``turn_key`` (a turn stream's record): a quiet stream whose turn
    was deleted with its session ends with ``stream.dropped`` (``gone``) at its next
    keep-alive, rather than pinging on for a turn that will write nothing more."""
    there = None
    if turn_key is not None:
        key = turn_key

        async def there() -> bool:
            return bool(await gateway.redis.exists(key))

    return SseResponse(
        body,
        ping_s=gateway.settings.sse_ping_s,
        send_timeout_s=SEND_TIMEOUT_S,
        headers=headers,
        there=there,
        gone=_dropped("gone", None),
    )


def follow_turn(
    gateway: Gateway,
    user: str,
    session: str,
    record: TurnRecord,
    *,
    queued: tuple[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """A turn's events from its first, as an SSE response (a submit that asked for it).
    ``queued``: the ``turn.queued`` entry the submit just wrote, ``(id, data)``: the
    stream starts with it, with no catch-up read."""
    key = gateway.keys.turn_events(user, session, record.turnId)
    first = StreamEntry(queued[0], "turn.queued", queued[1]) if queued is not None else None
    batches = gateway.hub.batches(key, None, _is_turn_genesis, first=first)
    turn_key = gateway.keys.turn(user, session, record.turnId)
    return _response(gateway, _follow(gateway, batches, record), headers, turn_key=turn_key)


_SSE_PARAMETERS = [
    {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "Resume after this event id (wins over `after`).",
        "schema": CURSOR_SCHEMA,
    },
    {
        "name": "after",
        "in": "query",
        "required": False,
        "description": "Resume after this event id.",
        "schema": CURSOR_SCHEMA,
    },
    {
        "name": "access_token",
        "in": "query",
        "required": False,
        "description": "The bearer token, for clients that cannot set headers (EventSource).",
        "schema": {"type": "string"},
    },
]
_SSE_CODES = ["bad_request", "cursor_ahead"]
_SSE_OK = Answer(
    "text/event-stream; each event's `data` is one JSON event (see Event).",
    media_type="text/event-stream",
)


@Operation(
    "GET",
    TURN_PATH + "/events",
    "turnEvents",
    summary="SSE of the turn's events; ends after the terminal event",
    description=(
        "From `turn.queued` to one terminal event. A round held back by the model's rate "
        "limit sends `round.waiting` (its `reason` and about how long, `waitMs`) before "
        "its text: nothing streams until the model's key is let through again, or the "
        "turn fails with that reason after `TURNBUS_MODEL_WAIT_S`."
    ),
    parameters=_SSE_PARAMETERS,
    answers={
        200: _SSE_OK,
        204: Answer("the cursor is at the terminal event already"),
    },
    errors=_SSE_CODES,
)
async def turn_events(request: Request) -> Response:
    user = authenticate(request, allow_query=True)
    session = path_id(request, "session_id", "session")
    turn_id = path_id(request, "turn_id", "turn")
    cursor = _cursor(request)
    gateway = gateway_of(request)
    record = await gateway.turns.get(user, session, turn_id)
    if record is None:
        raise not_found("no such turn")
    key = gateway.keys.turn_events(user, session, turn_id)
    last = await _refuse_ahead(gateway, key, cursor)
    if record.terminal and cursor is not None and last is not None and cursor == last:
        # Already delivered the terminal event: 204 tells EventSource to stop reconnecting.
        return Response(status_code=204)
    batches = gateway.hub.batches(key, cursor, _is_turn_genesis)
    turn_key = gateway.keys.turn(user, session, turn_id)
    return _response(gateway, _follow(gateway, batches, record), turn_key=turn_key)


@Operation(
    "GET",
    SESSION_PATH + "/events",
    "sessionEvents",
    summary="SSE of the session log; open-ended",
    parameters=_SSE_PARAMETERS,
    answers={200: _SSE_OK},
    errors=_SSE_CODES,
)
async def session_events(request: Request) -> Response:
    user = authenticate(request, allow_query=True)
    session = path_id(request, "session_id", "session")
    cursor = _cursor(request)
    gateway = gateway_of(request)
    if not await gateway.redis.exists(gateway.keys.env(user, session)):
        raise not_found("no such session")
    key = gateway.keys.log(user, session)
    await _refuse_ahead(gateway, key, cursor)
    batches = gateway.hub.batches(key, cursor, _is_log_genesis)
    return _response(gateway, _follow(gateway, batches, None))
