from __future__ import annotations

import dataclasses

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from harness.redis_server import free_port
from tests.worker_kit import ProgramModel, rounds, running_worker, tool_round, wait_terminal
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore


async def test_health_and_metrics_port(
    redis: aioredis.Redis, keys: Keys, settings: Settings, store: EnvelopeStore
) -> None:
    settings = dataclasses.replace(settings, metrics_port=free_port())
    await store.create("u1", "s1")
    turns = TurnStore(redis, keys, settings)
    model = ProgramModel(rounds(tool_round("working_notes_get", {})))
    async with (
        running_worker(settings, model, name="probe") as worker,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{settings.metrics_port}") as http,
    ):
        record, _, _ = await turns.submit_queued("u1", "s1", "hi")
        await wait_terminal(redis, keys, "u1", "s1", record.turnId)
        health = await http.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "worker": "probe"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        # Each tool source's state (no secrets): here the Python tools, none loaded.
        assert ready.json() == {
            "status": "ok",
            "worker": "probe",
            "tools": {"python": {"tools": 0, "modules": []}},
        }
        metrics = (await http.get("/metrics")).text
        assert 'turnbus_worker_turns_total{status="completed"} 1.0' in metrics
        assert "turnbus_worker_model_rounds_total 2.0" in metrics
        assert (
            'turnbus_worker_tool_calls_total{outcome="ok",tool="working_notes_get"} 1.0' in metrics
        )
        # The call's duration, in the histogram of its tool and outcome.
        (seconds,) = (
            f
            for f in text_string_to_metric_families(metrics)
            if f.name == "turnbus_worker_tool_seconds"
        )
        labels = {"tool": "working_notes_get", "outcome": "ok"}
        samples = [s for s in seconds.samples if {k: s.labels.get(k) for k in labels} == labels]
        by_name = {s.name: s.value for s in samples if not s.name.endswith("_bucket")}
        assert by_name["turnbus_worker_tool_seconds_count"] == 1.0
        observed = by_name["turnbus_worker_tool_seconds_sum"]
        assert 0 <= observed < 10
        buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
        assert buckets[-1] == (float("inf"), 1.0)
        # Cumulative: 0 below the observed duration, 1 from it on.
        assert all(count == (1.0 if le >= observed else 0.0) for le, count in buckets)
        assert (await http.get("/nope")).status_code == 404
        assert (await http.post("/healthz")).status_code == 405
        worker.request_stop()
        stopping = await http.get("/healthz")
        assert stopping.status_code == 503
