"""A killed master does not stop the service: after its replica takes over, the gateway
and the worker carry on without a restart (3 masters, 3 replicas, SIGKILL)."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest
from gateway.auth import mint_token
from worker.models.scripted import ScriptedModel

import shared.keys
from shared.cluster import ClusterMux
from shared.connect import connect
from shared.settings import Settings
from tests.gateway_server import live_gateway, sse_events, wait_for
from tests.redis_cluster import cluster_binaries, local_cluster
from tests.worker_kit import running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"}


async def _terminal_events(http: httpx.AsyncClient, session: str, turn: str) -> list[str]:
    kinds: list[str] = []
    async with http.stream("GET", f"/v1/sessions/{session}/turns/{turn}/events") as r:
        assert r.status_code == 200, await r.aread()
        async for event in sse_events(r.aiter_lines()):
            kinds.append(str(event.json()["type"]))
    return [k for k in kinds if k in TERMINAL]


async def _status(http: httpx.AsyncClient, session: str, turn: str) -> str:
    r = await http.get(f"/v1/sessions/{session}/turns/{turn}")
    return str(r.json().get("status")) if r.status_code == 200 else f"http {r.status_code}"


async def test_a_killed_master_does_not_stop_the_gateway_or_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if cluster_binaries() is None:
        pytest.skip("needs redis-server >= 7 and redis-cli on the PATH")
    # Every key in one slot (tests/conftest.py, CLUSTER_ONE_SLOT): the master that dies
    # holds every session, the work stream and its consumer group.
    monkeypatch.setattr(shared.keys, "_PREFIX_RE", re.compile(r"^[A-Za-z0-9._{}-]{1,32}$"))
    prefix = "{t" + uuid.uuid4().hex[:10] + "}"
    with local_cluster() as local:
        settings = Settings(
            redis_url=local.url,
            redis_cluster=True,
            prefix=prefix,
            jwt_secret="test-secret-" + prefix,
            scripted_delay_ms=30,
            scripted_rounds=3,
            lease_ms=2000,
            heartbeat_ms=300,
            claim_idle_ms=1000,
            redis_failover_wait_ms=30_000,
        )
        headers = {"Authorization": f"Bearer {mint_token('test-secret-' + prefix, 'alice')}"}
        probe = connect(settings, "status")
        assert isinstance(probe, ClusterMux)
        async with (
            live_gateway(settings) as gateway,
            running_worker(settings, ScriptedModel(settings), name="w1"),
            httpx.AsyncClient(base_url=gateway.base_url, headers=headers, timeout=40) as http,
        ):
            sessions = []
            for _ in range(4):
                r = await http.post("/v1/sessions")
                assert r.status_code == 201, r.text
                sessions.append(r.json()["sessionId"])
            await probe.masters()
            victim = probe.address_for_key(prefix)
            assert victim is not None
            # The sessions are on the replica too (a write acknowledged just before the
            # kill may not be: replication is asynchronous).
            local.wait_replicated(victim[1])
            before: list[tuple[str, str]] = []
            for sid in sessions:
                r = await http.post(f"/v1/sessions/{sid}/turns", json={"message": "hi there"})
                assert r.status_code == 202, r.text
                before.append((sid, r.json()["turnId"]))

            async def one_running() -> bool:
                return any([await _status(http, s, t) == "running" for s, t in before])

            await wait_for(one_running, 20, what="a turn running")
            local.kill(victim[1])

            # Submits during the takeover may get 503; each gets a 202 within the wait.
            after: list[tuple[str, str]] = []
            for sid in sessions:
                for _ in range(60):
                    r = await http.post(
                        f"/v1/sessions/{sid}/turns",
                        json={"message": "again", "multitask": "enqueue"},
                    )
                    if r.status_code == 202:
                        after.append((sid, r.json()["turnId"]))
                        break
                    assert r.status_code == 503, r.text
                else:
                    raise AssertionError("no 202 after the takeover")

            # The same processes serve on: every turn accepted after the kill ends once.
            for sid, tid in after:
                assert await _terminal_events(http, sid, tid) == ["turn.completed"]
            # A turn in flight at the kill ends at most once (a write the dead master
            # acknowledged but never replicated may be gone with it).
            outcomes = {}
            for sid, tid in before:
                outcomes[tid] = await _status(http, sid, tid)
                if outcomes[tid] in ("completed", "failed", "cancelled", "timed_out"):
                    assert len(await _terminal_events(http, sid, tid)) == 1
            await probe.refresh()
            assert probe.address_for_key(prefix) != victim
            print("turns in flight at the kill:", sorted(outcomes.values()))
        await probe.aclose()
