"""A Redis Cluster client made of one :class:`~turnbus.shared.mux.MuxRedis` per node.

:class:`ClusterMux` is a ``redis.asyncio.Redis``: every command method, scripts and
pipelines (``transaction=False``) work as on one Redis. Each command goes to the master
serving its key's slot (CRC16 of the key, or of its ``{hash tag}``), on that node's
multiplexed link; blocking reads (``XREAD``/``XREADGROUP`` with ``BLOCK``) go to the
node's pool, a connection of their own, as :class:`MuxRedis` does on one Redis.

The slot map comes from ``CLUSTER SLOTS`` (Redis 6.2 and 7 alike), asked of any node
that answers. What the client does with what the cluster says:

- ``MOVED``: the slot has a new owner. The slot is pointed there at once, the whole map
  is re-read in the background, and the command is sent again.
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

Keyless commands go to one master (``PING`` and ``SCRIPT LOAD`` to every master: a
script must be loaded wherever a key may send it). ``DEL``/``UNLINK``/``EXISTS``/
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
from turnbus.shared.mux import MuxRedis, NotDedicated, SendingPipeline, single_link
from turnbus.shared.scripts import text

__all__ = ["SLOTS", "Address", "ClusterMux", "command_keys"]

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
        "MEMORY STATS", "MEMORY DOCTOR",
    }
)  # fmt: skip
# Sent to every master; the first master's reply is the answer.
_EVERY_MASTER = frozenset(
    {"PING", "SCRIPT LOAD", "SCRIPT FLUSH", "FLUSHALL", "FLUSHDB", "FUNCTION LOAD"}
)
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
# What a command sent to one given master answers when that node, unreachable, has
# left the slot map meanwhile (its replica took over).
_GONE: Any = object()
# Replies that say the command belongs on another node (or later): it did not run.
_ELSEWHERE = (rex.AskError, rex.TryAgainError, rex.ClusterDownError, rex.ReadOnlyError)


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


async def _connecting(connect: Awaitable[Any]) -> None:
    """Await a connect: its failure means nothing was sent (:class:`_NotSent`), but for
    a refused sign-in, which no retry mends."""
    try:
        await connect
    except (rex.ConnectionError, rex.TimeoutError) as exc:
        if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError):
            raise
        raise _NotSent(str(exc)) from exc


# (mypy: redis-py's own command mixins disagree on command_info in a class of two bases.)
class ClusterMux(NotDedicated, aioredis.Redis):  # type: ignore[misc]
    """``redis.asyncio.Redis`` over a Redis Cluster (see the module docs).

    ``node_client(host, port)`` builds the :class:`MuxRedis` of one node (the factory in
    :mod:`turnbus.shared.connect` gives each node the same settings); ``seeds`` are where the
    slot map is first asked for."""

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
        self._node_client = node_client
        self._seeds = list(seeds)
        self._failover_wait_s = failover_wait_s
        self._nodes: dict[Address, MuxRedis] = {}
        self._slots: list[MuxRedis | None] = []
        self._masters: list[MuxRedis] = []
        self._known: list[Address] = list(seeds)  # every node the map named, replicas too
        self._refreshing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.refreshes = 0  # slot maps read so far
        self.redirects = 0  # MOVED and ASK replies followed

    # -- what callers can watch ----------------------------------------------------------

    @property
    def latency_ms(self) -> float:
        """The slowest node's moving average of send → reply."""
        return max((n.latency_ms for n in self._masters), default=0.0)

    @property
    def sends(self) -> int:
        return sum(n.sends for n in self._nodes.values())

    @property
    def commands(self) -> int:
        return sum(n.commands for n in self._nodes.values())

    @property
    def node_clients(self) -> list[MuxRedis]:
        """The client of every node met so far (pools to watch)."""
        return list(self._nodes.values())

    # -- the slot map --------------------------------------------------------------------

    def node(self, address: Address) -> MuxRedis:
        """The client of the node at ``address`` (made on first use)."""
        client = self._nodes.get(address)
        if client is None:
            client = self._nodes[address] = self._node_client(*address)
        return client

    def address_of(self, node: MuxRedis) -> Address:
        for address, client in self._nodes.items():
            if client is node:
                return address
        raise KeyError("not a node of this cluster client")

    def address_for_key(self, key: Any) -> Address | None:
        """The address of the master serving ``key``'s slot, as the map has it now
        (``None``: no map read yet, or the slot is not served)."""
        node = self._slots[_slot(key)] if self._slots else None
        return None if node is None else self.address_of(node)

    async def masters(self) -> list[MuxRedis]:
        """The client of every master, as the slot map has them now."""
        if not self._slots:
            await self.refresh()
        return list(self._masters)

    async def node_for_key(self, key: Any) -> MuxRedis:
        """The client of the master serving ``key``'s slot now."""
        if not self._slots:
            await self.refresh()
        node = self._slots[_slot(key)]
        if node is None:
            raise rex.ClusterDownError(f"slot {_slot(key)} is not served")
        return node

    async def refresh(self) -> None:
        """Read the slot map again (callers at once share one read)."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.get_running_loop().create_task(
                self._read_slot_map(), name="redis-cluster:refresh"
            )
        await asyncio.shield(task)

    def _refresh_soon(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            return
        task = asyncio.get_running_loop().create_task(self._refresh_quietly())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_quietly(self) -> None:
        with contextlib.suppress(rex.RedisError, OSError):
            await self.refresh()

    async def _read_slot_map(self) -> None:
        masters = [self.address_of(m) for m in self._masters]
        random.shuffle(masters)
        candidates = list(dict.fromkeys([*masters, *self._known, *self._seeds]))
        errors: list[str] = []
        for address in candidates:
            try:
                async with asyncio.timeout(2.0):
                    reply = await self.node(address).call("CLUSTER", "SLOTS")
            except (rex.RedisError, OSError, TimeoutError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc}")
                continue
            self._apply_slot_map(reply, address)
            return
        raise _NotSent("no Redis Cluster node answered CLUSTER SLOTS (" + "; ".join(errors) + ")")

    def _apply_slot_map(self, reply: Any, asked: Address) -> None:
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
        self._slots = slots
        self._masters = list(masters.values())
        self._known = list(dict.fromkeys(known))
        self.refreshes += 1

    # -- commands ------------------------------------------------------------------------

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        name, keys = command_keys(args)
        if name == "SCAN":
            raise rex.DataError("SCAN on a Redis Cluster: use scan_iter, which walks every master")
        if name in ("WAIT", "WAITAOF"):
            # WAIT counts the writes of the connection it is sent on: routed alone it
            # would wait for nothing. It must follow its write on that write's connection.
            raise rex.DataError(f"{name} must follow its write on the same node connection")
        if name in _EVERY_MASTER:
            replies = await asyncio.gather(
                *(self._run(m, args, options, name) for m in await self.masters())
            )
            # A master that died meanwhile and was replaced has no say (its replica,
            # now a master, is not in this round: a script it lacks is loaded on demand).
            answers = [r for r in replies if r is not _GONE]
            if not answers:
                raise rex.ClusterDownError(f"{name}: no master answered")
            return answers[0]
        if not keys:
            return await self._run(None, args, options, name)
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
                self.redirects += 1
                if redirects > _MAX_REDIRECTS:
                    raise
                moved_to = self.node((exc.host, exc.port))
                if isinstance(exc, rex.MovedError):
                    if self._slots:
                        self._slots[exc.slot_id] = moved_to
                    self._refresh_soon()
                else:
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
                    self._refresh_soon()  # the next command finds the new master
                    raise
                if backoff is None:
                    # 50 ms doubling to 0.5 s, for up to failover_wait_s from this failure.
                    loop = asyncio.get_running_loop()
                    backoff = Backoff(0.05, 0.5, within_s=self._failover_wait_s, clock=loop.time)
                delay = next(backoff, None)
                if delay is None:
                    raise
                log.info("Redis Cluster: %s (%s); retrying in %.2f s", name, exc, delay)
                await asyncio.sleep(delay)
                if not isinstance(exc, rex.TryAgainError):
                    with contextlib.suppress(rex.ConnectionError):
                        await self.refresh()
                if isinstance(target, MuxRedis) and self._slots and target not in self._masters:
                    return _GONE  # that node no longer serves a slot: nothing to send it

    async def _node_of(self, target: int | MuxRedis | None) -> MuxRedis:
        if isinstance(target, MuxRedis):
            return target
        if not self._slots:
            await self.refresh()
        if target is None:
            if not self._masters:
                raise rex.ClusterDownError("no master serves any slot")
            return self._masters[0]
        node = self._slots[target]
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
            self._refresh_soon()
        masters = self._masters or [self.node(self._seeds[0])]
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
        for task in [self._refreshing, *self._background]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        nodes, self._nodes = self._nodes, {}
        self._slots, self._masters = [], []
        for node in nodes.values():
            await node.aclose()
        await super().aclose(close_connection_pool)


class _ClusterPipeline(SendingPipeline):
    """``pipeline(transaction=False)`` over the cluster: each command goes to its own
    node; the commands for one node go out in one write (they are all sent in the same
    pass of the event loop, and each node's link sends what a pass queued at once)."""

    def __init__(self, client: ClusterMux) -> None:
        super().__init__(client)
        self._client = client

    def _send_one(self, args: Sequence[Any], options: Mapping[str, Any]) -> Awaitable[Any]:
        reply: Awaitable[Any] = self._client.execute_command(*args, **options)
        return reply


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
