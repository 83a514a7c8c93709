"""A Redis client that multiplexes a process's commands over one pipelined connection.

redis-py runs each command on a connection of its own, taken from a pool: a pool
checkout, a task and a timer per send, a timer per read, and a socket write per command.
That is ~40 µs of CPU per command, which at hundreds of turns streaming at once is most
of a worker's and a gateway's time. RESP answers in order on a connection, so one
connection can carry every caller's commands at once: :class:`MuxRedis` queues each
command on it, writes all the commands issued in the same pass of the event loop in one
send, and hands each reply to its caller in order (a few µs a command). No caller waits
for a free connection, so there is no pool to exhaust.

:class:`MuxRedis` is a ``redis.asyncio.Redis``: every command method, pipelines
(``transaction=False``) and redis-py's reply parsing work as before. What would hold the
shared connection goes to the redis-py pool it was built on, as before: blocking reads
(``XREAD``/``XREADGROUP`` with ``BLOCK``, ``B*POP``, ``WAIT``), ``MULTI`` transactions
and pub/sub.

Failures: every error reply is raised in its caller, never returned as a value
(``-LOADING`` while Redis loads its dataset is ``BusyLoadingError``, a
``ConnectionError``: retry later). A connection that is lost fails the commands in flight
on it with ``ConnectionError`` (whether they ran is unknown, as with any client) and the
next command connects again. A connection that has answered nothing for ``reply_timeout_s``
while commands wait is closed, failing them with ``TimeoutError``. A caller cancelled
while it waits does not disturb the others: its reply is read and dropped.

What would change the shared connection's state for every caller is refused with
:class:`LinkStateError`, naming the command and what to use instead (``SELECT`` of
another database, ``CLIENT REPLY``, ``HELLO``, ``AUTH``, ``RESET``, ``QUIT``, pub/sub
subscriptions, ``MONITOR``, ``MULTI``/``WATCH``). The link has TCP keepalive
(:data:`KEEPALIVE`), and at most ``max_in_flight`` commands waiting for their replies:
a caller past the cap, or while the transport has paused writing, waits for room (up
to ``room_wait_s``, then ``TimeoutError``), it never fails for lack of room before.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio import ConnectionPool
from redis.asyncio.client import Pipeline, PubSub

from turnbus.shared import redispy
from turnbus.shared.redispy import EMPTY_REPLY_OPTION, UNDECODED_OPTION
from turnbus.shared.transport import lost_link_error

__all__ = [
    "KEEPALIVE",
    "MAX_IN_FLIGHT",
    "LinkStateError",
    "MuxRedis",
    "NotDedicated",
    "SendingPipeline",
    "link_state_refusal",
    "single_link",
]

# Commands that block the connection they run on until data arrives.
_BLOCKING = frozenset(
    {"BLPOP", "BRPOP", "BRPOPLPUSH", "BLMOVE", "BLMPOP", "BZPOPMIN", "BZPOPMAX", "BZMPOP",
     "WAIT", "WAITAOF"}
)  # fmt: skip
_PUBSUB = "use pubsub(), a connection of its own"
_TRANSACTION = "use pipeline(transaction=True) on one Redis, or a Lua script over one slot"
# Commands that change the state of the connection they are sent on: on a shared one,
# every caller's. What to use instead.
_LINK_STATE = {
    "CLIENT REPLY": "the replies of every caller would go out of step",
    "CLIENT TRACKING": "use a dedicated link (turnbus.shared.connect.dedicated_link)",
    "HELLO": "the shared connection speaks RESP2 as the user of TURNBUS_REDIS_URL",
    "AUTH": "set the user and password in TURNBUS_REDIS_URL",
    "RESET": "it would reset every caller's database, user and name",
    "QUIT": "close the client with aclose()",
    "SELECT": "the database is the one of TURNBUS_REDIS_URL (/<db>)",
    "MONITOR": "use monitor(), a connection of its own",
    "SUBSCRIBE": _PUBSUB,
    "PSUBSCRIBE": _PUBSUB,
    "SSUBSCRIBE": _PUBSUB,
    "UNSUBSCRIBE": _PUBSUB,
    "PUNSUBSCRIBE": _PUBSUB,
    "SUNSUBSCRIBE": _PUBSUB,
    "MULTI": _TRANSACTION,
    "EXEC": _TRANSACTION,
    "DISCARD": _TRANSACTION,
    "WATCH": _TRANSACTION,
    "UNWATCH": _TRANSACTION,
}
_LINK_STATE_WORDS = frozenset(name.split()[0] for name in _LINK_STATE)
# Commands in flight on one link, by default, before callers wait for room.
MAX_IN_FLIGHT = 8192
# TCP keepalive on every link (seconds): the first probe after 5 s idle, then every 2 s,
# dead after 3 unanswered (11 s); data unacknowledged for as long drops it too. A
# half-open link (a host gone, a path cut) is noticed even while nothing is asked.
KEEPALIVE = {"idle_s": 5, "interval_s": 2, "count": 3}
_KEEPALIVE_OPTIONS = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *(
        (socket.IPPROTO_TCP, getattr(socket, name), value)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE["idle_s"]),
            ("TCP_KEEPALIVE", KEEPALIVE["idle_s"]),  # macOS's name
            ("TCP_KEEPINTVL", KEEPALIVE["interval_s"]),
            ("TCP_KEEPCNT", KEEPALIVE["count"]),
            (
                "TCP_USER_TIMEOUT",
                (KEEPALIVE["idle_s"] + KEEPALIVE["interval_s"] * KEEPALIVE["count"]) * 1000,
            ),
        )
        if hasattr(socket, name)
    ),
]
# A link with commands waiting and nothing read for this long tells its owner (a
# cluster client re-reads the slot map: a stopped master may have been replaced).
_STALL_S = 1.0
# Reply latency is averaged over the last one to two of these spans: a spike is forgotten
# within a second of Redis answering fast again, whether or not many replies come.
_LATENCY_SPAN_S = 0.5


def _reply_error(message: str | bytes) -> Exception:
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    return redispy.reply_error(message)


class LinkStateError(redis.exceptions.DataError):
    """A command that would change the shared connection's state for every caller."""


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("ascii", "replace")
    return str(value)


