"""The cluster client through a cluster's faults and changes, on one cluster of this
module's own (3 masters, 3 replicas), which each test leaves whole for the next: a
master stopped (SIGSTOP: its links half-open), a killed master back as a replica
(``READONLY``), a node added, given 100 slots, emptied and removed while turns run."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from harness.local_cluster import LocalCluster, cluster_binaries, local_cluster
from tests.gateway_server import live_gateway, signed_in, wait_for
from tests.shared.test_cluster import _errors, _keys_on_each_master
from tests.shared.test_cluster_failover import _ended, _status, _terminal_events, turn_settings
from tests.shared.test_cluster_tls import _free_node_port
from tests.worker_kit import running_worker
from turnbus.shared.cluster import Address, ClusterMux
from turnbus.shared.connect import connect
from turnbus.shared.keys import Keys
from turnbus.worker.models.scripted import ScriptedModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90), pytest.mark.xdist_group("faults")]

USER = "alice"


@pytest.fixture(scope="module")
def local() -> Iterator[LocalCluster]:
    if cluster_binaries() is None:
        pytest.skip("needs redis-server >= 7 and redis-cli on the PATH")
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
async def probe(local: LocalCluster, prefix: str) -> AsyncIterator[ClusterMux]:
    client = connect(turn_settings(local, prefix), "status")
    assert isinstance(client, ClusterMux)
    try:
        yield client
    finally:
        await client.aclose()


async def _sessions(http: httpx.AsyncClient, count: int) -> list[str]:
    out = []
    for _ in range(count):
        r = await http.post("/v1/sessions")
        assert r.status_code == 201, r.text
        out.append(r.json()["sessionId"])
    return out


async def _submit(
    http: httpx.AsyncClient, sessions: list[str], message: str
) -> list[tuple[str, str]]:
    """A turn on each session, each answered 202 (a 503 while the cluster changes is
    asked again)."""
    turns: list[tuple[str, str]] = []
    for sid in sessions:
        answers: list[str] = []

        async def accepted(sid: str = sid, answers: list[str] = answers) -> bool:
            r = await http.post(
                f"/v1/sessions/{sid}/turns", json={"message": message, "multitask": "enqueue"}
            )
            assert r.status_code in (202, 503), r.text
            if r.status_code == 202:
                answers.append(r.json()["turnId"])
            return bool(answers)

        await wait_for(accepted, 30, what=f"a 202 for a turn on {sid}")
        turns.append((sid, answers[0]))
    return turns


def _master_of(probe: ClusterMux, keys: Keys, sid: str) -> Address | None:
    return probe.address_for_key(keys.env(USER, sid))


async def test_a_stopped_master_s_half_open_links_are_dropped_and_turns_go_on(
    local: LocalCluster, probe: ClusterMux, prefix: str
) -> None:
    settings = turn_settings(local, prefix)
    keys = Keys(prefix)
    async with (
        live_gateway(settings) as gateway,
        running_worker(settings, ScriptedModel(settings), name="w1"),
        signed_in(gateway, settings, USER) as http,
    ):
        sessions = await _sessions(http, 6)
        await probe.masters()
        work = probe.address_for_key(keys.work(0))
        # The master stopped serves sessions, not the work stream: the turns' own
        # commands meet the half-open links.
        while not any(_master_of(probe, keys, s) not in (None, work) for s in sessions):
            sessions += await _sessions(http, 1)
        victim = next(
            a for a in map(lambda s: _master_of(probe, keys, s), sessions) if a not in (None, work)
        )
        assert victim is not None
        for port in local.masters():
            local.wait_replicated(port)
        before = await _submit(http, sessions, "remember the build is green")

        async def one_running() -> bool:
            return any([await _status(http, s, t) == "running" for s, t in before])

        await wait_for(one_running, 20, what="a turn running")
        # Stopped, not killed: its sockets stay open and its kernel acknowledges every
        # byte. Only the links' stall watch and timeouts can tell.
        local.procs[victim[1]].send_signal(signal.SIGSTOP)
        try:
            after = await _submit(http, sessions, "what did we conclude?")
            await wait_for(lambda: _ended(http, after), 40, what="the later turns to end")
            for sid, tid in after:
                assert await _terminal_events(http, sid, tid) == ["turn.completed"]
            for sid, tid in before:
                assert len(await _terminal_events(http, sid, tid)) <= 1
            # The stopped master left the slot map, and every client of it was closed.
            await probe.refresh()
            assert victim not in [probe.address_of(n) for n in probe.node_clients]
        finally:
            local.procs[victim[1]].send_signal(signal.SIGCONT)
    await asyncio.to_thread(local.wait_ok, 30)  # back, as a replica


async def test_a_demoted_master_s_readonly_answer_sends_the_write_to_its_new_master(
    local: LocalCluster, probe: ClusterMux, prefix: str
) -> None:
    client = connect(turn_settings(local, prefix), "status")
    assert isinstance(client, ClusterMux)
    try:
        keys = await _keys_on_each_master(client, prefix)
        for key in keys:
            await client.set(key, "before")
        victim = client.address_for_key(keys[0])
        assert victim is not None
        await probe.masters()  # the map read while the victim (maybe the seed) answers
        local.wait_replicated(victim[1])
        local.kill(victim[1])

        async def taken_over() -> bool:
            await probe.refresh()
            return probe.address_for_key(keys[0]) not in (None, victim)

        await wait_for(taken_over, 20, what="the replica to take over")
        local.start_node(victim[1])
        await asyncio.to_thread(local.wait_ok, 30)
        assert local.client(victim[1]).info("replication")["role"] == "slave"
        # The client's map still names the killed node: it is back, as a replica, and
        # answers a write that names no key (no MOVED for those) with READONLY.
        assert client.address_for_key(keys[0]) == victim
        readonly = _errors(local, victim[1], "READONLY")
        assert await client.flushdb()
        assert _errors(local, victim[1], "READONLY") > readonly
        # The map was read again and the new master flushed too: nothing is left.
        assert await client.dbsize() == 0
        assert client.address_for_key(keys[0]) not in (None, victim)
        assert victim not in [client.address_of(n) for n in client.node_clients]
        await client.set(keys[0], "after")
        assert await client.get(keys[0]) == "after"
    finally:
        await client.aclose()


def _run_cli(local: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [local.cli, "--cluster", *args], capture_output=True, text=True, timeout=60, check=False
    )


async def _cli(local: LocalCluster, *args: str) -> None:
    """``redis-cli --cluster ...``, once every node agrees on the slots (as it requires)
    and sees the cluster up (a node just added may not yet)."""
    anchor = f"127.0.0.1:{local.masters()[0]}"

    def up() -> bool:
        members = local.client(int(anchor.rsplit(":", 1)[1])).cluster("NODES")
        ports = [int(address.split("@")[0].rsplit(":", 1)[1]) for address in members]
        return all(local.client(p).cluster("INFO")["cluster_state"] == "ok" for p in ports)

    async def agreed() -> bool:
        checked = await asyncio.to_thread(_run_cli, local, "check", anchor)
        return checked.returncode == 0 and up()

    await wait_for(agreed, 20, what="the nodes to agree on the slots")
    done = await asyncio.to_thread(_run_cli, local, *args)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])


async def test_a_node_added_resharded_and_removed_while_turns_run(
    local: LocalCluster, probe: ClusterMux, prefix: str
) -> None:
    settings = turn_settings(local, prefix)
    port = _free_node_port({q for p in local.ports for q in (p, p + 10000)})
    local.start_node(port)
    local.ports.append(port)

    def answers() -> bool:
        with contextlib.suppress(redis.ConnectionError):
            return bool(local.client(port).ping())
        return False

    await wait_for(answers, 10, what="the new node")
    anchor = local.masters()[0]
    await _cli(local, "add-node", f"127.0.0.1:{port}", f"127.0.0.1:{anchor}")
    new_id = local.client(port).cluster("MYID")
    await wait_for(
        lambda: all(new_id in str(local.client(p).cluster("NODES")) for p in local.procs),
        20,
        what="every node to know the new one",
    )
    async with (
        live_gateway(settings) as gateway,
        running_worker(settings, ScriptedModel(settings), name="w1"),
        signed_in(gateway, settings, USER) as http,
    ):
        sessions = await _sessions(http, 8)
        turns = await _submit(http, sessions, "remember the build is green")
        await _cli(
            local, "reshard", f"127.0.0.1:{anchor}", "--cluster-from", "all",
            "--cluster-to", new_id, "--cluster-slots", "100", "--cluster-yes",
        )  # fmt: skip
        turns += await _submit(http, sessions, "what did we conclude?")
        await probe.refresh()
        assert ("127.0.0.1", port) in [probe.address_of(m) for m in await probe.masters()]
        await _cli(
            local, "reshard", f"127.0.0.1:{anchor}", "--cluster-from", new_id,
            "--cluster-to", local.client(anchor).cluster("MYID"), "--cluster-slots", "100",
            "--cluster-yes",
        )  # fmt: skip
        await _cli(local, "del-node", f"127.0.0.1:{anchor}", new_id)
        local.kill(port)  # del-node leaves it up, reset, out of the cluster
        local.ports.remove(port)
        turns += await _submit(http, sessions, "what did we conclude?")
        await wait_for(lambda: _ended(http, turns), 40, what="every turn to end")
        for sid, tid in turns:
            assert await _terminal_events(http, sid, tid) == ["turn.completed"]
    # The removed node left the map: its client was closed and dropped.
    await probe.refresh()
    assert ("127.0.0.1", port) not in [probe.address_of(n) for n in probe.node_clients]
