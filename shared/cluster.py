"""A Redis Cluster client made of one :class:`~turnbus.shared.mux.MuxRedis` per node.

:class:`ClusterMux` is a ``redis.asyncio.Redis``: every command method, scripts and
pipelines (``transaction=False``) work as on one Redis. Each command goes to the master
serving its key's slot (CRC16 of the key, or of its ``{hash tag}``), on that node's
multiplexed link; blocking reads (``XREAD``/``XREADGROUP`` with ``BLOCK``) go to the
node's pool, a connection of their own, as :class:`MuxRedis` does on one Redis.

The slot map comes from ``CLUSTER SLOTS`` (Redis 6.2 and 7 alike), asked of any node
that answers. What the client does with what the cluster says:

- ``MOVED``: the slot has a new owner. The slot is pointed there at once, the whole map
  is re-read in the background, and the command is sent again. After
  ``_MAX_REDIRECTS`` redirections the command fails with :class:`TooManyRedirects`.
- ``ASK`` (a slot half-way through a reshard): ``ASKING`` then the command on the node
  named, once; the map is left alone.
- ``TRYAGAIN`` (a multi-key command during a reshard), ``CLUSTERDOWN``, ``READONLY``
  (a demoted master), ``LOADING``: a short backoff, the map re-read, and again.
- A master that does not accept a connection (killed; its replica not promoted yet): the
  map is re-read from any node that answers, with backoff, until the replica has taken
  over or ``failover_wait_s`` has passed. Such a command was never sent, so sending it
  again cannot run it twice.
- A connection lost with commands in flight: whether they ran is unknown, as on one
  Redis. Reads and idempotent commands are sent again on the new owner; any other
  command fails with ``ConnectionError`` (its caller decides, as it does on one Redis)
  and the map is re-read, so the next command finds the new master.
- A master that answers nothing (stopped: its links half-open): after a second of
  commands waiting with nothing read, the map is re-read; once the master is out of it,
  its links are closed (as a lost connection, above).

The map (:class:`SlotMap`) is read at most once per ``_MAP_READ_GAP_S``, by one caller
for all; a node that leaves it, or is no longer a master, is closed and dropped.

Keyless commands go to one master, but those whose answer spans the cluster: sent to
every master and merged (``DBSIZE`` summed, ``KEYS`` joined, ``SCRIPT EXISTS`` true where
every master has the script, ``FLUSHDB``, ``SCRIPT LOAD`` and the like the same
everywhere); what describes one node (``CONFIG GET``, ``SLOWLOG``, ...) is refused by
name. A pipeline's commands redirected or told to wait are sent again together, in
order. ``DEL``/``UNLINK``/``EXISTS``/
``TOUCH`` over keys of several slots are split by slot and their counts summed; any
other command whose keys span slots fails with ``CROSSSLOT`` before it is sent.
``scan_iter`` walks every master. ``pubsub()`` is a pub/sub connection to one master
(Redis Cluster broadcasts ``PUBLISH`` to every node). ``WAIT`` counts the writes of its
own connection, so it is refused here: :meth:`ClusterMux.pinned` is a client of one
connection, on the master its first command routes to, for a write and its ``WAIT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rex
from redis.asyncio.client import Pipeline, PubSub

from turnbus.shared import redispy
from turnbus.shared.backoff import Backoff
from turnbus.shared.keys import key_slot
from turnbus.shared.mux import MuxRedis, NotDedicated, SendingPipeline, _pack, single_link
from turnbus.shared.scripts import text

__all__ = ["SLOTS", "Address", "ClusterMux", "SlotMap", "TooManyRedirects", "command_keys"]

log = logging.getLogger(__name__)

SLOTS = 16384
Address = tuple[str, int]

# Commands whose first argument names a subcommand ("XINFO GROUPS key", "SCRIPT LOAD").
_CONTAINERS = frozenset(
    {
        "ACL", "CLIENT", "CLUSTER", "COMMAND", "CONFIG", "DEBUG", "FUNCTION", "LATENCY",
        "MEMORY", "MODULE", "OBJECT", "PUBSUB", "SCRIPT", "SLOWLOG", "XGROUP", "XINFO",
    }
)  # fmt: skip
# Containers whose subcommands name no key (the rest take their key after the subcommand).
_KEYLESS_CONTAINERS = frozenset(_CONTAINERS - {"MEMORY", "OBJECT", "XGROUP", "XINFO"})
_KEYLESS = frozenset(
    {
        "PING", "INFO", "TIME", "ECHO", "DBSIZE", "PUBLISH", "LASTSAVE", "ROLE", "WAIT",
        "WAITAOF", "RANDOMKEY", "READONLY", "READWRITE", "SUBSCRIBE", "PSUBSCRIBE",
        "MEMORY STATS", "MEMORY DOCTOR", "KEYS", "FLUSHDB", "FLUSHALL", "SCAN", "SWAPDB",
        "SAVE", "BGSAVE", "BGREWRITEAOF", "SHUTDOWN",
    }
)  # fmt: skip


def _same(replies: list[Any]) -> Any:
    return replies[0]  # every master said the same (an error reply was raised)


def _every_key(replies: list[Any]) -> list[Any]:
    return [key for reply in replies for key in reply]


def _everywhere(replies: list[list[Any]]) -> list[bool]:
    return [all(column) for column in zip(*replies, strict=True)]


def _some_key(replies: list[Any]) -> Any:
    keys = [reply for reply in replies if reply is not None]
    return random.choice(keys) if keys else None


# Commands whose answer spans the cluster: sent to every master, their replies merged.
_EVERY_MASTER: dict[str, Callable[[list[Any]], Any]] = {
    "PING": _same,
    "SCRIPT LOAD": _same,
    "SCRIPT FLUSH": _same,
    "FUNCTION LOAD": _same,
    "FUNCTION FLUSH": _same,
    "FUNCTION DELETE": _same,
    "FLUSHALL": _same,
    "FLUSHDB": _same,
    "CONFIG SET": _same,
    "CONFIG RESETSTAT": _same,
    "DBSIZE": lambda replies: sum(int(r) for r in replies),
    "KEYS": _every_key,
    "SCRIPT EXISTS": _everywhere,
    "RANDOMKEY": _some_key,
}
# Commands about one node that no merge makes an answer about the cluster: refused.
_PER_NODE = frozenset(
    {
        "SCRIPT KILL", "FUNCTION KILL", "FUNCTION LIST", "FUNCTION STATS", "FUNCTION DUMP",
        "FUNCTION RESTORE", "CONFIG GET", "CONFIG REWRITE", "CLIENT LIST", "CLIENT KILL",
        "MEMORY STATS", "MEMORY DOCTOR", "MEMORY PURGE", "MEMORY MALLOC-STATS", "SAVE",
        "BGSAVE", "BGREWRITEAOF", "LASTSAVE", "SWAPDB", "MOVE", "SHUTDOWN", "SLOWLOG GET",
        "SLOWLOG LEN", "SLOWLOG RESET", "LATENCY LATEST", "LATENCY HISTORY", "LATENCY RESET",
        "DEBUG",
    }
)  # fmt: skip
_SCRIPTS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
_SPLIT_COUNT = frozenset({"DEL", "UNLINK", "EXISTS", "TOUCH"})
_MULTI_KEY = frozenset({"MGET", "SINTER", "SUNION", "SDIFF", "PFCOUNT", "RENAME", "LMOVE"})
# Safe to send again after the connection was lost with it in flight: reads, and writes
# whose second run changes nothing (a read of a consumer group re-delivers nothing new:
# what the lost reply held stays pending, for XAUTOCLAIM).
_SAFE_AGAIN = frozenset(
    {
        "GET", "MGET", "STRLEN", "EXISTS", "TYPE", "TTL", "PTTL", "HGET", "HMGET", "HGETALL",
        "HLEN", "HEXISTS", "HKEYS", "HVALS", "LRANGE", "LLEN", "LINDEX", "SMEMBERS",
        "SISMEMBER", "SCARD", "ZRANGE", "ZRANGEBYSCORE", "ZREVRANGE", "ZSCORE", "ZCARD",
        "ZRANGEBYLEX", "ZREVRANGEBYLEX", "ZREVRANGEBYSCORE", "ZCOUNT", "ZRANK",
        "XRANGE", "XREVRANGE", "XLEN", "XREAD", "XREADGROUP", "XPENDING", "XINFO GROUPS",
        "XINFO CONSUMERS", "XINFO STREAM", "PING", "INFO", "TIME", "ECHO", "DBSIZE",
        "SCRIPT LOAD", "SCRIPT EXISTS", "CLUSTER SLOTS", "CLUSTER INFO", "CLUSTER SHARDS",
        "CLUSTER NODES", "MEMORY USAGE", "OBJECT ENCODING", "DEL", "UNLINK", "XACK", "HDEL",
        "EVALSHA_RO", "EVAL_RO",
    }
)  # fmt: skip
_MAX_REDIRECTS = 16
# The slot map is read at most once per this span (a storm of MOVED replies, many
# commands backing off at once: one read serves them all).
_MAP_READ_GAP_S = 0.2
# How long a node that left the slot map has to answer what is in flight on it.
_RETIRE_S = 1.0
# What a command sent to one given master answers when that node, unreachable, has
# left the slot map meanwhile (its replica took over).
_GONE: Any = object()
# Replies that say the command belongs on another node (or later): it did not run.
_ELSEWHERE = (rex.AskError, rex.TryAgainError, rex.ClusterDownError, rex.ReadOnlyError)
_ASKING = _pack(("ASKING",))


def _word(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("ascii", "replace").upper()
    return str(value).upper()


def _split_name(args: Sequence[Any]) -> tuple[str, Sequence[Any]]:
    """The command's full name (``XINFO GROUPS``) and the arguments after it."""
    name = _word(args[0])
    if " " in name:  # redis-py sends "XINFO GROUPS" as one argument
        return " ".join(name.split()), args[1:]
    if name in _CONTAINERS and len(args) > 1:
        return f"{name} {_word(args[1])}", args[2:]
    return name, args[1:]