def link_state_refusal(args: Sequence[Any], db: int = 0) -> LinkStateError | None:
    """The error for a command that would change a shared connection's state (``None``:
    it may be sent). ``db``: the connection's database (a ``SELECT`` of it is harmless)."""
    head = _text(args[0]).upper()
    if head.partition(" ")[0] not in _LINK_STATE_WORDS:
        return None
    name = " ".join(head.split())
    if name == "CLIENT" and len(args) > 1:
        name = f"CLIENT {_text(args[1]).upper()}"
    why = _LINK_STATE.get(name)
    if why is None or (name == "SELECT" and len(args) == 2 and _text(args[1]) == str(db)):
        return None
    return LinkStateError(f"{name} is refused on a shared Redis connection: {why}")


def _blocks(args: Sequence[Any]) -> bool:
    name = _text(args[0]).upper()
    if name in ("XREAD", "XREADGROUP"):
        return any(
            (isinstance(a, bytes) and a.upper() == b"BLOCK")
            or (isinstance(a, str) and a.upper() == "BLOCK")
            for a in args
        )
    return name in _BLOCKING


def _pack(args: Sequence[Any]) -> bytes:
    first = args[0]
    if isinstance(first, str) and " " in first:  # "SCRIPT LOAD", "CLIENT SETNAME", ...
        args = (*first.split(), *args[1:])
    try:
        packed: bytes = hiredis.pack_command(tuple(args))
    except TypeError as exc:
        raise redis.exceptions.DataError(f"cannot send {args[0]!r}: {exc}") from None
    return packed


def _is_message(reply: Any) -> bool:
    """A pub/sub message as RESP2 pushes it: ``[b"message", channel, payload]``."""
    return isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message"


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list):
        return [_decode(item) for item in value]
    return value


