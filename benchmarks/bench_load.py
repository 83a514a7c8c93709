"""Load through the real stack: many users at once, each turn waiting on a model with an LLM's timing.

`turnbus up` (private Redis, gateway, 2 workers) with the scripted model paced like an
LLM (TURNBUS_SCRIPTED_TTFT_MS=500, TURNBUS_SCRIPTED_TOKENS_PER_S=50); clients are
aiohttp on uvloop, one connection per user; when many users send at once, the client
starts 50 requests per event-loop pass, so it reads the first answers between sends
(it is one process standing in for a thousand users, and a late read is counted as a
late delivery). A turn is "remember <about 25 words>": two model
rounds (a working_notes_update call, then a confirmation quoting it), ~15 events.

Scenarios (--scenario, default all):
  load      N sessions (--sessions, default 2,000) each send one turn at once:
            submit→terminal p50/p99 against the model's own time for that turn
            (rounds × TTFT + (words − 1) / rate per round, from the text it streamed),
            errors, 503s, 429s, turns abandoned by a worker.
  delivery  N/2 turns streaming at once: event delivery latency, worker append → SSE
            client, from each entry id's millisecond timestamp (same host clock), for
            the events appended after the client asked for the stream (the ones stored
            before, e.g. turn.started while the POST's answer was on its way, come by
            catch-up: they are counted, not timed). Three runs, each on a fresh
            stack (--delivery-repeats); the one with the median p99 is kept.
  noop      no model latency, 100 sessions × 10 "remember" turns, each session's turns
            one after another (after one warm-up turn per session, not measured):
            turns/s; beside it arq's no-op jobs/s measured in the same run against the
            same Redis (arq in benchmarks/.arq-venv, made here). Each side runs three
            times, turn about (--noop-repeats), and the medians are compared.
  tools     beside load, each on a fresh stack: N sessions (default 1,000) each send
            one turn whose first round calls a Python tool taking 50 ms
            (benchmarks/tools_50ms.py, side-effecting), the second answers with its
            result; beside a turn of the same shape that calls only a notes tool
            (which writes no intent): the tool pipeline's added latency per call (the
            turn's p50 less the model's own time and the 50 ms, against the same for
            the notes-tool turn) and its Redis commands and round trips per call.
  pause     N sessions (default 1,000) each send one turn that declares a client tool
            (clientTools) and whose first round calls it: the turn pauses
            (turn.requires_action), and each client, following its turn's stream,
            answers 1 s after it sees the pause. Once every turn waits, the workers'
            resident memory, the session leases open, the turns running and the work
            entries held are taken (the target being no run slot held); no answer goes
            before that: when it ends later than 1 s after the first pause, every
            answer is held to that time plus its pause's offset from the first pause,
            so the answers keep the spacing the pauses came with (the record says how
            many were held and by how much). The second round answers with the
            result. The time from just before the answer's request is sent to the
            resumed attempt's turn.started and to the next round's round.started as
            the client reads them, p50 / p99 (target p99 < 100 ms at 1,000). The
            answers go through benchmarks/post_pool.py (the requests aiohttp would
            send, from prebuilt bytes, on a keep-alive pool), at half aiohttp's CPU:
            the generator shares the machine with the stack it measures. The
            answer window (first answer to last next round): the answers' rate and
            each process's CPU per answer. --pause-spread-s 0,1,2 runs it again with
            the turns sent across that many seconds (lower answer rates);
            --pause-repeats runs (3) at each, each on a fresh stack, the median kept.
  flood     one session with 150 queued turns, then other users' turns (one at a
            time, 5 of them): submit → turn.started.
  flood_user one user with 50 sessions submitting 3,000 turns (50 at a time, one per
            session, multitask=enqueue) on a stack with that user's quotas set
            (TURNBUS_QUOTA_RUNNING_TURNS=50, TURNBUS_QUOTA_QUEUED_TURNS=1000), while 10
            other users each send one turn, 1 s apart: their submit → turn.started, and
            how many of the flood were accepted and refused (429 quota_exceeded).
  sdk       the real AnthropicModel in ONE worker process (the SDK, the project's own
            request building, gate and round assembly) against the fake Messages API in
            a process of its own (harness/fake_anthropic.py), paced like the API (TTFT
            500 ms, 50 tokens/s, text deltas of 3 words; round 1 says a sentence and
            calls working_notes_update, whose input follows at once in pieces of a few
            tokens; round 2 the text: the "remember" turn's shape), beside a scripted
            stack of one worker, turn about, at 100, 250, 500 and 1,000 turns at once
            (--sdk-levels): worker CPU per turn and per streamed model event, p50 / p99
            against the model's own time, and the most turns one worker holds before
            its p50 passes 1.5 times the model's time.
Each scenario also gives Redis commands per turn (INFO commandstats, scripts' inner
commands included, the gateway's as well as the workers') and CPU seconds per turn of
the workers, the gateway and Redis, both counted from when the sessions exist (their
creation is not in them), and round trips to Redis per turn: the socket reads Redis made
of its clients' sends (INFO stats total_reads_processed; the gateway's and the SSE hub's
too; a send over 16 KiB is several reads). tests/worker/test_budget.py counts one
turn's round trips from the worker's side.

--cluster runs load and noop (or the one --scenario names) on one Redis and on a local
Redis Cluster (harness.local_cluster: 3 masters with a replica each, from the PATH
redis-server ≥ 7) with TURNBUS_REDIS_CLUSTER=1 and TURNBUS_SHARDS=3 (one work stream
per master), turn about in the same run: load once on each (fresh stacks), noop's runs
alternating between the two stacks. Each scenario's figures then hold, per Redis node
(redis_per_node), commands, CPU (INFO used_cpu_sys + used_cpu_user), round trips and
connections opened per turn, and the most clients connected at once; the Redis CPU
and commands in all are the masters'. They go to bench_load_cluster.json.

--replica runs load and noop (or the one --scenario names) on a primary with one
replica (redis-server from the PATH, AOF everysec as `turnbus up` starts its own), with
each TURNBUS_WAIT_REPLICAS of --wait-replicas (default 0,1), turn about in the same
run, in the way --cluster does: load once on each (fresh stacks), noop's runs
alternating. The per-node figures hold the primary and the replica; the Redis CPU is
the primary's. They go to bench_load_replica.json.

--otel runs noop with tracing off (TURNBUS_OTEL=0) and on (TURNBUS_OTEL=1, the gateway's
and the workers' spans over OTLP/HTTP to benchmarks/otlp_sink.py, a process of its own on
loopback that counts them), a stack each, turn about (--noop-repeats): each side's
turns/s and CPU per turn, what on costs against off and the off runs' spread, and the
spans, bytes and sink CPU per turn traced. They go to bench_load_otel.json.

Figures go to benchmarks/results/bench_load.json (--quick: bench_load_quick.json); a
run of one scenario writes bench_load_<scenario>.json instead, so it never replaces the
full record with a part of it.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/bench_load.py [--quick] [--scenario S]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import uvloop

from benchmarks.benchlib import (
    CLUSTER_SHARDS,
    TERMINAL,
    Stack,
    Starting,
    arguments,
    commands_delta,
    cpu_seconds,
    node_counters,
    pct,
    starting,
    starting_on_cluster,
    starting_with_replica,
    summary_ms,
    up,
    write_results,
)
from benchmarks.otlp_sink import OtlpSinkProcess
from benchmarks.post_pool import PostPool
from harness.fake_anthropic import FakeAnthropicProcess
from harness.fake_openai import FakeOpenAI
from harness.local_cluster import cluster_binaries
from turnbus.shared.connect import connect
from turnbus.shared.keys import Keys
from turnbus.shared.runtime import tune_gc
from turnbus.shared.settings import Settings
from turnbus.sse import SseParser

TTFT_MS = 500
TOKENS_PER_S = 50
REALISTIC = {
    "TURNBUS_SCRIPTED_TTFT_MS": str(TTFT_MS),
    "TURNBUS_SCRIPTED_TOKENS_PER_S": str(TOKENS_PER_S),
    # The flood scenario queues 150 turns in one session; a bounded queue must allow them.
    "TURNBUS_SESSION_QUEUE_MAX": "1000",
}
NO_LATENCY = {"TURNBUS_SCRIPTED_TTFT_MS": "0", "TURNBUS_SCRIPTED_TOKENS_PER_S": "0"}
ITEM = (
    "the quarterly report for user {i} is due on Friday and needs the revised revenue "
    "figures, the churn analysis, a short summary for the board and the hiring plan"
)
TURN_DEADLINE_S = 300.0
# How a user runs a turn: one request (a submit with Accept: text/event-stream, read
# to the end), or --two-requests: a submit, then GET its events URL.
TWO_REQUESTS = False
_T = TypeVar("_T")
# Requests the client starts per event-loop pass when many go at once: as fast as it
# can send, but it reads the first answers between sends instead of after all of them.
SEND_GROUP = 50
ARQ_VENV = Path(__file__).resolve().parent / ".arq-venv"
ARQ_PEER = Path(__file__).resolve().parent / "arq_peer.py"


@dataclass
class Tally:
    """What the clients of one scenario saw."""

    latencies_s: list[float] = field(default_factory=list)
    model_s: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    delivery_s: list[float] = field(default_factory=list)
    delivery_by_type: dict[str, list[float]] = field(default_factory=dict)
    # Submit → the POST's answer, and submit → turn.started seen by the client.
    submit_s: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)
    status: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    accepted: int = 0
    # Text deltas the model streamed (3 words each), from the text each round showed.
    model_deltas: int = 0
    caught_up: int = 0  # events stored before their client asked for the stream
    # Accepted turns whose terminal event this client did not see: their events URLs.
    unseen: list[str] = field(default_factory=list)

    def http(self, code: int) -> None:
        key = str(code)
        self.status[key] = self.status.get(key, 0) + 1

    def outcome(self, kind: str) -> None:
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1

    def error(self, what: str) -> None:
        self.errors.append(what)

    def figures(self) -> dict[str, Any]:
        bad = {k: v for k, v in self.status.items() if not k.startswith("2")}
        return {
            "http_status": dict(sorted(self.status.items())),
            "http_503": self.status.get("503", 0),
            "http_429": self.status.get("429", 0),
            "http_errors": sum(bad.values()),
            "outcomes": self.outcomes,
            "client_errors": len(self.errors),
            "client_error_samples": sorted(set(self.errors))[:5],
        }


def model_time_s(round_texts: dict[int, str]) -> float:
    """The scripted model's own time for a turn: per round TTFT + (words − 1) / rate."""
    total = 0.0
    for text in round_texts.values():
        words = len(text.split())
        total += TTFT_MS / 1000 + max(words - 1, 0) / TOKENS_PER_S
    return total


