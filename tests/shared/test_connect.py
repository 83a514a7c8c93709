"""shared.connect: one factory, settings it cannot honour refused at start."""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from harness.redis_server import free_port
from turnbus.gateway.app import create_app
from turnbus.shared.cluster import ClusterMux
from turnbus.shared.connect import check_cluster_mode, connect, connect_sync, connection_options
from turnbus.shared.mux import MuxRedis
from turnbus.shared.settings import Settings, SettingsError


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("socket_timeout=5", "socket_timeout"),
        ("socket_keepalive=true", "socket_keepalive"),
        ("health_check_interval=10", "health_check_interval"),
        ("protocol=3", "protocol"),
        ("max_connections=4", "max_connections"),
        ("sockettimeout=5", "sockettimeout"),
    ],
)
def test_an_option_the_client_cannot_honour_is_refused_by_name(query: str, named: str) -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:6379/0?{query}", jwt_secret="s" * 32)
    with pytest.raises(SettingsError, match=f"TURNBUS_REDIS_URL.*'{named}'"):
        connection_options(settings)
    # The gateway stops at start, before it serves anything.
    with pytest.raises(SettingsError, match=named):
        create_app(settings)
    # So does a blocking client (turnbus up's check of an external Redis, the local
    # cluster's set-up, the benchmarks' counters).
    with pytest.raises(SettingsError, match=f"TURNBUS_REDIS_URL.*'{named}'"):
        connect_sync(settings, "admin")


def test_a_cluster_url_must_name_a_tcp_node_and_database_0() -> None:
    with pytest.raises(SettingsError, match="only database 0"):
        connection_options(Settings(redis_url="redis://127.0.0.1:7000/2", redis_cluster=True))
    with pytest.raises(SettingsError, match="unix://"):
        connection_options(Settings(redis_url="unix:///tmp/redis.sock", redis_cluster=True))


def test_honoured_options_pass() -> None:
    url = "rediss://u:p@127.0.0.1:7000/0?socket_connect_timeout=3&ssl_cert_reqs=none"
    options = connection_options(Settings(redis_url=url, redis_cluster=True))
    assert (options["username"], options["password"]) == ("u", "p")
    assert options["socket_connect_timeout"] == 3.0


@pytest.fixture
async def acl_user(redis: aioredis.Redis) -> AsyncIterator[tuple[str, str]]:
    name, password = "tb-" + uuid.uuid4().hex[:8], uuid.uuid4().hex
    await redis.acl_setuser(
        name, enabled=True, passwords=[f"+{password}"], keys=["*"], commands=["+@all"]
    )
    try:
        yield name, password
    finally:
        await redis.acl_deluser(name)


async def test_an_acl_user_and_password_are_used_on_every_link(
    redis_url: str, acl_user: tuple[str, str], prefix: str
) -> None:
    name, password = acl_user
    authed = redis_url.replace("redis://", f"redis://{name}:{password}@")
    client = connect(Settings(redis_url=authed), "worker")
    assert isinstance(client, MuxRedis)
    try:
        await client.set(f"{prefix}:k", "v")
        # A blocking read runs on a pooled connection: it signs in too.
        assert await client.xread({f"{prefix}:s": "0-0"}, block=10) == []
        assert await client.acl_whoami() == name
    finally:
        await client.delete(f"{prefix}:k")
        await client.aclose()
    blocking = connect_sync(Settings(redis_url=authed), "admin")
    try:
        assert blocking.acl_whoami() == name
    finally:
        blocking.close()
    wrong = connect(Settings(redis_url=authed.replace(password, "wrong")), "worker")
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()


async def test_the_same_factory_gives_a_cluster_client(redis_cluster_url: str) -> None:
    client = connect(Settings(redis_url=redis_cluster_url, redis_cluster=True), "status")
    assert isinstance(client, ClusterMux)
    try:
        assert await client.ping()
        assert len(await client.masters()) == 3
    finally:
        await client.aclose()


def _certificates(where: Path) -> Path:
    """A CA and a server certificate for 127.0.0.1, signed by it; returns the CA's file."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=tb-test-ca",
    )
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "san.ext",
    )  # fmt: skip
    return where / "ca.crt"


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A redis-server that speaks TLS only; its port and the CA that signed it."""
    server = shutil.which("redis-server")
    if server is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl on the PATH")
    ca = _certificates(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            server, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
            "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        # Redis logs this line once it listens: read its output until then (10 s at most).
        # Raw reads of the pipe: a buffered readline may take the ready line into its
        # buffer along with the one before, and the pipe then has nothing more to say.
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + 10
        seen = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"Ready to accept connections" not in seen:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise RuntimeError("the TLS redis-server did not start")
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.skip("this redis-server does not start with TLS")
                seen += chunk
        yield port, ca
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_a_rediss_url_is_spoken_over_tls_on_every_link(
    tls_redis: tuple[int, Path], tmp_path: Path
) -> None:
    port, ca = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    client = connect(Settings(redis_url=url), "worker")
    try:
        await client.set("k", "v")  # the multiplexed link
        assert await client.xread({"s": "0-0"}, block=10) == []  # a pooled connection
        assert await client.get("k") == "v"
    finally:
        await client.aclose()
    blocking = connect_sync(Settings(redis_url=url), "admin")
    try:
        assert blocking.get("k") == "v"
    finally:
        blocking.close()
    # The certificate is checked: a CA that did not sign it is refused.
    (tmp_path / "other").mkdir()
    other = _certificates(tmp_path / "other")
    stranger = connect(
        Settings(redis_url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other}"), "worker"
    )
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await stranger.ping()
    finally:
        await stranger.aclose()


async def test_a_cluster_node_taken_for_one_redis_is_refused_by_name(
    redis_cluster_url: str, redis_url: str
) -> None:
    for url, cluster, hint in [
        (redis_cluster_url, False, "set TURNBUS_REDIS_CLUSTER=1"),
        (redis_url, True, "set TURNBUS_REDIS_CLUSTER=0"),
    ]:
        wrong = Settings(redis_url=url, redis_cluster=cluster)
        client = connect(wrong, "status")
        try:
            with pytest.raises(SettingsError, match=hint):
                await check_cluster_mode(client, wrong)
        finally:
            await client.aclose()
    # A gateway so configured does not start.
    app = create_app(Settings(redis_url=redis_cluster_url, jwt_secret="s" * 32))
    with pytest.raises(SettingsError, match="set TURNBUS_REDIS_CLUSTER=1"):
        async with app.router.lifespan_context(app):
            pass