class _Link(asyncio.Protocol):
    """One connection: commands written in batches, replies matched in order."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        reply_timeout_s: float,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self._loop = loop
        self._parser = hiredis.Reader(replyError=_reply_error)
        # Each command's future, when it was sent, and who takes its reply at once (if any).
        self._waiting: deque[tuple[asyncio.Future[Any], float, Callable[[Any], None] | None]] = (
            deque()
        )
        self._out: list[bytes] = []
        self._flush_handle: asyncio.Handle | None = None
        self._transport: asyncio.Transport | None = None
        self._reply_timeout_s = reply_timeout_s
        self._watchdog: asyncio.TimerHandle | None = None
        self._progress = 0.0
        self.lost: Exception | None = None
        # Room: at most this many commands waiting for replies, none added while the
        # transport has paused writing; who waits for room, in order.
        self.max_in_flight = max_in_flight
        self._paused = False
        self._room_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._handing = False  # a waiter was let in and has not sent yet
        self._drained: asyncio.Future[None] | None = None  # who waits for no commands in flight
        # Send → reply times (ms): the sum and count of this span's replies, and the last's.
        self._span_at = loop.time()
        self._span_ms = 0.0
        self._span_replies = 0
        self._last_span = (0.0, 0)
        self.sends = 0  # writes to the socket (each one round trip for what it carries)
        self.commands = 0
        # A subscriber's link: pub/sub messages go here, not to a waiting command; and
        # who is told once when the link is lost or closed (see MuxRedis.listen).
        self.on_push: Callable[[Any], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        # Told each time commands have waited _STALL_S with nothing read.
        self.on_stall: Callable[[], None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            for level, option, value in _KEEPALIVE_OPTIONS:
                with contextlib.suppress(OSError):
                    sock.setsockopt(level, option, value)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_room()

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        now = self._loop.time()
        self._progress = now
        waiting = self._waiting
        while True:
            try:
                reply = self._parser.gets()
            except hiredis.ProtocolError as exc:
                self.close(redis.exceptions.ConnectionError(f"Redis protocol error: {exc}"))
                return
            if reply is False:
                if self._room_waiters:
                    self._wake_room()
                if not waiting and self._drained is not None:
                    self._tell_drained()
                return
            if self.on_push is not None and _is_message(reply):
                self.on_push(reply)
                continue
            if not waiting:  # nothing asked for it: the stream is out of step
                self.close(redis.exceptions.ConnectionError("Redis sent a reply nobody asked for"))
                return
            future, sent, on_reply = waiting.popleft()
            if now - self._span_at >= _LATENCY_SPAN_S:
                self._next_span(now)
            self._span_ms += (now - sent) * 1000
            self._span_replies += 1
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, Exception):  # every error reply (-LOADING too) is raised
                future.set_exception(reply)
            elif on_reply is not None:
                try:
                    on_reply(reply)
                except Exception as exc:  # the caller's error, raised where it waits
                    future.set_exception(exc)
                else:
                    future.set_result(None)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc else ""
        self._fail(redis.exceptions.ConnectionError(f"Redis connection lost{reason}"))

    # -- reply latency -------------------------------------------------------------------

    def _next_span(self, now: float) -> None:
        recent = now - self._span_at < 2 * _LATENCY_SPAN_S
        self._last_span = (self._span_ms, self._span_replies) if recent else (0.0, 0)
        self._span_ms = 0.0
        self._span_replies = 0
        self._span_at = now

    @property
    def latency_ms(self) -> float:
        """The mean send → reply time of the replies of the last second (0.5 to 1 s), or
        how long commands have waited with nothing read when that is longer (a stalled
        server answers nothing, and must not look fast)."""
        now = self._loop.time()
        if now - self._span_at >= _LATENCY_SPAN_S:
            self._next_span(now)
        total = self._span_ms + self._last_span[0]
        count = self._span_replies + self._last_span[1]
        mean = total / count if count else 0.0
        stalled = (now - self._progress) * 1000 if self._waiting else 0.0
        return max(mean, stalled)

    # -- commands ------------------------------------------------------------------------

    def ready(self, count: int) -> bool:
        """Whether ``count`` commands may be sent now, ahead of nobody waiting for room
        (an empty link takes a batch of any size)."""
        return not self._room_waiters and not self._handing and self._has_room(count)

    def _has_room(self, count: int) -> bool:
        if self._paused:
            return False
        waiting = len(self._waiting)
        return not waiting or waiting + count <= self.max_in_flight

    async def room(self, count: int) -> None:
        """Until ``count`` commands may be sent, in the order callers came (or until the
        link is lost: the caller sees ``lost`` and connects again). The caller sends at
        once, then calls :meth:`pass_room`."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        entry = (count, waiter)
        self._room_waiters.append(entry)
        self._wake_room()
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # let in, then cancelled
                self.pass_room()
            else:
                with contextlib.suppress(ValueError):
                    self._room_waiters.remove(entry)
            raise

    def pass_room(self) -> None:
        """The caller let in has sent: the next waiter may go, if room is left."""
        self._handing = False
        self._wake_room()

    def _wake_room(self) -> None:
        waiters = self._room_waiters
        while waiters and not self._handing:
            count, waiter = waiters[0]
            if waiter.done():
                waiters.popleft()
            elif self.lost is not None or self._has_room(count):
                waiters.popleft()
                self._handing = self.lost is None
                waiter.set_result(None)
            else:
                return

    def send(
        self, packed: bytes, on_reply: Callable[[Any], None] | None = None
    ) -> asyncio.Future[Any]:
        if self.lost is not None:
            raise self._lost_error()
        future: asyncio.Future[Any] = self._loop.create_future()
        now = self._loop.time()
        if not self._waiting:
            self._progress = now
        self._waiting.append((future, now, on_reply))
        self._out.append(packed)
        self.commands += 1
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._watch_s, self._watch)
        return future

    @property
    def _watch_s(self) -> float:
        return (
            min(self._reply_timeout_s / 2, _STALL_S) if self.on_stall else self._reply_timeout_s / 2
        )

    def _flush(self) -> None:
        self._flush_handle = None
        out, self._out = self._out, []
        if out and self._transport is not None and self.lost is None:
            self.sends += 1
            try:
                self._transport.write(b"".join(out) if len(out) > 1 else out[0])
            except RuntimeError as exc:  # closed under us, before connection_lost came
                lost = lost_link_error(exc)
                if lost is None:
                    raise
                self.close(lost)

    def _watch(self) -> None:
        self._watchdog = None
        if self.lost is not None or not self._waiting:
            return
        silent = self._loop.time() - self._progress
        if silent > self._reply_timeout_s:
            self.close(
                redis.exceptions.TimeoutError(
                    f"Redis answered nothing for {self._reply_timeout_s:.0f} s"
                )
            )
            return
        self._watchdog = self._loop.call_later(self._watch_s, self._watch)
        if silent >= _STALL_S and self.on_stall is not None:
            self.on_stall()

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def close(self, error: Exception | None = None) -> None:
        self._fail(error or redis.exceptions.ConnectionError("Redis connection closed"))
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # uvloop: already closed
                self._transport.abort()

    def _fail(self, error: Exception) -> None:
        if self.lost is None:
            self.lost = error
            on_lost, self.on_lost, self.on_push = self.on_lost, None, None
            if on_lost is not None:
                on_lost()
        for handle in (self._flush_handle, self._watchdog):
            if handle is not None:
                handle.cancel()
        self._flush_handle = self._watchdog = None
        self._out.clear()
        waiting, self._waiting = self._waiting, deque()
        for future, _sent, _on_reply in waiting:
            if not future.done():
                future.set_exception(self._lost_error())
        self._handing = False
        self._wake_room()  # every waiter for room: they connect again
        self._tell_drained()

    async def drained(self) -> None:
        """Until no command is in flight (or the link is lost)."""
        if self._waiting and self.lost is None:
            if self._drained is None:
                self._drained = self._loop.create_future()
            await asyncio.shield(self._drained)

    def _tell_drained(self) -> None:
        drained, self._drained = self._drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _lost_error(self) -> Exception:
        """A fresh copy of why the link is gone: one exception object raised in many
        callers would collect all their tracebacks."""
        assert self.lost is not None
        return type(self.lost)(*self.lost.args)