def run_client(main: Coroutine[Any, Any, _T]) -> _T:
    """Run the load generator on uvloop, as the services run, with its garbage collector
    off for the scenario (collected after): a client that reads late, or stops for a
    young-generation pass of tens of milliseconds, adds its own lag to every latency
    it measures."""
    gc.disable()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    finally:
        gc.enable()
        gc.collect()


async def launch(turns: Iterable[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Run ``turns`` at once, started SEND_GROUP per event-loop pass."""
    tasks = []
    for i, turn in enumerate(turns):
        if i and not i % SEND_GROUP:
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(turn))
    return list(await asyncio.gather(*tasks))


async def create_session(http: aiohttp.ClientSession, tally: Tally) -> str | None:
    for _ in range(5):
        try:
            async with http.post("/v1/sessions", json={}) as resp:
                tally.http(resp.status)
                if resp.status == 201:
                    return str((await resp.json())["sessionId"])
                if resp.status not in (429, 503):
                    tally.error(f"POST /v1/sessions {resp.status}")
                    return None
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.error(f"POST /v1/sessions {type(exc).__name__}")
            return None
        await asyncio.sleep(1.0)
    return None


async def submit(
    http: aiohttp.ClientSession, sid: str, message: str, tally: Tally
) -> dict[str, Any] | None:
    for _ in range(5):
        try:
            async with http.post(
                f"/v1/sessions/{sid}/turns", json={"message": message, "multitask": "enqueue"}
            ) as resp:
                tally.http(resp.status)
                if resp.status == 202:
                    return dict(await resp.json())
                if resp.status not in (429, 503):
                    tally.error(f"POST turns {resp.status}")
                    return None
                retry = float(resp.headers.get("Retry-After", "1") or 1)
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.error(f"POST turns {type(exc).__name__}")
            return None
        await asyncio.sleep(retry)
    return None


async def read_stream(
    resp: aiohttp.ClientResponse,
    tally: Tally,
    *,
    asked_ms: float,
    until: frozenset[str] = TERMINAL,
    delivery: bool = False,
    submitted_at: float | None = None,
    texts_needed: bool = True,
) -> tuple[str, dict[int, str]]:
    """Read an open SSE response to an event in ``until``; returns its type and the
    text streamed per round. With ``delivery``, records the latency of each event the
    worker appended after this client asked for the stream (``asked_ms``; an event
    stored before that is caught up, not delivered live: its wait is the client's own)."""
    texts: dict[int, str] = {}
    parser = SseParser()
    # Whatever arrived at once, parsed in one go (not one await per line).
    async for raw in resp.content.iter_any():
        for message in parser.feed(raw):
            kind = message.event
            if delivery and message.id:
                appended_ms = int(message.id.split("-", 1)[0])
                if appended_ms >= asked_ms:
                    late = time.time() - appended_ms / 1000
                    tally.delivery_s.append(late)
                    tally.delivery_by_type.setdefault(kind, []).append(late)
                else:
                    tally.caught_up += 1
            if kind == "turn.started" and submitted_at is not None:
                tally.start_s.append(time.perf_counter() - submitted_at)
            if kind == "text.delta" and texts_needed:
                event = message.json()
                r = int(event.get("round", 1))
                texts[r] = texts.get(r, "") + str(event.get("text", ""))
            if kind in until:
                return kind, texts
    tally.error("stream ended before the terminal event")
    return "cut", texts


async def follow(
    http: aiohttp.ClientSession,
    url: str,
    tally: Tally,
    *,
    until: frozenset[str] = TERMINAL,
    delivery: bool = False,
    submitted_at: float | None = None,
) -> tuple[str, dict[int, str]]:
    """GET a turn's SSE stream and read it (:func:`read_stream`)."""
    asked_ms = time.time() * 1000
    async with http.get(url) as resp:
        tally.http(resp.status)
        if resp.status != 200:
            tally.error(f"GET events {resp.status}")
            return "error", {}
        return await read_stream(
            resp,
            tally,
            asked_ms=asked_ms,
            until=until,
            delivery=delivery,
            submitted_at=submitted_at,
        )


async def submit_and_follow(
    http: aiohttp.ClientSession,
    sid: str,
    message: str,
    tally: Tally,
    *,
    delivery: bool,
    texts_needed: bool = True,
) -> tuple[str, dict[int, str], str | None]:
    """One request: a submit with ``Accept: text/event-stream``, read to the terminal
    event. Returns the outcome, the text per round and the turn's events URL (None
    when the submit was not accepted)."""
    started = time.perf_counter()
    for _ in range(5):
        asked_ms = time.time() * 1000
        try:
            async with http.post(
                f"/v1/sessions/{sid}/turns",
                json={"message": message, "multitask": "enqueue"},
                headers={"Accept": "text/event-stream"},
            ) as resp:
                tally.http(resp.status)
                if resp.status == 200:
                    tally.submit_s.append(time.perf_counter() - started)
                    tally.accepted += 1
                    url = f"/v1/sessions/{sid}/turns/{resp.headers['X-Turn-Id']}/events"
                    try:
                        kind, texts = await read_stream(
                            resp,
                            tally,
                            asked_ms=asked_ms,
                            delivery=delivery,
                            submitted_at=started,
                            texts_needed=texts_needed,
                        )
                    except aiohttp.ClientError as exc:
                        tally.error(f"stream {type(exc).__name__}")
                        kind, texts = "stream_error", {}
                    return kind, texts, url
                if resp.status not in (429, 503):
                    tally.error(f"POST turns {resp.status}")
                    return "not_submitted", {}, None
                retry = float(resp.headers.get("Retry-After", "1") or 1)
        except (TimeoutError, aiohttp.ClientError) as exc:
            tally.error(f"POST turns {type(exc).__name__}")
            return "not_submitted", {}, None
        await asyncio.sleep(retry)
    return "not_submitted", {}, None


async def one_turn(
    http: aiohttp.ClientSession,
    sid: str,
    message: str,
    tally: Tally,
    *,
    delivery: bool = False,
    paced: bool = True,
) -> bool:
    started = time.perf_counter()
    if not TWO_REQUESTS:
        try:
            kind, texts, url = await asyncio.wait_for(
                submit_and_follow(http, sid, message, tally, delivery=delivery, texts_needed=paced),
                TURN_DEADLINE_S,
            )
        except TimeoutError:
            kind, texts, url = "no_terminal_in_time", {}, None
        if url is None and kind == "not_submitted":
            tally.outcome(kind)
            return False
        accepted = {"eventsUrl": url}
    else:
        submitted = await submit(http, sid, message, tally)
        if submitted is None:
            tally.outcome("not_submitted")
            return False
        accepted = submitted
        tally.submit_s.append(time.perf_counter() - started)
        tally.accepted += 1
        try:
            kind, texts = await asyncio.wait_for(
                follow(http, accepted["eventsUrl"], tally, delivery=delivery, submitted_at=started),
                TURN_DEADLINE_S,
            )
        except TimeoutError:
            kind, texts = "no_terminal_in_time", {}
        except aiohttp.ClientError as exc:
            tally.error(f"GET events {type(exc).__name__}")
            kind, texts = "stream_error", {}
    tally.outcome(kind)
    if kind not in TERMINAL and accepted["eventsUrl"]:
        tally.unseen.append(accepted["eventsUrl"])
    if kind != "turn.completed":
        return False
    took = time.perf_counter() - started
    tally.latencies_s.append(took)
    if paced:
        own = model_time_s(texts)
        tally.model_s.append(own)
        tally.model_deltas += sum(-(-len(t.split()) // 3) for t in texts.values())
        tally.ratios.append(took / own)
    return True


class Meter:
    """Redis commands and CPU seconds over one scenario, per Redis node and in all."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.nodes = stack.nodes()
        self.counters = {node.name: node_counters(node.url) for node in self.nodes}
        self.peak_clients = {name: c.connected_clients for name, c in self.counters.items()}
        self.cpu = stack.cpu()
        self.abandoned = stack.log_count("abandoned")
        self.started = time.perf_counter()
        self.client_cpu = time.process_time()
        self.lags: list[float] = []
        loop = asyncio.get_running_loop()
        self._ticker = loop.create_task(self._tick())
        self._sampler = loop.create_task(self._sample_clients())

    async def _tick(self) -> None:
        """The load generator's own event-loop lag: a late client reads events late."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.05
            await asyncio.sleep(0.05)
            self.lags.append(max(loop.time() - due, 0.0))

    async def _sample_clients(self) -> None:
        """The most clients each node had connected at once, looked at every 0.2 s (on
        a cluster the SSE hub opens a blocking reader per followed slot)."""
        links = {node.name: connect(Settings(redis_url=node.url), "status") for node in self.nodes}
        try:
            while True:
                for name, link in links.items():
                    clients = int((await link.info("clients"))["connected_clients"])
                    self.peak_clients[name] = max(self.peak_clients[name], clients)
                await asyncio.sleep(0.2)
        finally:
            for link in links.values():
                await link.aclose()

    def figures(self, turns: int) -> dict[str, Any]:
        """``turns``: the turns the workers ran in the window (every accepted turn)."""
        self._ticker.cancel()
        self._sampler.cancel()
        elapsed = time.perf_counter() - self.started
        client_cpu = time.process_time() - self.client_cpu
        per = max(turns, 1)
        after = {node.name: node_counters(node.url) for node in self.nodes}
        nodes: dict[str, dict[str, Any]] = {}
        calls: Counter[str] = Counter()
        usec: Counter[str] = Counter()
        reads = 0
        redis_cpu = {"master": 0.0, "replica": 0.0}
        for node in self.nodes:
            was, now = self.counters[node.name], after[node.name]
            node_calls = commands_delta(was.calls, now.calls)
            node_cpu = now.cpu_s - was.cpu_s
            redis_cpu[node.role] += node_cpu
            if node.role == "master":
                # The meter's own INFO calls are in the reads: a few, against thousands.
                calls.update(node_calls)
                usec.update(commands_delta(was.usec, now.usec))
                reads += now.reads - was.reads
            nodes[node.name] = {
                "role": node.role,
                "commands_per_turn": round(sum(node_calls.values()) / per, 1),
                "cpu_us_per_turn": round(node_cpu * 1e6 / per, 1),
                "cpu_utilisation": round(node_cpu / elapsed, 2),
                "round_trips_per_turn": round((now.reads - was.reads) / per, 2),
                "connections_opened_per_turn": round(
                    (now.connections_received - was.connections_received) / per, 2
                ),
                "connected_clients_at_start": was.connected_clients,
                "connected_clients_peak": self.peak_clients[node.name],
                "commands_top_per_turn": {
                    k: round(v / per, 2) for k, v in list(node_calls.items())[:5]
                },
            }
        commands = dict(calls.most_common())
        cpu_after = self.stack.cpu()
        cpu = {k: cpu_after[k] - self.cpu[k] for k in cpu_after}
        # Redis's CPU from its own count (INFO used_cpu_sys + used_cpu_user), on one
        # Redis as on a cluster's masters; a cluster's replicas' beside it.
        cpu["redis"] = redis_cpu["master"]
        if redis_cpu["replica"]:
            cpu["redis_replicas"] = redis_cpu["replica"]
        return {
            "elapsed_s": round(elapsed, 2),
            "abandoned": self.stack.log_count("abandoned") - self.abandoned,
            "redis_commands_per_turn": round(sum(commands.values()) / per, 1),
            "redis_round_trips_per_turn": round(reads / per, 2),
            # Every command Redis ran at least once per 100 turns, most first.
            "redis_commands_top_per_turn": {
                k: round(v / per, 2) for k, v in commands.items() if v / per >= 0.01
            },
            "redis_usec_top_per_turn": {
                k: round(v / per, 1) for k, v in list(dict(usec.most_common()).items())[:8]
            },
            "redis_per_node": nodes,
            "cpu_s_per_turn": {
                **{k: round(v / per, 6) for k, v in cpu.items()},
                "load_generator": round(client_cpu / per, 6),
            },
            "cpu_s_per_turn_workers_gateway": round((cpu["workers"] + cpu["gateway"]) / per, 6),
            "cpu_utilisation": {
                **{k: round(v / elapsed, 2) for k, v in cpu.items()},
                "load_generator": round(client_cpu / elapsed, 2),
            },
            "load_generator_loop_lag": summary_ms(self.lags),
        }


async def refollow(http: aiohttp.ClientSession, tally: Tally) -> dict[str, int]:
    """Follow again the accepted turns whose end this client missed (a lost stream, a
    503 on GET events): how they really ended. Outside the measured window."""
    again = Tally()
    gate = asyncio.Semaphore(100)

    async def one(url: str) -> None:
        async with gate:
            try:
                kind, _ = await asyncio.wait_for(follow(http, url, again), TURN_DEADLINE_S)
            except (TimeoutError, aiohttp.ClientError):
                kind = "unknown"
            again.outcome(kind)

    await asyncio.gather(*(one(url) for url in tally.unseen))
    return again.outcomes


def latency_figures(tally: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {
        "submit_to_terminal": summary_ms(tally.latencies_s),
        "submit_answered": summary_ms(tally.submit_s),
        "submit_to_started": summary_ms(tally.start_s),
    }
    if tally.model_s:
        out["model_own_time"] = summary_ms(tally.model_s)
        p50, p99 = pct(tally.ratios, 0.5), pct(tally.ratios, 0.99)
        out["ratio_to_model_time"] = {
            "p50": round(p50 or 0, 2),
            "p99": round(p99 or 0, 2),
            "target_p50": 1.5,
            "target_p99": 3.0,
        }
    return out


async def measured(
    stack: Stack,
    http: aiohttp.ClientSession,
    tally: Tally,
    turns: Awaitable[object],
    head: dict[str, Any],
    detail: Callable[[int], dict[str, Any]] = lambda done: {},
) -> dict[str, Any]:
    """Await ``turns`` (a scenario's measured work) under a :class:`Meter`, then follow
    again the turns whose end the client missed. The figures, in this order: ``head``,
    the turns accepted and completed and their rate, ``detail(completed)``, the
    latencies, the client's tally, the refollow's outcomes and the meter's."""
    meter = Meter(stack)
    started = time.perf_counter()
    await turns
    elapsed = time.perf_counter() - started
    metered = meter.figures(tally.accepted)
    after = await refollow(http, tally)
    done = len(tally.latencies_s)
    return {
        **head,
        "turns_accepted": tally.accepted,
        "turns_completed": done,
        "turns_per_s": round(done / elapsed, 1),
        **detail(done),
        **latency_figures(tally),
        **tally.figures(),
        "after_refollow": after,
        **metered,
    }


def _remember(i: int) -> str:
    return f"remember {ITEM.format(i=i)}"


def _call_tool(i: int) -> str:
    return f'call wait_50ms {{"i": {i}}}'


def _call_notes_tool(i: int) -> str:
    return "call working_notes_get {}"


async def scenario_load(
    stack: Stack, sessions: int, message: Callable[[int], str] = _remember
) -> dict[str, Any]:
    """``sessions`` users each send one realistic turn (``message(i)``), all at once."""
    tally = Tally()
    async with stack.http() as http:
        go = [asyncio.Event() for _ in range(0, sessions, SEND_GROUP)]
        all_ready = asyncio.Event()
        ready = [0]

        async def user(i: int) -> None:
            sid = await create_session(http, tally)
            ready[0] += 1
            if ready[0] == sessions:
                all_ready.set()
            if sid is None:
                tally.outcome("no_session")
                return
            await go[i // SEND_GROUP].wait()
            await one_turn(http, sid, message(i), tally)

        async def send() -> None:
            for group in go:
                group.set()
                await asyncio.sleep(0)
            await asyncio.gather(*users)

        users = [asyncio.create_task(user(i)) for i in range(sessions)]
        # Sessions are created as fast as the gateway answers; the turns go in together.
        await all_ready.wait()
        return await measured(
            stack,
            http,
            tally,
            send(),
            {"sessions": sessions},
            lambda done: {"text_deltas_per_turn": round(tally.model_deltas / max(done, 1), 1)},
        )


TOOLS_MODULE = Path(__file__).resolve().parent / "tools_50ms.py"
TOOL_MS = 50


def tools_beside_load(workers: int, sessions: int, shared: Stack | None = None) -> dict[str, Any]:
    """The load turn, a turn of the same shape calling only a notes tool (no intent, no
    result write: the baseline), then the tool turn, each on a fresh stack (or all on
    ``shared``, a quick run's, which loads the tool); what the tool pipeline adds per
    call, against the baseline."""
    runs: dict[str, dict[str, Any]] = {}
    for name, env, message in (
        ("load", REALISTIC, _remember),
        ("notes_call", REALISTIC, _call_notes_tool),
        ("tools", {**REALISTIC, "TURNBUS_TOOLS": str(TOOLS_MODULE)}, _call_tool),
    ):
        with contextlib.nullcontext(shared) if shared else up(env, workers) as stack:
            print(f"tools: {name}, {sessions} sessions ...", flush=True)
            runs[name] = run_client(scenario_load(stack, sessions, message))
    load, base, tools = runs["load"], runs["notes_call"], runs["tools"]

    def overhead(run: dict[str, Any]) -> float:
        return float(run["submit_to_terminal"]["p50_ms"]) - float(run["model_own_time"]["p50_ms"])

    added = overhead(tools) - TOOL_MS - overhead(base)
    model_p50 = float(tools["model_own_time"]["p50_ms"])
    return {
        "tool_ms": TOOL_MS,
        "load": load,
        "notes_call": base,
        "tools": tools,
        "per_call": {
            "added_latency_p50_ms": round(added, 1),
            "p50_ratio_to_model_plus_tool": round(
                float(tools["submit_to_terminal"]["p50_ms"]) / (model_p50 + TOOL_MS), 2
            ),
            "target_ratio_p50": 1.5,
            "redis_commands": round(
                tools["redis_commands_per_turn"] - base["redis_commands_per_turn"], 1
            ),
            "redis_round_trips": round(
                tools["redis_round_trips_per_turn"] - base["redis_round_trips_per_turn"], 2
            ),
        },
    }


PAUSE_TOOL = {
    "name": "pick_file",
    "description": "Ask the user to pick a file.",
    "inputSchema": {"type": "object", "properties": {"i": {"type": "integer"}}},
}
ANSWER_AFTER_S = 1.0
# The window the answers are counted in for the largest clump (answer_clumps).
CLUMP_S = 0.025
ANSWER_TIMING = (
    "each answer goes at the later of ANSWER_AFTER_S after its own pause was seen and the "
    "time the state of every turn waiting was taken plus its pause's offset from the first "
    "pause: ANSWER_AFTER_S when the state is taken before the first answer is due, else "
    "every answer is held by the same amount and the answers keep the spacing the pauses "
    "came with (answers_held_by; answers_sent_within_s beside pauses_seen_within_s)"
)
# The worker gauges read while every turn waits (services/worker/health.py).
WAITING_GAUGES = {
    "turnbus_worker_turns_running": "turns_running",
    "turnbus_worker_entries_in_flight": "entries_in_flight",
    "turnbus_worker_entries_waiting": "entries_waiting",
}


def resident_mib(pid: int) -> float:
    """A live process's resident memory (VmRSS), MiB; 0.0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def workers_resident_mib(stack: Stack) -> dict[str, float]:
    return {
        name: round(resident_mib(pid), 1)
        for name, pid in sorted(stack.children.items())
        if name.startswith("worker")
    }


async def waiting_state(stack: Stack, http: aiohttp.ClientSession) -> dict[str, Any]:
    """The stack while the turns wait: the workers' resident memory, the session leases
    in Redis, and each worker's turns running (its run slots held), work entries in
    flight and entries waiting for their session, from its /metrics."""
    link = connect(Settings(redis_url=stack.redis_url), "status")
    try:
        leases = 0
        async for _ in link.scan_iter(match="*:lease", count=1000):
            leases += 1
        keys = Keys(Settings.from_env(os.environ).prefix)
        ports = await link.hgetall(keys.metrics_ports())
    finally:
        await link.aclose()
    gauges = dict.fromkeys(WAITING_GAUGES.values(), 0.0)
    host = urlsplit(stack.url).hostname
    for port in ports.values():
        port = port.decode() if isinstance(port, bytes) else str(port)
        async with http.get(f"http://{host}:{port}/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in WAITING_GAUGES:
                gauges[WAITING_GAUGES[name]] += float(value)
    resident = workers_resident_mib(stack)
    return {
        "workers_resident_mib": resident,
        "workers_resident_mib_total": round(sum(resident.values()), 1),
        "session_leases_open": leases,
        "workers_metered": len(ports),
        **{k: int(v) for k, v in gauges.items()},
    }


@dataclass
class PauseTally:
    """What the pause scenario's clients saw of the pauses and their answers."""

    sessions: int
    paused: int = 0
    held: int = 0  # answers sent later than 1 s after their pause: the state was being taken
    first_seen: float | None = None  # when the first pause was seen
    taken_at: float = 0.0  # when the state was taken
    held_by_s: list[float] = field(default_factory=list)  # how much later than 1 s
    answer_accepted_s: list[float] = field(default_factory=list)
    to_started_s: list[float] = field(default_factory=list)
    to_next_round_s: list[float] = field(default_factory=list)
    sent_and_next_s: list[tuple[float, float]] = field(default_factory=list)  # per answer
    pause_spread_s: list[float] = field(default_factory=list)  # when each pause was seen
    answers_sent_s: list[float] = field(default_factory=list)  # when each answer went
    all_waiting: asyncio.Event = field(default_factory=asyncio.Event)
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: dict[str, Any] = field(default_factory=dict)

    unpaused: int = 0  # turns that ended or failed without pausing
    created_ms: list[int] = field(default_factory=list)  # each pause's entry id time
    # CPU seconds (stack processes and this one) when the first answer went out, and
    # the answer window's figures once the last resumed turn's next round was seen.
    window_start: tuple[float, dict[str, float], float] | None = None
    window: dict[str, Any] = field(default_factory=dict)
    new_connections: int = 0  # connections the answers opened (the others reused one)

    def answer_went(self, stack: Stack, sent: float) -> None:
        """Counts an answer sent; the first one opens the answer window."""
        self.answers_sent_s.append(sent)
        if self.window_start is None:
            self.window_start = (sent, stack.cpu(), time.process_time())

    def saw_next_round(self, stack: Stack, seen: float, sent: float) -> None:
        """Counts a resumed turn's next round; the last one closes the answer window:
        its length, the answers' rate and each process's CPU per answer in it."""
        self.to_next_round_s.append(seen - sent)
        self.sent_and_next_s.append((sent, seen - sent))
        if len(self.to_next_round_s) != self.paused or self.window_start is None:
            return
        start, cpu, own = self.window_start
        now_cpu, n = stack.cpu(), len(self.to_next_round_s)
        sent_s = sorted(self.answers_sent_s)
        per = {k: round((now_cpu[k] - cpu[k]) * 1000 / n, 3) for k in now_cpu}
        per["load_generator"] = round((time.process_time() - own) * 1000 / n, 3)
        spread = sent_s[-1] - sent_s[0]
        self.window = {
            "s": round(seen - start, 3),
            "answers": n,
            "answers_per_s": round(n / spread) if spread > 0 else None,
            "cpu_ms_per_answer": per,
            "cpu_ms_per_answer_total": round(sum(per.values()), 3),
            "cores_busy": round(sum(per.values()) * n / 1000 / (seen - start), 2),
            "answers_on_new_connections": self.new_connections,
            **answer_clumps(self.sent_and_next_s),
        }

    def saw_pause(self) -> float:
        """Counts a pause; returns when it was seen."""
        seen = time.perf_counter()
        if self.first_seen is None:
            self.first_seen = seen
        self.paused += 1
        self.pause_spread_s.append(seen)
        self._check()
        return seen

    async def answer_time(self, seen_at: float) -> None:
        """Sleeps until the answer to the pause seen at ``seen_at`` goes out: the later of
        ANSWER_AFTER_S after it and the state's time plus the pause's offset from the
        first pause. While the state is taken before the first answer is due, that is
        ANSWER_AFTER_S for every answer; else every answer is held by the same amount, so
        the answers keep the spacing their pauses came with, never a burst."""
        due = seen_at + ANSWER_AFTER_S
        await asyncio.sleep(max(due - time.perf_counter(), 0.0))
        await self.taken.wait()
        first = self.first_seen if self.first_seen is not None else seen_at
        held_to = max(due, self.taken_at + (seen_at - first))
        if held_to > due:
            await asyncio.sleep(max(held_to - time.perf_counter(), 0.0))
            self.held += 1
            self.held_by_s.append(held_to - due)

    def no_pause(self) -> None:
        self.unpaused += 1
        self._check()

    def _check(self) -> None:
        if self.paused + self.unpaused >= self.sessions:
            self.all_waiting.set()


def answer_clumps(sent_and_next_s: list[tuple[float, float]]) -> dict[str, Any]:
    """How the answers came and how the wait built: the most answers sent within any
    CLUMP_S, and the mean time to the next round of the answers sent in each fifth of
    the span the answers were sent across (a queue that builds shows as a rise)."""
    if not sent_and_next_s:
        return {}
    rows = sorted(sent_and_next_s)
    sent = [t for t, _ in rows]
    most, j = 0, 0
    for i, t in enumerate(sent):
        while sent[j] < t - CLUMP_S:
            j += 1
        most = max(most, i - j + 1)
    span = max(sent[-1] - sent[0], 1e-9)
    fifths: list[list[float]] = [[] for _ in range(5)]
    for t, wait in rows:
        fifths[min(int((t - sent[0]) / span * 5), 4)].append(wait)
    return {
        "most_answers_within_25_ms": most,
        "to_next_round_mean_ms_by_fifth": [
            round(sum(f) * 1000 / len(f), 1) if f else None for f in fifths
        ],
    }


def created_within(created_ms: list[int]) -> float | None:
    """Seconds between the first and the last pause event as the worker wrote them
    (their entry ids' times)."""
    return round((max(created_ms) - min(created_ms)) / 1000, 2) if created_ms else None


async def answer_pause(
    stack: Stack,
    answers: PostPool,
    url: str,
    calls: list[dict[str, Any]],
    seen_at: float,
    pauses: PauseTally,
    tally: Tally,
) -> float | None:
    """Answer every pending call ANSWER_AFTER_S after the pause was seen (and not before
    the waiting state is taken: :meth:`PauseTally.answer_time`); returns when the request
    went out."""
    await pauses.answer_time(seen_at)
    body = {
        "toolResults": [
            {"callId": c["callId"], "output": f"file-{c['input'].get('i')}.txt"} for c in calls
        ]
    }
    sent = time.perf_counter()
    pauses.answer_went(stack, sent)
    try:
        status, _ = await answers.post_json(url, body)
        tally.http(status)
        if status != 202:
            tally.error(f"POST actions {status}")
            return None
    except (TimeoutError, OSError) as exc:
        tally.error(f"POST actions {type(exc).__name__}")
        return None
    pauses.answer_accepted_s.append(time.perf_counter() - sent)
    pauses.new_connections = answers.opened  # the pool sends the answers only
    return sent


async def paused_turn(
    stack: Stack,
    http: aiohttp.ClientSession,
    answers: PostPool,
    sid: str,
    i: int,
    tally: Tally,
    pauses: PauseTally,
    mine: list[bool],
) -> str:
    """One turn that pauses for its client tool: submitted with Accept: text/event-stream
    and followed to its end; the pause is answered from the same stream's events."""
    started = time.perf_counter()
    body = {
        "message": f'call pick_file {{"i": {i}}}',
        "multitask": "enqueue",
        "clientTools": [PAUSE_TOOL],
    }
    async with http.post(
        f"/v1/sessions/{sid}/turns", json=body, headers={"Accept": "text/event-stream"}
    ) as resp:
        tally.http(resp.status)
        if resp.status != 200:
            tally.error(f"POST turns {resp.status}")
            return "not_submitted"
        tally.submit_s.append(time.perf_counter() - started)
        tally.accepted += 1
        tid = resp.headers["X-Turn-Id"]
        answered: asyncio.Task[float | None] | None = None
        paused_round = 0
        started_seen = False
        parser = SseParser()
        async for raw in resp.content.iter_any():
            for message in parser.feed(raw):
                kind = message.event
                if kind == "turn.requires_action" and answered is None:
                    event = message.json()
                    paused_round = int(event["round"])
                    seen_at = pauses.saw_pause()
                    if message.id:
                        pauses.created_ms.append(int(message.id.split("-")[0]))
                    mine.append(True)
                    url = f"/v1/sessions/{sid}/turns/{tid}/actions"
                    answered = asyncio.create_task(
                        answer_pause(stack, answers, url, event["calls"], seen_at, pauses, tally)
                    )
                elif answered is not None and kind in ("turn.started", "round.started"):
                    # The answer went out before its resumed attempt can start.
                    sent = await answered
                    if sent is None:
                        continue
                    if kind == "turn.started" and not started_seen:
                        started_seen = True
                        pauses.to_started_s.append(time.perf_counter() - sent)
                    elif kind == "round.started" and int(message.json()["round"]) > paused_round:
                        pauses.saw_next_round(stack, time.perf_counter(), sent)
                        paused_round = 1 << 30  # the first such round only
                if kind in TERMINAL:
                    if kind == "turn.completed":
                        tally.latencies_s.append(time.perf_counter() - started)
                    return str(kind)
    tally.error("stream ended before the terminal event")
    return "cut"


async def scenario_pause(stack: Stack, sessions: int, spread_s: float = 0.0) -> dict[str, Any]:
    """``sessions`` users each send one turn that pauses for a client tool, all at once
    (or, with ``spread_s``, one after another across that many seconds); each answers
    its pause ANSWER_AFTER_S after seeing it. While every turn waits, the workers' state
    is taken (:func:`waiting_state`)."""
    tally = Tally()
    pauses = PauseTally(sessions)
    # The answers go through a client of their own, lighter than aiohttp's: the same
    # requests, a fifth of the answer window's CPU less taken from the stack measured.
    answers = PostPool(stack.url, {"Authorization": f"Bearer {stack.token}"})
    async with stack.http() as http:
        sids = await launch(create_session(http, tally) for _ in range(sessions))
        idle = workers_resident_mib(stack)

        async def user(i: int, sid: str | None) -> None:
            mine: list[bool] = []  # the pause this turn saw
            if spread_s:
                await asyncio.sleep(spread_s * i / sessions)
            if sid is None:
                tally.outcome("no_session")
                pauses.no_pause()
                return
            try:
                kind = await asyncio.wait_for(
                    paused_turn(stack, http, answers, sid, i, tally, pauses, mine), TURN_DEADLINE_S
                )
            except TimeoutError:
                kind = "no_terminal_in_time"
            except aiohttp.ClientError as exc:
                tally.error(f"stream {type(exc).__name__}")
                kind = "stream_error"
            tally.outcome(kind)
            if not mine:
                pauses.no_pause()

        async def take_waiting_state() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pauses.all_waiting.wait(), TURN_DEADLINE_S)
            # The pause releases the run slot as its entry is acked, just after the
            # event: a moment for the last ones.
            await asyncio.sleep(0.2)
            pauses.waiting = {"turns_waiting": pauses.paused, **await waiting_state(stack, http)}
            pauses.taken_at = time.perf_counter()
            pauses.taken.set()

        async def run() -> None:
            taker = asyncio.create_task(take_waiting_state())
            await launch(user(i, sid) for i, sid in enumerate(sids))
            await taker

        def detail(done: int) -> dict[str, Any]:
            seen, sent = sorted(pauses.pause_spread_s), sorted(pauses.answers_sent_s)
            return {
                "pause": {
                    "answer_after_s": ANSWER_AFTER_S,
                    "submits_spread_s": spread_s,
                    "turns_paused": pauses.paused,
                    "pauses_seen_within_s": round(seen[-1] - seen[0], 2) if seen else None,
                    "pauses_written_within_s": created_within(pauses.created_ms),
                    "answers_held_for_the_state": pauses.held,
                    "answers_held_by": summary_ms(pauses.held_by_s),
                    "answers_sent_within_s": round(sent[-1] - sent[0], 2) if sent else None,
                    "answer_timing": ANSWER_TIMING,
                    "while_all_wait": pauses.waiting,
                    "workers_resident_mib_idle": idle,
                    "answer_accepted": summary_ms(pauses.answer_accepted_s),
                    "answer_to_turn_started": summary_ms(pauses.to_started_s),
                    "answer_to_next_round": summary_ms(pauses.to_next_round_s),
                    "answer_window": pauses.window,
                    "target_answer_to_next_round_p99_ms": 100,
                    "target_run_slots_held": 0,
                }
            }

        try:
            return await measured(stack, http, tally, run(), {"sessions": sessions}, detail)
        finally:
            answers.close()


def pause_at_rate(scenario: dict[str, Any]) -> dict[str, Any]:
    """One pause run's answer rate and what it gave: the latency to the next round and
    the CPU the answers cost, by process."""
    p = scenario["pause"]
    window = p.get("answer_window") or {}
    return {
        "submits_spread_s": p.get("submits_spread_s"),
        "answers_per_s": window.get("answers_per_s"),
        "answer_accepted": p.get("answer_accepted"),
        "answer_to_turn_started": p.get("answer_to_turn_started"),
        "answer_to_next_round": p.get("answer_to_next_round"),
        "cpu_ms_per_answer": window.get("cpu_ms_per_answer"),
        "cores_busy": window.get("cores_busy"),
        "most_answers_within_25_ms": window.get("most_answers_within_25_ms"),
        "to_next_round_mean_ms_by_fifth": window.get("to_next_round_mean_ms_by_fifth"),
        "turns_completed": scenario.get("turns_completed"),
        "runs_answer_to_next_round_p99_ms": p.get("runs_answer_to_next_round_p99_ms"),
    }


SDK_LEVELS = (100, 250, 500, 1000)


def _level_figures(s: dict[str, Any], model_events: int | None) -> dict[str, Any]:
    """One step of the sdk scenario, for one model: what the table shows."""
    done = max(int(s.get("turns_completed") or 0), 1)
    workers_cpu = float(s["cpu_s_per_turn"]["workers"])
    events = model_events / done if model_events is not None else s["text_deltas_per_turn"]
    return {
        "turns_completed": s.get("turns_completed"),
        "not_completed": sum(v for k, v in s.get("outcomes", {}).items() if k != "turn.completed"),
        "submit_to_terminal": s.get("submit_to_terminal"),
        "submit_to_started": s.get("submit_to_started"),
        "model_own_time": s.get("model_own_time"),
        "ratio_to_model_time": s.get("ratio_to_model_time"),
        "worker_cpu_ms_per_turn": round(workers_cpu * 1000, 3),
        "model_events_per_turn": round(events, 1),
        "worker_cpu_us_per_model_event": round(workers_cpu * 1e6 / events, 1) if events else None,
        "cpu_s_per_turn": s.get("cpu_s_per_turn"),
        "redis_commands_per_turn": s.get("redis_commands_per_turn"),
        "elapsed_s": s.get("elapsed_s"),
    }


def _add_fake_figures(run: dict[str, Any], before: dict[str, Any], after: dict[str, Any]) -> None:
    """What the fake API saw of one sdk run: its CPU, its answers, the cache share (of
    the input tokens, as each API counts them)."""
    run["fake_api_cpu_s"] = round(after["cpu_s"] - before["cpu_s"], 2)
    run["fake_api_statuses"] = {
        k: after["statuses"].get(k, 0) - before["statuses"].get(k, 0) for k in after["statuses"]
    }
    usage = {k: after["usage"].get(k, 0) - before["usage"].get(k, 0) for k in after["usage"]}
    if "prompt_tokens" in usage:  # Chat Completions: cached tokens are part of the prompt's
        total, read = usage["prompt_tokens"], usage.get("cached_tokens", 0)
    else:
        kinds = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        total = sum(usage.get(k, 0) for k in kinds)
        read = usage.get("cache_read_input_tokens", 0)
    run["cache_read_share"] = round(read / total, 3) if total else None


# The real model paths beside the scripted one: the Anthropic client ("sdk") and the
# OpenAI-compatible one ("openai"), each on its own fake API.
SDK_KINDS = ("sdk", "openai")


def scenario_sdk(
    levels: tuple[int, ...], repeats: int, *, scripted: Stack | None = None, warm_up: bool = True
) -> dict[str, Any]:
    """The real model paths, each in one worker process against its fake API, beside the
    scripted model in one worker process, at each level of concurrent turns, turn about.

    ``scripted``: a running scripted stack of one worker to use (a quick run's, whose
    figures are not kept), instead of one started here; ``warm_up``: a few turns on
    each stack first, not measured."""
    profile = {"ttft_s": TTFT_MS / 1000, "tokens_per_s": TOKENS_PER_S}
    with (
        FakeAnthropicProcess(responder="remember", **profile) as fake,
        FakeOpenAI(responder="remember", **profile) as fake_openai,
    ):
        fakes = {"sdk": fake, "openai": fake_openai}
        envs = {
            "sdk": {
                **REALISTIC,
                "TURNBUS_MODEL": "anthropic",
                "ANTHROPIC_BASE_URL": fake.url,
                "ANTHROPIC_API_KEY": fake.api_key,
            },
            "openai": {
                **REALISTIC,
                "TURNBUS_MODEL": "openai",
                "OPENAI_BASE_URL": fake_openai.base_url,
                "OPENAI_API_KEY": fake_openai.api_key,
            },
        }
        steps: list[dict[str, Any]] = []
        with contextlib.ExitStack() as stacks:
            # All boot at once.
            booting = {kind: stacks.enter_context(starting(envs[kind], 1)) for kind in SDK_KINDS}
            scripted_stack = scripted or stacks.enter_context(starting(REALISTIC, 1)).ready()
            kinds = {"scripted": scripted_stack, **{k: b.ready() for k, b in booting.items()}}
            # Not measured: a few turns on each, so none pays its first turn's one-off
            # work (the SDK client, its connections, first-use imports) in a step.
            for stack in kinds.values() if warm_up else ():
                run_client(scenario_load(stack, 10))
            for n in levels:
                step: dict[str, Any] = {"concurrent_turns": n}
                runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
                for r in range(repeats):
                    for kind, stack in kinds.items():
                        print(f"sdk: {n} turns at once, {kind}, run {r + 1} ...", flush=True)
                        api = fakes.get(kind)
                        before = api.stats() if api is not None else {}
                        figures = run_client(scenario_load(stack, n))
                        after = api.stats() if api is not None else {}
                        sent = after["events_sent"] - before["events_sent"] if api else None
                        run = _level_figures(figures, sent)
                        if api is not None:
                            _add_fake_figures(run, before, after)
                        runs[kind].append(run)
                for kind, kind_runs in runs.items():
                    # The run of median worker CPU stands for the step; every run's CPU
                    # and p50 are kept beside it (a shared machine's runs differ).
                    kind_runs.sort(key=lambda run: float(run["worker_cpu_ms_per_turn"]))
                    step[kind] = {
                        **kind_runs[len(kind_runs) // 2],
                        "runs_worker_cpu_ms_per_turn": [
                            run["worker_cpu_ms_per_turn"] for run in kind_runs
                        ],
                        "runs_p50_ratio": [
                            (run.get("ratio_to_model_time") or {}).get("p50") for run in kind_runs
                        ],
                    }
                scripted_cpu = step["scripted"]["worker_cpu_ms_per_turn"]
                for kind in SDK_KINDS:
                    cpu = step[kind]["worker_cpu_ms_per_turn"]
                    step[f"cpu_ratio_{kind}_to_scripted"] = (
                        round(cpu / scripted_cpu, 2) if scripted_cpu else None
                    )
                print(json.dumps(step, indent=1), flush=True)
                steps.append(step)

    def holds(kind: str) -> int | None:
        """The most turns at once whose p50 stayed within 1.5 times the model's time."""
        ok = [
            step["concurrent_turns"]
            for step in steps
            if (step[kind].get("ratio_to_model_time") or {}).get("p50", 99) <= 1.5
            and not step[kind]["not_completed"]
        ]
        return max(ok) if ok else None

    def median_ratio(kind: str) -> float | None:
        ratios = sorted(
            s[f"cpu_ratio_{kind}_to_scripted"] for s in steps if s[f"cpu_ratio_{kind}_to_scripted"]
        )
        return ratios[len(ratios) // 2] if ratios else None

    return {
        "workers": 1,
        "profile": {
            **profile,
            "text_words_per_delta": 3,
            "rounds": 2,
            "fake_api": "harness/fake_anthropic.py (sdk) and harness/fake_openai.py (openai), "
            "each in a process of its own (uvloop)",
        },
        "levels": steps,
        "holds_within_1_5x_p50": {kind: holds(kind) for kind in ("scripted", *SDK_KINDS)},
        "cpu_ratio_sdk_to_scripted_median": median_ratio("sdk"),
        "cpu_ratio_openai_to_scripted_median": median_ratio("openai"),
        "cpu_ratio_target": 2.0,
    }


async def scenario_delivery(stack: Stack, turns: int) -> dict[str, Any]:
    """``turns`` realistic turns streaming at once; latency of each event to its SSE client."""
    tally = Tally()
    async with stack.http() as http:
        sids = await asyncio.gather(*(create_session(http, tally) for _ in range(turns)))
        streaming = launch(
            one_turn(http, sid, f"remember {ITEM.format(i=i)}", tally, delivery=True)
            for i, sid in enumerate(sids)
            if sid is not None
        )
        return await measured(
            stack,
            http,
            tally,
            streaming,
            {"turns": turns},
            lambda done: {
                "event_delivery": summary_ms(tally.delivery_s),
                "event_delivery_by_type": {
                    kind: summary_ms(values)
                    for kind, values in sorted(tally.delivery_by_type.items())
                },
                "events_caught_up_not_timed": tally.caught_up,
                "event_delivery_target_p99_ms": 100,
            },
        )


async def scenario_noop(stack: Stack, sessions: int, turns_each: int) -> dict[str, Any]:
    """No model latency: each session sends ``turns_each`` turns, one after another."""
    tally = Tally()
    async with stack.http() as http:
        sids = await asyncio.gather(*(create_session(http, tally) for _ in range(sessions)))
        # Warm-up, not measured: one turn per session, so the measured run starts with
        # open connections and running workers, as arq's count starts at its first job.
        warm = Tally()
        await asyncio.gather(
            *(one_turn(http, sid, "remember the warm-up", warm, paced=False) for sid in sids if sid)
        )

        async def user(u: int, sid: str) -> None:
            for t in range(turns_each):
                await one_turn(http, sid, f"remember finding {u}.{t}", tally, paced=False)

        async def users() -> None:
            await asyncio.gather(*(user(u, sid) for u, sid in enumerate(sids) if sid is not None))

        return await measured(
            stack,
            http,
            tally,
            users(),
            {
                "sessions": sessions,
                "turns_per_session": turns_each,
                "warm_up_turns_not_measured": warm.accepted,
            },
        )


async def scenario_flood(
    stack: Stack, queued: int, others: int, gap_s: float = 1.0
) -> dict[str, Any]:
    """One session with ``queued`` turns waiting; other users' turns, ``gap_s`` apart:
    submit → turn.started."""
    tally = Tally()
    async with stack.http() as http:
        flooded = await create_session(http, tally)
        assert flooded is not None, tally.errors
        accepted = 0
        for i in range(queued):
            if await submit(http, flooded, f"remember flood item {i}", tally):
                accepted += 1
        waits: list[float] = []
        for _ in range(others):
            sid = await create_session(http, tally)
            if sid is None:
                continue
            started = time.perf_counter()
            turn = await submit(http, sid, f"remember {ITEM.format(i='other')}", tally)
            if turn is None:
                continue
            kind, _ = await asyncio.wait_for(
                follow(http, turn["eventsUrl"], tally, until=frozenset({"turn.started"})),
                TURN_DEADLINE_S,
            )
            if kind == "turn.started":
                waits.append(time.perf_counter() - started)
            await asyncio.sleep(gap_s)
    return {
        "queued_in_one_session": queued,
        "queued_accepted": accepted,
        "other_turns": others,
        "other_turn_submit_to_started": summary_ms(waits),
        "target_ms": 1000,
        **tally.figures(),
    }


# One user's flood meets these quotas (the other users never come near them).
FLOOD_USER_QUOTAS = {"TURNBUS_QUOTA_RUNNING_TURNS": "50", "TURNBUS_QUOTA_QUEUED_TURNS": "1000"}


async def scenario_flood_user(
    stack: Stack,
    sessions: int,
    turns: int,
    others: int,
    gap_s: float = 1.0,
    quotas: Mapping[str, str] = FLOOD_USER_QUOTAS,
) -> dict[str, Any]:
    """One user submitting ``turns`` over ``sessions`` sessions, as fast as the gateway
    answers; meanwhile ``others`` other users' turns, ``gap_s`` apart: submit →
    turn.started. A refused flood submit is counted, never retried."""
    tally = Tally()
    counts = {"accepted": 0, "quota_exceeded": 0, "other_refusals": 0}
    async with stack.http("flooder") as flooder:
        sids = [await create_session(flooder, tally) for _ in range(sessions)]
        live = [sid for sid in sids if sid is not None]
        assert live, tally.errors
        per_session = -(-turns // len(live))

        async def flood(sid: str) -> None:
            for i in range(per_session):
                url = f"/v1/sessions/{sid}/turns"
                body = {"message": f"remember flood item {i}", "multitask": "enqueue"}
                try:
                    async with flooder.post(url, json=body) as resp:
                        tally.http(resp.status)
                        if resp.status == 202:
                            counts["accepted"] += 1
                        elif resp.status == 429:
                            counts["quota_exceeded"] += 1
                        else:
                            counts["other_refusals"] += 1
                        await resp.read()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    tally.error(f"flood POST turns {type(exc).__name__}")

        async def measure() -> list[float]:
            waits: list[float] = []
            for u in range(others):
                async with stack.http(f"other{u}") as http:
                    sid = await create_session(http, tally)
                    if sid is None:
                        continue
                    started = time.perf_counter()
                    turn = await submit(http, sid, f"remember {ITEM.format(i=u)}", tally)
                    if turn is None:
                        continue
                    kind, _ = await asyncio.wait_for(
                        follow(http, turn["eventsUrl"], tally, until=frozenset({"turn.started"})),
                        TURN_DEADLINE_S,
                    )
                    if kind == "turn.started":
                        waits.append(time.perf_counter() - started)
                await asyncio.sleep(gap_s)
            return waits

        flooding = asyncio.gather(*(flood(sid) for sid in live))
        waits = await measure()
        await flooding
    return {
        "flood_sessions": len(live),
        "flood_turns_sent": per_session * len(live),
        "flood_accepted": counts["accepted"],
        "flood_refused_quota_exceeded": counts["quota_exceeded"],
        "flood_refused_otherwise": counts["other_refusals"],
        "quotas": dict(quotas),
        "other_users": others,
        "other_turn_submit_to_started": summary_ms(waits),
        "target_ms": 1000,
        **tally.figures(),
    }


# --- arq, side by side ----------------------------------------------------------------


def _arq_env() -> dict[str, str]:
    """The environment without PYTHONPATH: the arq venv must not see this project."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def arq_python() -> Path:
    """benchmarks/.arq-venv/bin/python with arq installed, made on first use."""
    python = ARQ_VENV / "bin" / "python"
    if not (ARQ_VENV / ".installed").exists():
        print("making benchmarks/.arq-venv (arq pins its own redis client) ...", flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(ARQ_VENV)], check=True, env=_arq_env())
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "arq"], check=True, env=_arq_env()
        )
        (ARQ_VENV / ".installed").touch()
    return python


def run_arq(redis_url: str, jobs: int, workers: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            *(str(arq_python()), str(ARQ_PEER), "--redis-url", redis_url),
            *("--jobs", str(jobs), "--workers", str(workers)),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
        env=_arq_env(),
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


# --- side by side: one Redis and a cluster, or a replica waited for or not ------------

StartStack = Callable[[Mapping[str, str]], contextlib.AbstractContextManager[Starting]]


def load_sides(sides: Mapping[str, StartStack], sessions: int) -> dict[str, Any]:
    """The load scenario once on each side, each on a fresh stack, in turn."""
    out = {}
    for where, start in sides.items():
        with start(REALISTIC) as starting_stack:
            stack = starting_stack.ready()
            print(f"load on {where}: {sessions} sessions ...", flush=True)
            run = run_client(scenario_load(stack, sessions))
            print(json.dumps(run, indent=1), flush=True)
            out[f"load_{where}"] = run
    return out


def noop_sides(
    sides: Mapping[str, StartStack], sessions: int, turns_each: int, repeats: int
) -> dict[str, Any]:
    """The noop scenario on every side's stack (all started at once), ``repeats`` runs
    each, alternating between the sides; each side's median run, by turns/s. The
    stacks boot at the same time."""
    runs: dict[str, list[dict[str, Any]]] = {where: [] for where in sides}
    with contextlib.ExitStack() as stacks:
        booting = {where: stacks.enter_context(start(NO_LATENCY)) for where, start in sides.items()}
        started = {where: stack.ready() for where, stack in booting.items()}
        for r in range(repeats):
            for where, stack in started.items():
                print(f"noop on {where} {r + 1}/{repeats}: {sessions} x {turns_each} ...")
                runs[where].append(run_client(scenario_noop(stack, sessions, turns_each)))
    out = {}
    for where, side in runs.items():
        side.sort(key=lambda run: float(run["turns_per_s"]))
        median = dict(side[len(side) // 2])
        median["runs_turns_per_s"] = [run["turns_per_s"] for run in side]
        out[f"noop_{where}"] = median
        print(json.dumps(median, indent=1), flush=True)
    return out


def noop_beside_arq(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """The noop scenario on ``stack``, ``--noop-repeats`` runs, each followed by arq's
    no-op jobs against the same Redis (not in a quick run, nor with ``--no-arq``); the
    median run's figures, with arq's beside them."""
    quick = args.quick
    sessions = args.sessions or (20 if quick else 2000)
    noop_sessions, turns_each = (min(sessions, 10), 3) if quick else (100, args.noop_turns)
    repeats = 1 if quick else args.noop_repeats
    # Runs of a second or two vary by ±10 % on a shared machine: each side runs
    # `repeats` times, turn about, and the medians are compared.
    runs: list[dict[str, Any]] = []
    arqs: list[dict[str, Any]] = []
    for r in range(repeats):
        print(f"noop {r + 1}/{repeats}: {noop_sessions} sessions x {turns_each} turns ...")
        runs.append(run_client(scenario_noop(stack, noop_sessions, turns_each)))
        if not (quick or args.no_arq):
            jobs = 10_000
            print(f"arq {r + 1}/{repeats}: {jobs} no-op jobs, {args.workers} workers ...")
            arqs.append(run_arq(stack.redis_url, jobs, args.workers))
    runs.sort(key=lambda run: float(run["turns_per_s"]))
    noop = dict(runs[len(runs) // 2])  # the median run's figures
    noop["runs_turns_per_s"] = [run["turns_per_s"] for run in runs]
    if arqs:
        arqs.sort(key=lambda run: float(run["jobs_per_s"]))
        arq = dict(arqs[len(arqs) // 2])
        arq["runs_jobs_per_s"] = [run["jobs_per_s"] for run in arqs]
        noop["arq"] = arq
        noop["ratio_to_arq"] = round(noop["turns_per_s"] / arq["jobs_per_s"], 3)
    print(json.dumps(noop, indent=1), flush=True)
    return noop


def otlp_settled(sink: OtlpSinkProcess, quiet_s: float) -> dict[str, Any]:
    """The sink's counts once no export has come for ``quiet_s``, counted from this call
    too (a sink idle since before the run has not seen the run's first batch yet); 60 s
    at most."""
    called = time.monotonic()
    deadline = called + 60
    while True:
        stats = sink.stats()
        idle_s = min(float(stats["idle_s"]), time.monotonic() - called)
        if idle_s >= quiet_s or time.monotonic() > deadline:
            return stats
        time.sleep(max(quiet_s - idle_s, 0.1))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def noop_otel(
    workers: int, sessions: int, turns_each: int, repeats: int, batch_delay_ms: int | None
) -> dict[str, Any]:
    """The noop scenario with tracing off and on (TURNBUS_OTEL=1, the gateway's and the
    workers' spans exported over OTLP/HTTP to a sink process on loopback), a stack each,
    both up, ``repeats`` runs each, turn about; each side's median run by turns/s and
    what tracing on costs against off. ``batch_delay_ms``: the exporter's
    OTEL_BSP_SCHEDULE_DELAY, when not its default (or the caller's shell's)."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    on_env = {**NO_LATENCY, "TURNBUS_OTEL": "1"}
    if batch_delay_ms is not None:
        on_env["OTEL_BSP_SCHEDULE_DELAY"] = str(batch_delay_ms)
    # A batch goes every OTEL_BSP_SCHEDULE_DELAY ms, or sooner when 512 spans wait: a
    # run's last spans are in once the sink has been idle for longer than that.
    delay_ms = on_env.get("OTEL_BSP_SCHEDULE_DELAY", os.environ.get("OTEL_BSP_SCHEDULE_DELAY"))
    quiet_s = float(delay_ms or 5000) / 1000 + 1.0
    with OtlpSinkProcess() as sink, contextlib.ExitStack() as stacks:
        envs = {
            # Off as a deployment leaves it; said explicitly, against the caller's shell.
            "off": {**NO_LATENCY, "TURNBUS_OTEL": "0"},
            "on": {**on_env, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url},
        }
        booting = {side: stacks.enter_context(starting(env, workers)) for side, env in envs.items()}
        started = {side: stack.ready() for side, stack in booting.items()}
        for r in range(repeats):
            for side, stack in started.items():
                print(f"noop, tracing {side} {r + 1}/{repeats}: {sessions} x {turns_each} ...")
                before = otlp_settled(sink, quiet_s)
                sink_cpu = cpu_seconds(sink.pid)
                run = run_client(scenario_noop(stack, sessions, turns_each))
                after = otlp_settled(sink, quiet_s) if side == "on" else sink.stats()
                # Every turn the run made is traced, its warm-up's too.
                turns = max(run["turns_accepted"] + run["warm_up_turns_not_measured"], 1)
                by_service = Counter(after["spans_by_service"])
                by_service.subtract(before["spans_by_service"])
                run["otlp"] = {
                    "turns_traced": turns,
                    "requests": after["requests"] - before["requests"],
                    "spans_per_turn": round((after["spans"] - before["spans"]) / turns, 2),
                    "spans_per_turn_by_service": {
                        k: round(v / turns, 2) for k, v in sorted(by_service.items()) if v
                    },
                    "bytes_per_turn": round((after["bytes"] - before["bytes"]) / turns),
                    "sink_cpu_s_per_turn": round((cpu_seconds(sink.pid) - sink_cpu) / turns, 6),
                }
                runs[side].append(run)
    out: dict[str, Any] = {}
    for side, side_runs in runs.items():
        median = dict(
            sorted(side_runs, key=lambda run: float(run["turns_per_s"]))[len(side_runs) // 2]
        )
        median["runs_turns_per_s"] = [run["turns_per_s"] for run in side_runs]
        median["runs_cpu_s_per_turn_workers_gateway"] = [
            run["cpu_s_per_turn_workers_gateway"] for run in side_runs
        ]
        out[f"noop_otel_{side}"] = median
        print(json.dumps(median, indent=1), flush=True)
    rates = {side: [float(run["turns_per_s"]) for run in r] for side, r in runs.items()}
    cpus = {
        side: [float(run["cpu_s_per_turn_workers_gateway"]) for run in r]
        for side, r in runs.items()
    }
    off_rate, on_rate = _median(rates["off"]), _median(rates["on"])
    off_cpu, on_cpu = _median(cpus["off"]), _median(cpus["on"])
    spans = [float(run["otlp"]["spans_per_turn"]) for run in runs["on"]]
    summary = {
        "repeats": repeats,
        "turns_per_s_off": off_rate,
        "turns_per_s_on": on_rate,
        # The noise: how far the off runs spread, as a share of their median.
        "off_runs_spread_pct": round(100 * (max(rates["off"]) - min(rates["off"])) / off_rate, 1),
        "on_throughput_cost_pct": round(100 * (off_rate - on_rate) / off_rate, 1),
        "cpu_s_per_turn_workers_gateway_off": off_cpu,
        "cpu_s_per_turn_workers_gateway_on": on_cpu,
        "on_cpu_cost_pct": round(100 * (on_cpu - off_cpu) / off_cpu, 1) if off_cpu else None,
        "on_cpu_us_per_turn": round(1e6 * (on_cpu - off_cpu), 1),
        "spans_per_turn_on": _median(spans),
        "sink_cpu_s_per_turn": _median(
            [float(run["otlp"]["sink_cpu_s_per_turn"]) for run in runs["on"]]
        ),
    }
    print(json.dumps(summary, indent=1), flush=True)
    out["otel"] = summary
    return out


# --- main -----------------------------------------------------------------------------


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--sessions", type=int, default=None, help="load: users (default 2000)")
    parser.add_argument(
        "--scenario",
        choices=["all", "load", "delivery", "noop", "flood", "flood_user", "sdk", "tools", "pause"],
        default="all",
    )
    parser.add_argument("--quick", action="store_true", help="a small, fast smoke run")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="load and noop (or the one --scenario names) on one Redis and on a local\n"
        "Redis Cluster (3 masters, 3 replicas), turn about; Redis per node",
    )
    parser.add_argument(
        "--replica",
        action="store_true",
        help="load and noop (or the one --scenario names) on a primary with one replica,\n"
        "with each TURNBUS_WAIT_REPLICAS of --wait-replicas, turn about",
    )
    parser.add_argument(
        "--wait-replicas",
        default="0,1",
        help="--replica: the TURNBUS_WAIT_REPLICAS values compared, comma-separated\n(default 0,1)",
    )
    parser.add_argument(
        "--otel",
        action="store_true",
        help="noop with tracing off and on (spans to a local OTLP/HTTP sink), turn\n"
        "about, --noop-repeats runs each; writes bench_load_otel.json",
    )
    parser.add_argument("--no-arq", action="store_true", help="skip the arq side-by-side")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--pause-repeats",
        type=int,
        default=3,
        help="pause: runs at each rate, each on a fresh stack; the median run by its "
        "answer-to-next-round p99 is kept (default 3)",
    )
    parser.add_argument(
        "--pause-spread-s",
        default="0",
        help="pause: the turns sent one after another across this many seconds (default "
        "0: all at once); a list (0,1,2) runs once for each, a fresh stack each, and "
        "records the answer rate and latency of each run (by_answer_rate)",
    )
    parser.add_argument(
        "--two-requests",
        action="store_true",
        help="submit, then GET the events (default: one submit that streams)",
    )
    parser.add_argument(
        "--noop-turns", type=int, default=10, help="noop: turns per session (default 10)"
    )
    parser.add_argument(
        "--delivery-repeats",
        type=int,
        default=3,
        help="delivery: runs, each on a fresh stack; the median run is kept (default 3)",
    )
    parser.add_argument(
        "--noop-repeats",
        type=int,
        default=3,
        help="noop: runs of each side, medians compared (default 3)",
    )
    parser.add_argument(
        "--sdk-levels",
        default=",".join(str(n) for n in SDK_LEVELS),
        help="sdk: turns at once per step, comma-separated (default 100,250,500,1000)",
    )
    parser.add_argument(
        "--sdk-repeats",
        type=int,
        default=3,
        help="sdk: runs of each step per model, turn about; the median kept (default 3)",
    )
    args = parser.parse_args()
    # The load generator is not what is measured: its startup objects are frozen out of
    # the collector's sight as the services' are, and run_client turns it off.
    tune_gc()
    global TWO_REQUESTS, TTFT_MS, TOKENS_PER_S
    TWO_REQUESTS = args.two_requests
    quick = args.quick
    if quick:
        # A smoke run counts, its figures are not kept: a model ten times as fast (the
        # same turns, rounds and events) keeps it short.
        TTFT_MS, TOKENS_PER_S = 50, 500
        REALISTIC["TURNBUS_SCRIPTED_TTFT_MS"] = str(TTFT_MS)
        REALISTIC["TURNBUS_SCRIPTED_TOKENS_PER_S"] = str(TOKENS_PER_S)
        # The tools scenario's three sides run on the shared stack, which loads the tool.
        REALISTIC["TURNBUS_TOOLS"] = str(TOOLS_MODULE)
    sessions = args.sessions or (20 if quick else 2000)
    every = {"load", "delivery", "noop", "flood", "flood_user", "sdk", "tools", "pause"}
    wanted = every if args.scenario == "all" else {args.scenario}
    if args.cluster and cluster_binaries() is None:
        print("skipped: --cluster needs redis-server >= 7 and redis-cli on the PATH")
        return
    if args.cluster and args.replica:
        parser.error("--cluster and --replica are two different runs")
    if args.otel:
        if args.cluster or args.replica or args.scenario not in ("all", "noop"):
            parser.error("--otel runs the noop scenario alone, on one Redis")
        noop_sessions, turns_each = (min(sessions, 10), 3) if quick else (100, args.noop_turns)
        repeats = 1 if quick else args.noop_repeats
        # A quick run's exporter sends every 200 ms: its last spans are in sooner.
        delay = 200 if quick else None
        results = noop_otel(args.workers, noop_sessions, turns_each, repeats, delay)
        figures = {"workers": args.workers, "otel": results.pop("otel"), "scenarios": results}
        name = "bench_load_otel_quick" if quick else "bench_load_otel"
        print(f"wrote {write_results(name, figures, args.results_dir)}")
        return
    side_by_side = args.cluster or args.replica
    if side_by_side and args.scenario == "all":
        wanted = {"load", "noop"}
    figures: dict[str, Any] = {
        "profile": {"ttft_ms": TTFT_MS, "tokens_per_s": TOKENS_PER_S, "rounds": 2},
        "workers": args.workers,
        "client": (
            "two requests per turn: POST …/turns, then GET its events"
            if TWO_REQUESTS
            else "one request per turn: POST …/turns with Accept: text/event-stream"
        ),
        "scenarios": {},
    }
    results = figures["scenarios"]

    # Each scenario on a stack of its own: what one left behind (thousands of finished
    # turns, a process that served a burst) is not the next one's starting point.
    if side_by_side:
        flag = "--cluster" if args.cluster else "--replica"
        if not wanted <= {"load", "noop"}:
            parser.error(f"{flag} runs the load and noop scenarios only")
        workers = args.workers
        sides: dict[str, StartStack]
        if args.cluster:
            figures["cluster"] = {"shards": CLUSTER_SHARDS}
            sides = {
                "one_redis": lambda env: starting(env, workers),
                "cluster": lambda env: starting_on_cluster(env, workers),
            }
        else:
            waits = [int(n) for n in args.wait_replicas.split(",")]
            figures["replica"] = {"replicas": 1, "wait_replicas": waits}
            sides = {
                f"wait_replicas_{n}": lambda env, n=n: starting_with_replica(
                    {**env, "TURNBUS_WAIT_REPLICAS": str(n)}, workers
                )
                for n in waits
            }
        if "load" in wanted:
            wanted.discard("load")
            results.update(load_sides(sides, sessions))
        if "noop" in wanted:
            wanted.discard("noop")
            noop_sessions, turns_each = (min(sessions, 10), 3) if quick else (100, args.noop_turns)
            results.update(
                noop_sides(sides, noop_sessions, turns_each, 1 if quick else args.noop_repeats)
            )
    # A full run gives each scenario a stack of its own. A quick run (a smoke test whose
    # figures are not kept) shares one between load, delivery, flood, pause, tools and
    # sdk's scripted side (with --workers 1): a stack takes seconds to start.
    with contextlib.ExitStack() as shared:
        quick_stack: list[Stack] = []
        # A quick run's noop stack boots while the other scenarios run.
        noop_booting = (
            shared.enter_context(starting(NO_LATENCY, args.workers))
            if quick and "noop" in wanted
            else None
        )

        @contextlib.contextmanager
        def realistic() -> Iterator[Stack]:
            if not quick:
                with up(REALISTIC, args.workers) as stack:
                    yield stack
                return
            if not quick_stack:
                quick_stack.append(shared.enter_context(up(REALISTIC, args.workers)))
            yield quick_stack[0]

        if "load" in wanted:
            with realistic() as stack:
                print(f"load: {sessions} sessions, one realistic turn each ...", flush=True)
                results["load"] = run_client(scenario_load(stack, sessions))
                print(json.dumps(results["load"], indent=1), flush=True)
        if "delivery" in wanted:
            n = max(sessions // 2, 1)
            # The tail is set by the first events, written while a thousand submits arrive
            # at once, and varies from run to run: the median run of three is kept.
            runs = []
            for r in range(1 if quick else args.delivery_repeats):
                with realistic() as stack:
                    print(f"delivery {r + 1}: {n} turns streaming at once ...", flush=True)
                    runs.append(run_client(scenario_delivery(stack, n)))
            runs.sort(key=lambda run: float(run["event_delivery"]["p99_ms"] or 0))
            results["delivery"] = dict(runs[len(runs) // 2])
            results["delivery"]["runs_event_delivery_p99_ms"] = [
                run["event_delivery"]["p99_ms"] for run in runs
            ]
            print(json.dumps(results["delivery"], indent=1), flush=True)
        if "flood" in wanted:
            with realistic() as stack:
                queued, others = (10, 2) if quick else (150, 5)
                print(f"flood: one session with {queued} queued turns ...", flush=True)
                gap_s = 0.1 if quick else 1.0
                results["flood"] = run_client(scenario_flood(stack, queued, others, gap_s))
                print(json.dumps(results["flood"], indent=1), flush=True)
        if "flood_user" in wanted:
            # A stack of its own, quick or not: the flooding user's quotas are set on it.
            # A quick run's turns end within a second: a smaller queue quota is met.
            quotas = dict(FLOOD_USER_QUOTAS)
            if quick:
                quotas["TURNBUS_QUOTA_QUEUED_TURNS"] = "100"
            with up({**REALISTIC, **quotas}, args.workers) as stack:
                n_sessions, n_turns, others = (50, 1200, 3) if quick else (50, 3000, 10)
                print(
                    f"flood_user: one user, {n_sessions} sessions, {n_turns} turns ...", flush=True
                )
                gap_s = 0.2 if quick else 1.0
                results["flood_user"] = run_client(
                    scenario_flood_user(stack, n_sessions, n_turns, others, gap_s, quotas)
                )
                print(json.dumps(results["flood_user"], indent=1), flush=True)
        if "pause" in wanted:
            n = min(sessions, 1000)
            by_rate = []
            for spread in (float(x) for x in args.pause_spread_s.split(",")):
                # The p99 is set by how tight the pauses came, which varies from run to
                # run: each rate's median run (by that p99) of its repeats is kept.
                runs = []
                for r in range(1 if quick else args.pause_repeats):
                    with realistic() as stack:
                        print(f"pause {r + 1}: {n} sessions, across {spread} s ...", flush=True)
                        runs.append(run_client(scenario_pause(stack, n, spread)))
                runs.sort(
                    key=lambda run: float(run["pause"]["answer_to_next_round"]["p99_ms"] or 0)
                )
                median = dict(runs[len(runs) // 2])
                median["pause"]["runs_answer_to_next_round_p99_ms"] = [
                    run["pause"]["answer_to_next_round"]["p99_ms"] for run in runs
                ]
                by_rate.append(pause_at_rate(median))
                if "pause" not in results:
                    results["pause"] = median
                print(json.dumps(by_rate[-1]), flush=True)
            if len(by_rate) > 1:
                results["pause"]["pause"]["by_answer_rate"] = by_rate
        if "sdk" in wanted and quick:
            # A quick run's scripted side: the shared stack, when it has the one worker
            # the sdk side has; no warm-up (the figures are not kept).
            levels = (min(sessions, 20),)
            with contextlib.ExitStack() as own:
                scripted = own.enter_context(realistic()) if args.workers == 1 else None
                results["sdk"] = scenario_sdk(levels, 1, scripted=scripted, warm_up=False)
            print(json.dumps(results["sdk"]["holds_within_1_5x_p50"]), flush=True)
            wanted.discard("sdk")
        if "tools" in wanted and quick:
            with realistic() as stack:
                results["tools"] = tools_beside_load(args.workers, min(sessions, 1000), stack)
            wanted.discard("tools")
        if noop_booting is not None:
            results["noop"] = noop_beside_arq(noop_booting.ready(), args)
            wanted.discard("noop")

    if "noop" in wanted:
        with up(NO_LATENCY, args.workers) as stack:
            results["noop"] = noop_beside_arq(stack, args)

    if "tools" in wanted:
        results["tools"] = tools_beside_load(args.workers, min(sessions, 1000))
        print(json.dumps(results["tools"]["per_call"], indent=1), flush=True)

    if "sdk" in wanted:
        levels = tuple(int(n) for n in args.sdk_levels.split(","))
        results["sdk"] = scenario_sdk(levels, args.sdk_repeats)
        print(json.dumps(results["sdk"]["holds_within_1_5x_p50"]), flush=True)

    name = "bench_load" if args.scenario == "all" else f"bench_load_{args.scenario}"
    if side_by_side:
        name = name.replace(
            "bench_load", "bench_load_" + ("cluster" if args.cluster else "replica")
        )
    name = f"{name}_quick" if quick else name
    print(f"wrote {write_results(name, figures, args.results_dir)}")


if __name__ == "__main__":
    main()
