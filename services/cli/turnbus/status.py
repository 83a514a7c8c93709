"""``turnbus status``: the work queue as Redis sees it, read directly from Redis, with each
live worker's health and metrics port and its tool sources (an MCP server's connection,
tools, reconnects, last error)."""

from __future__ import annotations

import json
from typing import Any, TypedDict

import redis.asyncio as aioredis

from turnbus.shared.keys import GROUP, Keys
from turnbus.shared.records import now_ms

__all__ = ["GROUP", "QueueStatus", "format_status", "read_queue_status"]

# Redis 6.2 has no group ``lag``: the waiting entries are counted with XRANGE, up to this.
_COUNT_LIMIT = 10_000


class ShardStatus(TypedDict):
    shard: int
    stream: str
    length: int
    group: bool
    waiting: int | None  # entries not yet delivered to any consumer; None: more than the limit
    pending: int  # delivered, not yet acknowledged
    lastDeliveredId: str | None


class ConsumerStatus(TypedDict):
    name: str
    shard: int
    pending: int
    idleMs: int


class WorkerStatus(TypedDict):
    name: str
    lastSeenMsAgo: int | None
    live: bool
    metricsPort: int | None  # its health and metrics port, as its heartbeat wrote it


class QueueStatus(TypedDict):
    prefix: str
    shards: list[ShardStatus]
    consumers: list[ConsumerStatus]
    workers: list[WorkerStatus]
    # worker name -> source name -> its state, as its last heartbeat wrote them
    toolSources: dict[str, dict[str, Any]]


async def _waiting(client: aioredis.Redis, stream: str, group: dict[str, Any]) -> int | None:
    lag = group.get("lag")
    if isinstance(lag, int):
        return lag
    last = str(group.get("last-delivered-id") or "0-0")
    entries = await client.xrange(stream, min="(" + last, max="+", count=_COUNT_LIMIT + 1) or []
    return None if len(entries) > _COUNT_LIMIT else len(entries)


def _last_seen_ms(raw: Any) -> int | None:
    try:
        return int(float(raw))
    except (TypeError, ValueError):
        return None


async def read_queue_status(
    client: aioredis.Redis, keys: Keys, shards: int, *, live_within_ms: int
) -> QueueStatus:
    """Queue depth and pending entries per shard, the group's consumers, the live workers.

    ``client`` must decode responses. A worker is live when its last heartbeat in
    ``<prefix>:workers`` is younger than ``live_within_ms``.
    """
    shard_rows: list[ShardStatus] = []
    consumers: list[ConsumerStatus] = []
    for shard, stream in enumerate(keys.work_streams(shards)):
        length = int(await client.xlen(stream))
        groups: list[dict[str, Any]] = []
        if length or await client.exists(stream):
            groups = await client.xinfo_groups(stream)
        group = next((g for g in groups if g.get("name") == GROUP), None)
        if group is None:
            shard_rows.append(
                ShardStatus(
                    shard=shard,
                    stream=stream,
                    length=length,
                    group=False,
                    waiting=length,
                    pending=0,
                    lastDeliveredId=None,
                )
            )
            continue
        shard_rows.append(
            ShardStatus(
                shard=shard,
                stream=stream,
                length=length,
                group=True,
                waiting=await _waiting(client, stream, group),
                pending=int(group.get("pending") or 0),
                lastDeliveredId=str(group.get("last-delivered-id")),
            )
        )
        for consumer in await client.xinfo_consumers(stream, GROUP):
            consumers.append(
                ConsumerStatus(
                    name=str(consumer["name"]),
                    shard=shard,
                    pending=int(consumer.get("pending") or 0),
                    idleMs=int(consumer.get("idle") or 0),
                )
            )
    now = now_ms()
    ports = await client.hgetall(keys.metrics_ports())
    workers: list[WorkerStatus] = []
    for name, raw in sorted((await client.hgetall(keys.workers())).items()):
        seen = _last_seen_ms(raw)
        ago = None if seen is None else max(0, now - seen)
        workers.append(
            WorkerStatus(
                name=str(name),
                lastSeenMsAgo=ago,
                live=ago is not None and ago <= live_within_ms,
                metricsPort=_port(ports.get(name)),
            )
        )
    return QueueStatus(
        prefix=keys.prefix,
        shards=shard_rows,
        consumers=consumers,
        workers=workers,
        toolSources=_tool_sources(await client.hgetall(keys.tool_sources())),
    )


def _port(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def _tool_sources(raw: dict[Any, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for worker, value in sorted(raw.items()):
        try:
            states = json.loads(value)
        except (TypeError, ValueError):
            continue  # a record this version cannot read is left out, not an error
        if isinstance(states, dict):
            out[str(worker)] = {str(k): v for k, v in states.items() if isinstance(v, dict)}
    return out


def _source_line(name: str, state: dict[str, Any]) -> str:
    """One tool source: an MCP server's connection state, tools, reconnects, last error."""
    parts = [f"    {name:<24}"]
    if "state" in state:
        parts.append(f" {state.get('transport', '?')} {state['state']}")
    parts.append(f"  tools {state.get('tools', '?')}")
    if "reconnects" in state:
        parts.append(f"  reconnects {state['reconnects']}")
    if state.get("lastError"):
        parts.append(f"  last error: {state['lastError']}")
    return "".join(parts)


def _secs(ms: int | None) -> str:
    return "?" if ms is None else f"{ms / 1000:.1f} s"


def format_status(status: QueueStatus, redis_shown: str, live_within_ms: int) -> str:
    lines = [f"redis {redis_shown}  prefix {status['prefix']}  shards {len(status['shards'])}", ""]
    lines.append(f"{'shard':<6}{'stream':<28}{'length':>8}{'waiting':>9}{'pending':>9}")
    for row in status["shards"]:
        waiting = f">{_COUNT_LIMIT}" if row["waiting"] is None else str(row["waiting"])
        stream = row["stream"] + ("" if row["group"] else " (no group yet)")
        lines.append(
            f"{row['shard']:<6}{stream:<28}{row['length']:>8}{waiting:>9}{row['pending']:>9}"
        )
    lines.append("")
    if status["consumers"]:
        lines.append(f"consumers of group {GROUP}:")
        for c in status["consumers"]:
            lines.append(
                f"  {c['name']:<40} shard {c['shard']}  pending {c['pending']}  idle {_secs(c['idleMs'])}"
            )
    else:
        lines.append(f"consumers of group {GROUP}: none")
    live = [w for w in status["workers"] if w["live"]]
    lines.append("")
    lines.append(
        f"live workers (heartbeat within {_secs(live_within_ms)}): {len(live)}"
        + (f" of {len(status['workers'])} known" if len(status["workers"]) != len(live) else "")
    )
    sources = status.get("toolSources", {})
    for w in status["workers"]:
        state = "live" if w["live"] else "gone"
        port = w["metricsPort"]
        metrics = f"  metrics port {port}" if port is not None else ""
        lines.append(
            f"  {w['name']:<40} {state}  last seen {_secs(w['lastSeenMsAgo'])} ago{metrics}"
        )
        for name, source in sources.get(w["name"], {}).items():
            lines.append(_source_line(name, source))
    return "\n".join(lines)