class MuxRedis(aioredis.Redis):
    """``redis.asyncio.Redis`` over one multiplexed connection (see the module docs).

    ``pool`` is the redis-py pool: its connection settings are the link's, and it runs
    what must not share the link. Closing the client closes both. A ``dedicated`` client
    has one user, which may block its link (the SSE hub's reader): blocking commands
    go on the link too, and ``reply_timeout_s`` must exceed the longest block.

    ``max_in_flight``: commands waiting for replies on the link before callers wait for
    room, up to ``room_wait_s`` (``reply_timeout_s`` by default). A pool whose
    connections take a ``credential_provider`` signs the link in with fresh credentials
    from it at each connect."""

    sharded = False  # one Redis: every key on this node

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        reply_timeout_s: float = 10.0,
        dedicated: bool = False,
        max_in_flight: int = MAX_IN_FLIGHT,
        room_wait_s: float | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        super().__init__(connection_pool=pool)
        self._dedicated = dedicated
        redispy.close_pool_on_aclose(self)
        settings = redispy.link_settings(pool)
        self._decode_replies = settings.decode_responses
        self._db = settings.db
        self._max_in_flight = max_in_flight
        self._room_wait_s = reply_timeout_s if room_wait_s is None else room_wait_s
        # Told when commands wait on the link with nothing read (see _Link.on_stall).
        self.on_stall: Callable[[], None] | None = None
        # The link speaks RESP2 (no HELLO); the pool keeps whatever it was built for.
        self._callbacks = redispy.RESP2_CALLBACKS
        self._reply_timeout_s = reply_timeout_s
        self._link: _Link | None = None
        self._connecting: asyncio.Task[_Link] | None = None
        self._sends = 0
        self._commands = 0
        self.connects = 0

    # -- what callers can watch ----------------------------------------------------------

    @property
    def latency_ms(self) -> float:
        """How long Redis takes to answer now: the mean send → reply time of the last
        second's replies, or how long commands have waited with nothing read, if
        longer."""
        link = self._link
        return link.latency_ms if link is not None and link.lost is None else 0.0

    @property
    def in_flight(self) -> int:
        return self._link.in_flight if self._link is not None else 0

    @property
    def sends(self) -> int:
        """Socket writes so far: each one round trip for the commands it carries."""
        return self._sends + (self._link.sends if self._link is not None else 0)

    async def drained(self, within_s: float) -> None:
        """Until no command is in flight on the link, for ``within_s`` at most."""
        link = self._link
        if link is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within_s):
                    await link.drained()

    @property
    def commands(self) -> int:
        return self._commands + (self._link.commands if self._link is not None else 0)

    # -- its node (the interface it shares with ClusterMux: turnbus.shared.muxclient) -------

    @property
    def node_clients(self) -> list[MuxRedis]:
        return [self]

    async def masters(self) -> list[MuxRedis]:
        """This client: one Redis is its own only master."""
        return [self]

    async def node_for_key(self, key: Any) -> MuxRedis:
        return self

    def address_for_key(self, key: Any) -> tuple[str, int] | None:
        """This client's node (``None`` on a unix socket)."""
        return self.address_of(self)

    def address_of(self, node: aioredis.Redis) -> tuple[str, int] | None:
        return redispy.link_settings(node.connection_pool).address

    async def refresh(self) -> None:
        """Nothing to read: one Redis serves every key."""

    def pinned(self) -> aioredis.Redis:
        """:func:`single_link`: a connection of its own from the pool."""
        return single_link(self)

    def pubsub(self, attempt: int = 0, **kwargs: Any) -> PubSub:
        """A pub/sub connection from the pool (``attempt`` changes nothing on one Redis)."""
        return super().pubsub(**kwargs)

    # -- commands ------------------------------------------------------------------------

    async def call(self, *args: Any) -> Any:
        """A command's raw reply: bytes, ints and lists as RESP2 sends them, no parsing.
        Only a ``dedicated`` client may send a blocking command this way."""
        if not self._dedicated:
            refusal = link_state_refusal(args, self._db)
            if refusal is not None:
                raise refusal
            if _blocks(args):
                raise ValueError(f"{args[0]} would block the shared connection")
        return await self._send(args)

    async def call_into(self, on_reply: Callable[[Any], None], *args: Any) -> None:
        """:meth:`call`, whose reply goes to ``on_reply`` as soon as it is read off the
        socket, in the same callback, before any task waiting on the loop runs; returns
        once ``on_reply`` has run (and raises what it raised, or the command's error).
        Only for a ``dedicated`` client, whose one user cannot be cancelled away
        between the read and the hand-over (the SSE hub's reader)."""
        if not self._dedicated:
            raise ValueError("call_into is for a dedicated client")
        (future,) = await self._send_all([_pack(args)], on_reply)
        await future

    async def listen(
        self,
        on_lost: Callable[[], None],
        on_message: Callable[[Any], None] | None = None,
    ) -> None:
        """Connect (if not yet), and call ``on_lost`` once when this connection is lost
        or closed, and ``on_message`` with each pub/sub message it is pushed (raw, as
        ``[b"message", channel, payload]``). A later command on a lost client connects
        again, without either: the caller notices through ``on_lost`` and decides. Only
        for a ``dedicated`` client (the SSE hub's tracking links)."""
        if not self._dedicated:
            raise ValueError("listen is for a dedicated client")
        link = await self._connected()
        link.on_lost = on_lost
        link.on_push = on_message

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if not self._dedicated:
            refusal = link_state_refusal(args, self._db)
            if refusal is not None:
                raise refusal
            if _blocks(args):
                return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        try:
            reply = await self._send(args)
        except redis.exceptions.ResponseError:
            if EMPTY_REPLY_OPTION in options:
                return options[EMPTY_REPLY_OPTION]
            raise
        return self._parse(args[0], reply, options)

    def _send(self, args: Sequence[Any]) -> Any:
        """A future of the raw reply (or a coroutine, while the link connects or has no
        room)."""
        link = self._link
        if link is not None and link.lost is None and link.ready(1):
            return link.send(_pack(args))
        return self._send_later(_pack(args))

    async def _send_later(self, packed: bytes) -> Any:
        (future,) = await self._send_all([packed])
        return await future

    async def _send_all(
        self, packed: list[bytes], on_reply: Callable[[Any], None] | None = None
    ) -> list[asyncio.Future[Any]]:
        """Send ``packed`` together (adjacent on the link, in order), once the link is
        up and has room for them all; their replies' futures."""
        link = self._link
        count = len(packed)
        if link is None or link.lost is not None or not link.ready(count):
            link = await self._room_for(count)
        try:
            return [link.send(p, on_reply) for p in packed]
        finally:
            link.pass_room()

    async def _room_for(self, count: int) -> _Link:
        """A live link with room for ``count`` commands, waited for up to
        ``room_wait_s`` (a lost link's waiters connect again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._room_wait_s
        while True:
            link = await self._connected()
            if link.ready(count):
                return link
            try:
                async with asyncio.timeout_at(deadline):
                    await link.room(count)
            except TimeoutError:
                raise redis.exceptions.TimeoutError(
                    f"no room on the Redis connection for {self._room_wait_s:.0f} s: "
                    f"{link.in_flight} commands in flight (max_in_flight "
                    f"{self._max_in_flight})"
                ) from None
            if link.lost is None:
                return link

    def _parse(self, name: Any, reply: Any, options: dict[str, Any]) -> Any:
        raw = options.pop(UNDECODED_OPTION, False) or not self._decode_replies
        options.pop(EMPTY_REPLY_OPTION, None)
        options.pop("keys", None)
        if not raw:
            reply = _decode(reply)
        callback = self._callbacks.get(name)
        if callback is not None:
            return callback(reply, **options)
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        if transaction:
            return super().pipeline(transaction=True, shard_hint=shard_hint)
        return _MuxPipeline(self)

    # -- the connection ------------------------------------------------------------------

    async def _connected(self) -> _Link:
        link = self._link
        if link is not None and link.lost is None:
            return link
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(
                self._connect(), name="redis-mux:connect"
            )
        # Shielded: one caller's cancel must not stop the connect the others wait on.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Link:
        old = self._link
        if old is not None:
            self._sends += old.sends
            self._commands += old.commands
            self._link = None
        settings = redispy.link_settings(self.connection_pool)
        loop = asyncio.get_running_loop()
        timeout = settings.connect_timeout_s or 5.0

        def factory() -> _Link:
            return _Link(loop, self._reply_timeout_s, self._max_in_flight)

        try:
            async with asyncio.timeout(timeout):
                if settings.path is not None:
                    _, link = await loop.create_unix_connection(factory, settings.path)
                else:
                    ssl = settings.tls() if settings.tls is not None else None
                    _, link = await loop.create_connection(
                        factory, settings.host, settings.port, ssl=ssl
                    )
                hello: list[Sequence[Any]] = []
                username, password = settings.username, settings.password
                if settings.credentials is not None:  # fresh ones (a token) at every connect
                    *user, password = await settings.credentials.get_credentials_async()
                    username = user[0] if user else None
                if password is not None:
                    hello.append(("AUTH", username, password) if username else ("AUTH", password))
                if settings.db:
                    hello.append(("SELECT", settings.db))
                if settings.client_name:
                    hello.append(("CLIENT", "SETNAME", settings.client_name))
                try:
                    await asyncio.gather(*(link.send(_pack(cmd)) for cmd in hello))
                except BaseException:
                    link.close()
                    raise
        except TimeoutError:
            raise redis.exceptions.TimeoutError(
                f"Redis did not accept a connection within {timeout:.0f} s"
            ) from None
        except OSError as exc:
            raise redis.exceptions.ConnectionError(f"cannot connect to Redis: {exc}") from None
        self.connects += 1
        link.on_stall = self.on_stall
        self._link = link
        return link

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        task, self._connecting = self._connecting, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._link is not None:
            self._link.close()
            self._link = None
        await super().aclose(close_connection_pool)


class NotDedicated:
    """Mixed into a client that is never a dedicated link (one node's, with one user):
    it refuses the calls only such a link takes."""

    async def call_into(self, on_reply: Callable[[Any], None], *args: Any) -> None:
        raise ValueError("call_into is for a dedicated link (connect.dedicated_link)")

    async def listen(
        self, on_lost: Callable[[], None], on_message: Callable[[Any], None] | None = None
    ) -> None:
        raise ValueError("listen is for a dedicated link (connect.dedicated_link)")


def single_link(client: aioredis.Redis) -> aioredis.Redis:
    """A plain client of one connection of ``client``'s pool, its own until ``aclose``
    gives it back (a write and its ``WAIT``, which counts the writes of its own
    connection)."""
    return aioredis.Redis(connection_pool=client.connection_pool, single_connection_client=True)


class SendingPipeline(redispy.QueuedPipeline):
    """``pipeline(transaction=False)`` on a client that sends each command itself (the
    multiplexed link, the cluster's links): :meth:`execute` sends every queued command
    in the same pass of the loop, so each link's write carries all of them, and answers
    as redis-py's pipeline does (an error reply in its place, or raised). A command that
    would change the shared connection's state is refused as it is queued."""

    def __init__(self, client: aioredis.Redis, db: int = 0) -> None:
        super().__init__(client)
        self._db = db

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        refusal = link_state_refusal(args, self._db)
        if refusal is not None:
            raise refusal
        return super().execute_command(*args, **kwargs)

    async def _replies(self, stack: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Any]:
        """Each command's raw reply, or the exception it met, in order."""
        raise NotImplementedError

    def _parsed(self, args: Sequence[Any], options: Mapping[str, Any], reply: Any) -> Any:
        """What :meth:`execute` answers for one command's (non-error) reply."""
        return reply

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = self.take_queued()
        if not stack:
            return []
        replies = await self._replies(stack)
        results: list[Any] = []
        for (args, options), reply in zip(stack, replies, strict=True):
            if isinstance(reply, redis.exceptions.ResponseError):
                results.append(reply)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                results.append(self._parsed(args, options, reply))
        if raise_on_error:
            for n, result in enumerate(results):
                if isinstance(result, redis.exceptions.ResponseError):
                    result.args = (f"Command # {n + 1} of pipeline caused error: {result}",)
                    raise result
        return results


class _MuxPipeline(SendingPipeline):
    """``pipeline(transaction=False)`` on the link: its commands go out together, in
    one send (adjacent, in order, even while callers wait for room)."""

    def __init__(self, client: MuxRedis) -> None:
        super().__init__(client, client._db)
        self._client = client

    async def _replies(self, stack: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Any]:
        futures = await self._client._send_all([_pack(args) for args, _ in stack])
        return await asyncio.gather(*futures, return_exceptions=True)

    def _parsed(self, args: Sequence[Any], options: Mapping[str, Any], reply: Any) -> Any:
        return self._client._parse(args[0], reply, dict(options))