def command_keys(args: Sequence[Any]) -> tuple[str, list[Any] | None]:
    """A command's name and its keys (``None``: the command names no key)."""
    name, rest = _split_name(args)
    if name in _KEYLESS or name.split(" ", 1)[0] in _KEYLESS_CONTAINERS:
        return name, None
    if name in _SCRIPTS:
        count = int(rest[1]) if len(rest) > 1 else 0
        return name, (list(rest[2 : 2 + count]) or None)
    if name in ("XREAD", "XREADGROUP"):
        words = [_word(a) if isinstance(a, str | bytes) else "" for a in rest]
        if "STREAMS" not in words:
            return name, None
        tail = rest[words.index("STREAMS") + 1 :]
        return name, list(tail[: len(tail) // 2])
    if name in ("MSET", "MSETNX"):
        return name, list(rest[::2])
    if name in _SPLIT_COUNT or name in _MULTI_KEY:
        return name, list(rest)
    return name, (list(rest[:1]) or None)


def _slot(key: Any) -> int:
    if isinstance(key, str | bytes):
        return key_slot(key)
    if isinstance(key, bytearray | memoryview):
        return key_slot(bytes(key))
    return key_slot(str(key))


class _NotSent(rex.ConnectionError):
    """No node could take the command: it was never written to any."""


class TooManyRedirects(rex.ClusterError):
    """A command redirected (``MOVED``/``ASK``) more times than the client follows."""


def _too_many(name: str, last: Exception) -> TooManyRedirects:
    return TooManyRedirects(
        f"{name}: still redirected after {_MAX_REDIRECTS} redirections (last: {last}); "
        "the cluster's slots are not settling"
    )


async def _connecting(connect: Awaitable[Any]) -> None:
    """Await a connect: its failure means nothing was sent (:class:`_NotSent`), but for
    a refused sign-in, which no retry mends."""
    try:
        await connect
    except (rex.ConnectionError, rex.TimeoutError) as exc:
        if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError):
            raise
        raise _NotSent(str(exc)) from exc


class SlotMap:
    """Which master serves each slot, and every node's client: the map read from any
    node that answers ``CLUSTER SLOTS`` (reads shared by their callers, and at most one
    per ``_MAP_READ_GAP_S``); a node that leaves the map (removed, or no longer a
    master) has its client closed and dropped."""

    def __init__(self, node_client: Callable[[str, int], MuxRedis], seeds: Sequence[Address]):
        self._node_client = node_client
        self.seeds = list(seeds)
        self.nodes: dict[Address, MuxRedis] = {}
        self.slots: list[MuxRedis | None] = []
        self.masters: list[MuxRedis] = []
        self._known: list[Address] = list(seeds)  # every node the map named, replicas too
        self._reading: asyncio.Task[None] | None = None
        self._last_read = -_MAP_READ_GAP_S
        self._background: set[asyncio.Task[Any]] = set()
        self.reads = 0  # slot maps read so far

    def node(self, address: Address) -> MuxRedis:
        """The client of the node at ``address`` (made on first use). Commands that wait
        on it with nothing read ask for the map again (a stopped master may be
        replaced: its client is then closed, and its commands fail over)."""
        client = self.nodes.get(address)
        if client is None:
            client = self.nodes[address] = self._node_client(*address)
            client.on_stall = self.read_soon
        return client

    def address_of(self, node: MuxRedis) -> Address:
        for address, client in self.nodes.items():
            if client is node:
                return address
        raise KeyError("not a node of this cluster client")

    async def read(self) -> None:
        """Read the map again (callers at once share one read)."""
        task = self._reading
        if task is None or task.done():
            task = self._reading = asyncio.get_running_loop().create_task(
                self._read_after_gap(), name="redis-cluster:refresh"
            )
        await asyncio.shield(task)

    def read_soon(self) -> None:
        if self._reading is not None and not self._reading.done():
            return
        self._in_background(self._read_quietly())

    def _in_background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _read_quietly(self) -> None:
        with contextlib.suppress(rex.RedisError, OSError):
            await self.read()

    async def _read_after_gap(self) -> None:
        loop = asyncio.get_running_loop()
        wait = self._last_read + _MAP_READ_GAP_S - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = loop.time()
        masters = [self.address_of(m) for m in self.masters]
        random.shuffle(masters)
        candidates = list(dict.fromkeys([*masters, *self._known, *self.seeds]))
        errors: list[str] = []
        for address in candidates:
            try:
                async with asyncio.timeout(2.0):
                    reply = await self.node(address).call("CLUSTER", "SLOTS")
            except (rex.AuthenticationError, rex.AuthorizationError):
                raise  # a refused sign-in: no other node or retry mends it
            except (rex.RedisError, OSError, TimeoutError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc}")
                continue
            self._apply(reply, address)
            return
        raise _NotSent("no Redis Cluster node answered CLUSTER SLOTS (" + "; ".join(errors) + ")")

    def _apply(self, reply: Any, asked: Address) -> None:
        slots: list[MuxRedis | None] = [None] * SLOTS
        masters: dict[Address, MuxRedis] = {}
        known: list[Address] = []
        for entry in reply:
            start, end = int(entry[0]), int(entry[1])
            nodes: list[Address] = []
            for node in entry[2:]:
                host = text(node[0]) or asked[0]  # "" means "the address you asked"
                nodes.append((asked[0] if host == "?" else host, int(node[1])))
            master = self.node(nodes[0])
            masters[nodes[0]] = master
            known.extend(nodes)
            slots[start : end + 1] = [master] * (end - start + 1)
        self.slots = slots
        self.masters = list(masters.values())
        self._known = list(dict.fromkeys(known))
        self.reads += 1
        for address in [a for a in self.nodes if a not in masters]:
            self._in_background(self._retire(self.nodes.pop(address)))

    @staticmethod
    async def _retire(node: MuxRedis) -> None:
        """Close a node that left the map, or is no longer a master, once its commands
        in flight are answered (a ``MOVED`` each, likely), or after ``_RETIRE_S``: a
        node that answers nothing (stopped) fails them as a lost connection, and reads
        and idempotent commands are sent again on their slot's master now."""
        await node.drained(_RETIRE_S)
        await node.aclose()

    async def close(self) -> None:
        for task in [self._reading, *self._background]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        nodes, self.nodes = self.nodes, {}
        self.slots, self.masters = [], []
        for node in nodes.values():
            await node.aclose()


# (mypy: redis-py's own command mixins disagree on command_info in a class of two bases.)
class ClusterMux(NotDedicated, aioredis.Redis):  # type: ignore[misc]
    """``redis.asyncio.Redis`` over a Redis Cluster (see the module docs).

    ``node_client(host, port)`` builds the :class:`MuxRedis` of one node (the factory in
    :mod:`turnbus.shared.connect` gives each node the same settings); ``seeds`` are where the
    slot map is first asked for."""

    sharded = True  # each slot on one master

    def __init__(
        self,
        node_client: Callable[[str, int], MuxRedis],
        seeds: Sequence[Address],
        *,
        failover_wait_s: float = 20.0,
    ) -> None:
        if not seeds:
            raise ValueError("a cluster client needs at least one node address")
        # The base class wants a pool; nothing is sent on this one (every command is
        # routed to a node's client), so it never connects.
        pool = aioredis.ConnectionPool(host=seeds[0][0], port=seeds[0][1])
        super().__init__(connection_pool=pool)
        redispy.close_pool_on_aclose(self)
        self._map = SlotMap(node_client, seeds)
        self._failover_wait_s = failover_wait_s
        self.redirects = 0  # MOVED and ASK replies followed

    # -- what callers can watch ----------------------------------------------------------

    @property
    def latency_ms(self) -> float:
        """The slowest node's moving average of send → reply."""
        return max((n.latency_ms for n in self._map.masters), default=0.0)

    @property
    def sends(self) -> int:
        return sum(n.sends for n in self._map.nodes.values())

    @property
    def commands(self) -> int:
        return sum(n.commands for n in self._map.nodes.values())

    @property
    def node_clients(self) -> list[MuxRedis]:
        """The client of every node in use (pools to watch)."""
        return list(self._map.nodes.values())

    @property
    def refreshes(self) -> int:
        """Slot maps read so far."""
        return self._map.reads

    # -- the slot map --------------------------------------------------------------------

    def node(self, address: Address) -> MuxRedis:
        """The client of the node at ``address`` (made on first use)."""
        return self._map.node(address)

    def address_of(self, node: MuxRedis) -> Address:
        return self._map.address_of(node)

    def address_for_key(self, key: Any) -> Address | None:
        """The address of the master serving ``key``'s slot, as the map has it now
        (``None``: no map read yet, or the slot is not served)."""
        node = self._map.slots[_slot(key)] if self._map.slots else None
        return None if node is None else self.address_of(node)

    async def masters(self) -> list[MuxRedis]:
        """The client of every master, as the slot map has them now."""
        if not self._map.slots:
            await self.refresh()
        return list(self._map.masters)

    async def node_for_key(self, key: Any) -> MuxRedis:
        """The client of the master serving ``key``'s slot now."""
        return await self._node_of(_slot(key))

    async def refresh(self) -> None:
        """Read the slot map again (callers at once share one read; one read at most
        per 0.2 s)."""
        await self._map.read()

    def _moved(self, exc: rex.AskError) -> MuxRedis:
        """The node a ``MOVED``/``ASK`` names; for ``MOVED``, the slot pointed there
        at once and the map read again soon."""
        self.redirects += 1
        moved_to = self.node((exc.host, exc.port))
        if isinstance(exc, rex.MovedError):
            if self._map.slots:
                self._map.slots[exc.slot_id] = moved_to
            self._map.read_soon()
        return moved_to

    # -- commands ------------------------------------------------------------------------

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name, keys = command_keys(args)
        if not keys:
            return await self._keyless(name, args, options)
        slots = {_slot(k) for k in keys}
        if len(slots) == 1:
            return await self._run(slots.pop(), args, options, name)
        if name in _SPLIT_COUNT:
            by_slot: dict[int, list[Any]] = {}
            for key in keys:
                by_slot.setdefault(_slot(key), []).append(key)
            counts = await asyncio.gather(
                *(self._run(s, (args[0], *ks), options, name) for s, ks in by_slot.items())
            )
            return sum(int(c) for c in counts)
        raise rex.ClusterCrossSlotError(f"{name}: keys in request don't hash to the same slot")

    async def _keyless(self, name: str, args: Sequence[Any], options: dict[str, Any]) -> Any:
        merge = _EVERY_MASTER.get(name)
        if merge is not None:
            return merge(await self._on_every_master(name, args, options))
        if name in _PER_NODE or name.split(" ", 1)[0] in _PER_NODE:
            raise rex.DataError(
                f"{name} is about one node, not the Redis Cluster: send it to each node "
                "(await client.masters())"
            )
        if name == "SCAN":
            raise rex.DataError("SCAN on a Redis Cluster: use scan_iter, which walks every master")
        if name in ("WAIT", "WAITAOF"):
            # WAIT counts the writes of the connection it is sent on: routed alone it
            # would wait for nothing. It must follow its write on that write's connection.
            raise rex.DataError(f"{name} must follow its write on the same node connection")
        return await self._run(None, args, options, name)

    async def _on_every_master(
        self, name: str, args: Sequence[Any], options: dict[str, Any]
    ) -> list[Any]:
        """The replies of every master. A master that died meanwhile has no say; the
        replica that took its slots over is asked in its place."""
        answered: dict[int, Any] = {}
        for _ in range(3):
            todo = [m for m in await self.masters() if id(m) not in answered]
            replies = await asyncio.gather(*(self._run(m, args, options, name) for m in todo))
            answered.update(
                (id(m), r) for m, r in zip(todo, replies, strict=True) if r is not _GONE
            )
            if _GONE not in replies:
                break
        if not answered:
            raise rex.ClusterDownError(f"{name}: no master answered")
        return list(answered.values())

    async def _run(
        self,
        target: int | MuxRedis | None,
        args: Sequence[Any],
        options: dict[str, Any],
        name: str,
        pin: _PinnedLink | None = None,
    ) -> Any:
        """Send one command to its node, following redirects and riding out a failover.

        ``target``: a slot, a node (every-master commands), or ``None`` (any master).
        ``pin``: send it on a connection of its own, which the pinned link then keeps."""
        backoff: Backoff | None = None  # made at the first failure: most commands have none
        redirects = 0
        asking: MuxRedis | None = None
        while True:
            try:
                if asking is not None:
                    node, asking = asking, None
                    if pin is not None:
                        return await pin.send(node, args, options, asking=True)
                    return await self._asking(node, args, options)
                node = await self._node_of(target)
                if pin is not None:
                    return await pin.send(node, args, options)
                await _connecting(node._connected())
                return await node.execute_command(*args, **options)
            except rex.AskError as exc:  # MovedError too
                redirects += 1
                if redirects > _MAX_REDIRECTS:
                    raise _too_many(name, exc) from exc
                moved_to = self._moved(exc)
                if not isinstance(exc, rex.MovedError):
                    asking = moved_to
                continue
            except (
                rex.TryAgainError,
                rex.ClusterDownError,
                rex.ReadOnlyError,
                rex.ConnectionError,
                rex.TimeoutError,
            ) as exc:
                if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError):
                    raise
                lost = isinstance(exc, rex.ConnectionError | rex.TimeoutError)
                never_sent = isinstance(exc, _NotSent | rex.BusyLoadingError)
                if lost and not never_sent and name not in _SAFE_AGAIN:
                    self._map.read_soon()  # the next command finds the new master
                    raise
                if backoff is None:
                    backoff = self._backoff()
                delay = next(backoff, None)
                if delay is None:
                    raise
                log.info("Redis Cluster: %s (%s); retrying in %.2f s", name, exc, delay)
                await asyncio.sleep(delay)
                if not isinstance(exc, rex.TryAgainError):
                    with contextlib.suppress(rex.ConnectionError):
                        await self.refresh()
                gone = isinstance(target, MuxRedis) and target not in self._map.masters
                if gone and self._map.slots:
                    return _GONE  # that node no longer serves a slot: nothing to send it

    def _backoff(self) -> Backoff:
        """50 ms doubling to 0.5 s, for up to ``failover_wait_s`` from the first failure."""
        loop = asyncio.get_running_loop()
        return Backoff(0.05, 0.5, within_s=self._failover_wait_s, clock=loop.time)

    async def _node_of(self, target: int | MuxRedis | None) -> MuxRedis:
        if isinstance(target, MuxRedis):
            return target
        if not self._map.slots:
            await self.refresh()
        if target is None:
            if not self._map.masters:
                raise rex.ClusterDownError("no master serves any slot")
            return self._map.masters[0]
        node = self._map.slots[target]
        if node is None:
            raise rex.ClusterDownError(f"slot {target} is not served")
        return node

    async def _asking(self, node: MuxRedis, args: Sequence[Any], options: dict[str, Any]) -> Any:
        """``ASKING`` and the command, adjacent on the node's link."""
        pipe = node.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command(*args, **options)
        _, reply = await pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def pinned(self) -> aioredis.Redis:
        """A client of one connection of its own, on the master serving the slot of the
        first command it sends (found as for any command: redirects followed, a failover
        waited out), kept for every later command: what ``WAIT`` needs, since it counts
        the writes of its own connection. Close it with ``aclose``."""
        return _PinnedLink(self)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        if transaction:
            raise rex.RedisClusterException(
                "MULTI transactions are not supported on a Redis Cluster client: "
                "use a Lua script over one slot"
            )
        return _ClusterPipeline(self)

    def pubsub(self, attempt: int = 0, **kwargs: Any) -> PubSub:
        """A pub/sub connection to one master (``PUBLISH`` reaches every node).
        ``attempt``: how many subscriptions were lost before this one; each takes the
        next master (the one lost may be a dead node the slot map still lists), and the
        map is read again meanwhile."""
        if attempt:
            self._map.read_soon()
        masters = self._map.masters or [self.node(self._map.seeds[0])]
        return masters[attempt % len(masters)].pubsub(**kwargs)

    async def scan_iter(  # type: ignore[override]
        self,
        match: Any = None,
        count: int | None = None,
        _type: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """Every key of every master (a key moved during the walk may come twice or not
        at all, as with SCAN on one node)."""
        for node in await self.masters():
            async for key in node.scan_iter(match=match, count=count, _type=_type, **kwargs):
                yield key

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await self._map.close()
        await super().aclose(close_connection_pool)


class _ClusterPipeline(SendingPipeline):
    """``pipeline(transaction=False)`` over the cluster: each command goes to its own
    node, a node's commands together in one write, in order. Commands redirected
    (``MOVED``, ``ASK``) or told to wait (``TRYAGAIN``, a failover) are sent again
    together, still in their order, until each has its answer."""

    def __init__(self, client: ClusterMux) -> None:
        super().__init__(client)
        self._client = client

    async def _replies(self, stack: Sequence[tuple[Sequence[Any], Mapping[str, Any]]]) -> list[Any]:
        replies: list[Any] = [None] * len(stack)
        routed: list[tuple[int, int, str]] = []  # (index, slot, name)
        apart: list[int] = []  # keyless, every-master and multi-slot commands
        for i, (args, _) in enumerate(stack):
            name, keys = command_keys(args)
            slots = {_slot(k) for k in keys} if keys and name not in _EVERY_MASTER else set()
            if len(slots) == 1:
                routed.append((i, slots.pop(), name))
            else:
                apart.append(i)
        alone = asyncio.gather(
            *(self._client.execute_command(*stack[i][0], **stack[i][1]) for i in apart),
            return_exceptions=True,
        )
        await self._in_order(stack, routed, replies)
        for i, reply in zip(apart, await alone, strict=True):
            replies[i] = reply
        return replies

    def _parsed(self, args: Sequence[Any], options: Mapping[str, Any], reply: Any) -> Any:
        return reply  # parsed as it came (the node's, or the cluster's, own parse)

    async def _in_order(
        self,
        stack: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
        routed: list[tuple[int, int, str]],
        replies: list[Any],
    ) -> None:
        """Send each routed command to its slot's master, a node's together and in
        order; send again, in order, what is redirected or must wait, as one batch."""
        cluster = self._client
        asking: dict[int, MuxRedis] = {}
        backoff: Backoff | None = None
        redirects = 0
        while routed:
            by_node: dict[MuxRedis, list[tuple[int, bool]]] = {}
            for i, slot, _ in routed:
                node = asking.pop(i, None)
                ask = node is not None
                if node is None:
                    try:
                        node = await cluster._node_of(slot)
                    except rex.ClusterDownError as exc:
                        replies[i] = exc
                        continue
                by_node.setdefault(node, []).append((i, ask))
            sent = await asyncio.gather(
                *(self._to_node(node, items, stack) for node, items in by_node.items()),
                return_exceptions=True,
            )
            for items, got in zip(by_node.values(), sent, strict=True):
                for n, (i, _) in enumerate(items):
                    replies[i] = got if isinstance(got, BaseException) else got[n]
            again: list[tuple[int, int, str]] = []
            waits = redirected = False
            for i, slot, name in routed:
                reply = replies[i]
                if isinstance(reply, rex.AskError):
                    redirected = True
                    if redirects >= _MAX_REDIRECTS:
                        replies[i] = _too_many(name, reply)
                        continue
                    moved_to = cluster._moved(reply)
                    if not isinstance(reply, rex.MovedError):
                        asking[i] = moved_to
                    again.append((i, slot, name))
                elif self._waits(reply, name):
                    waits = True
                    again.append((i, slot, name))
            redirects += redirected
            if waits:
                backoff = backoff or cluster._backoff()
                delay = next(backoff, None)
                if delay is None:
                    return  # each keeps the error it met
                await asyncio.sleep(delay)
                with contextlib.suppress(rex.ConnectionError):
                    await cluster.refresh()
            routed = again

    def _waits(self, reply: Any, name: str) -> bool:
        """Whether a command's reply says: send it again once the cluster settles."""
        if isinstance(reply, rex.AuthenticationError | rex.AuthorizationError):
            return False
        if isinstance(reply, (*_ELSEWHERE, _NotSent, rex.BusyLoadingError)):
            return True
        if isinstance(reply, rex.ConnectionError | rex.TimeoutError):
            self._client._map.read_soon()
            return name in _SAFE_AGAIN  # else whether it ran is unknown: its caller's call
        return False

    @staticmethod
    async def _to_node(
        node: MuxRedis,
        items: list[tuple[int, bool]],
        stack: Sequence[tuple[Sequence[Any], Mapping[str, Any]]],
    ) -> list[Any]:
        """Each item's parsed reply (or error): sent on ``node``'s link together, in
        order, an ``ASKING`` just before each item that was asked elsewhere."""
        packed: list[bytes] = []
        for i, ask in items:
            if ask:
                packed.append(_ASKING)
            packed.append(_pack(stack[i][0]))
        await _connecting(node._connected())
        raw = iter(await asyncio.gather(*await node._send_all(packed), return_exceptions=True))
        out: list[Any] = []
        for i, ask in items:
            if ask:
                next(raw)
            reply = next(raw)
            if not isinstance(reply, BaseException):
                args, options = stack[i]
                reply = node._parse(args[0], reply, dict(options))
            out.append(reply)
        return out


class _PinnedLink(aioredis.Redis):
    """:meth:`ClusterMux.pinned`: one pooled connection of one node, chosen by the first
    keyed command."""

    def __init__(self, cluster: ClusterMux) -> None:
        # The base class wants a pool; commands go to the node's connection instead.
        super().__init__(connection_pool=cluster.connection_pool)
        self._cluster = cluster
        self._client: aioredis.Redis | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self._client is not None:
            return await self._client.execute_command(*args, **options)  # type: ignore[no-untyped-call]
        name, keys = command_keys(args)
        if not keys:
            raise rex.DataError(f"a pinned link's first command names its key, not {name}")
        slots = {_slot(k) for k in keys}
        if len(slots) > 1:
            raise rex.ClusterCrossSlotError(f"{name}: keys in request don't hash to the same slot")
        return await self._cluster._run(slots.pop(), args, options, name, pin=self)

    async def send(
        self, node: MuxRedis, args: Sequence[Any], options: dict[str, Any], *, asking: bool = False
    ) -> Any:
        """The first command, on a connection of ``node``'s pool; kept if it ran there."""
        client = single_link(node)
        try:
            await _connecting(redispy.open_connection(client))
            if asking:
                await client.execute_command("ASKING")  # type: ignore[no-untyped-call]
            reply = await client.execute_command(*args, **options)  # type: ignore[no-untyped-call]
        except rex.ResponseError as exc:
            if isinstance(exc, _ELSEWHERE):
                await client.aclose()
            else:  # it ran there (NOSCRIPT too: the script is loaded on that node)
                self._client = client
            raise
        except BaseException:
            await client.aclose()
            raise
        self._client = client
        return reply

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()  # the connection goes back to the node's pool
