from __future__ import annotations

import dataclasses

import httpx
import redis.asyncio as aioredis

from tests.redis_server import free_port
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
        assert (await http.get("/nope")).status_code == 404
        assert (await http.post("/healthz")).status_code == 405
        worker.request_stop()
        stopping = await http.get("/healthz")
        assert stopping.status_code == 503
