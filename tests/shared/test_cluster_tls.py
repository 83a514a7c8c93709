"""shared.cluster on a Redis Cluster that speaks TLS only and signs clients in with ACL
users (3 masters): every link (multiplexed, pooled, the slot map's reads) uses both."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.exceptions
from redis.asyncio import BlockingConnectionPool, SSLConnection
from redis.credentials import CredentialProvider

from harness.local_cluster import cluster_binaries, port_pair
from harness.waits import poll_blocking
from tests.shared.test_connect import _certificates
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.connect import connect
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60), pytest.mark.xdist_group("cluster-tls")]

USER, PASSWORD = "tb", "tb-cluster-secret"


def _free_node_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too, clear of ``taken``."""
    return port_pair(taken)


def _client(port: int, ca: Path) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        ssl=True,
        ssl_ca_certs=str(ca),
        username=USER,
        password=PASSWORD,
        socket_timeout=5,
        decode_responses=True,
    )


def _wait(what: str, check: Callable[[], object], within: float = 20.0) -> None:
    """``check`` holds within ``within`` seconds (a node not answering yet is not yet)."""
    poll_blocking(check, within=within, what=f"the TLS cluster: {what}", not_yet=_NOT_YET)


_NOT_YET = (redis.exceptions.RedisError, OSError)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[int], Path]]:
    """3 masters on TLS ports only (the cluster bus on TLS too), the default user off and
    one ACL user; their ports and the CA that signed their certificate."""
    binaries = cluster_binaries()
    if binaries is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server >= 7, redis-cli and openssl on the PATH")
    server, cli = binaries
    where = tmp_path_factory.mktemp("tls-cluster")
    ca = _certificates(where)
    ports: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(3):
            port = _free_node_port({q for p in ports for q in (p, p + 10000)})
            ports.append(port)
            (where / str(port)).mkdir()
            procs.append(
                subprocess.Popen(
                    [
                        server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                        "--tls-cluster", "yes", "--tls-replication", "yes",
                        "--tls-cert-file", str(where / "server.crt"),
                        "--tls-key-file", str(where / "server.key"),
                        "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                        "--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                        "--cluster-config-file", "nodes.conf", "--dir", str(where / str(port)),
                        "--user", "default", "off",
                        "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
                        "--save", "", "--appendonly", "no",
                        "--logfile", str(where / str(port) / "redis.log"),
                    ]
                )
            )  # fmt: skip
        for port, proc in zip(ports, procs, strict=True):
            _wait(f"node {port} to answer", lambda p=port: _client(p, ca).ping())
            if proc.poll() is not None:
                pytest.skip("this redis-server does not run a cluster over TLS")
        subprocess.run(
            [
                cli, "--tls", "--cacert", str(ca), "--user", USER, "--pass", PASSWORD,
                "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas", "0", "--cluster-yes",
            ],
            capture_output=True,
            check=True,
            timeout=30,
        )  # fmt: skip
        for port in ports:
            _wait(
                f"node {port} to see the cluster ok",
                lambda p=port: _client(p, ca).cluster("INFO")["cluster_state"] == "ok",
            )
        yield ports, ca
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


class _Rotating(CredentialProvider):
    """Credentials asked afresh at every connect, as a token source would hand them."""

    def __init__(self) -> None:
        self.asked = 0

    def get_credentials(self) -> tuple[str, str]:
        self.asked += 1
        return USER, PASSWORD


@pytest.fixture
async def cluster(tls_cluster: tuple[list[int], Path]) -> AsyncIterator[ClusterMux]:
    ports, ca = tls_cluster
    url = f"rediss://{USER}:{PASSWORD}@127.0.0.1:{ports[0]}/0?ssl_ca_certs={ca}"
    client = connect(Settings(redis_url=url, redis_cluster=True), "worker")
    assert isinstance(client, ClusterMux)
    try:
        yield client
    finally:
        await client.aclose()


async def test_an_acl_user_over_tls_reaches_every_master(
    cluster: ClusterMux, tls_cluster: tuple[list[int], Path], prefix: str
) -> None:
    ports, ca = tls_cluster
    masters = await cluster.masters()
    assert sorted(cluster.address_of(m)[1] for m in masters) == sorted(ports)
    keys = [f"{prefix}:{{{n}}}:k" for n in range(30)]
    async with cluster.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.set(key, key)
        await pipe.execute()
    assert await cluster.mget(keys[0]) == [keys[0]]
    assert sorted(await cluster.keys(f"{prefix}:*")) == sorted(keys)
    # A blocking read takes a pooled connection: TLS and the ACL user there too.
    assert await cluster.xread({f"{prefix}:{{0}}:s": "0-0"}, block=10) == []
    # Each master saw only the ACL user, and only over TLS (no plain port is open).
    for port in ports:
        users = {c["user"] for c in _client(port, ca).client_list()}
        assert users == {USER}
    assert await cluster.delete(*keys) == len(keys)


async def test_a_refused_sign_in_fails_at_once_naming_it(
    tls_cluster: tuple[list[int], Path],
) -> None:
    ports, ca = tls_cluster
    url = f"rediss://{USER}:wrong@127.0.0.1:{ports[0]}/0?ssl_ca_certs={ca}"
    # The failover wait is long: a refused sign-in is not waited out as a lost node.
    client = connect(
        Settings(redis_url=url, redis_cluster=True, redis_failover_wait_ms=60_000), "status"
    )
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await client.get("k")
    finally:
        await client.aclose()


async def test_a_credential_provider_signs_each_new_link_in_afresh(
    tls_cluster: tuple[list[int], Path], prefix: str
) -> None:
    ports, ca = tls_cluster
    provider = _Rotating()

    def node_client(host: str, port: int) -> MuxRedis:
        pool = BlockingConnectionPool(
            host=host,
            port=port,
            connection_class=SSLConnection,
            ssl_ca_certs=str(ca),
            credential_provider=provider,
            decode_responses=True,
        )
        return MuxRedis(pool)

    client = ClusterMux(node_client, [("127.0.0.1", ports[0])])
    try:
        key = f"{prefix}:{{p}}:k"
        await client.set(key, "1")
        node = await client.node_for_key(key)
        asked, connects = provider.asked, node.connects
        link_id = await node.call("CLIENT", "ID")
        address = client.address_of(node)
        _client(address[1], ca).client_kill_filter(_id=str(link_id))
        # The link was cut: the next command connects again, with credentials asked anew.
        assert await client.get(key) == "1"
        assert node.connects == connects + 1
        assert provider.asked > asked
    finally:
        await client.aclose()
