from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from harness.fake_anthropic import FakeAnthropic
from harness.fake_openai import FakeOpenAI
from harness.local_cluster import LocalCluster, cluster_binaries, local_cluster
from harness.redis_server import start_test_redis
from tests.gateway_server import LiveGateway, live_gateway, signed_in
from tests.mcp_kit import HttpMcpServer
from turnbus.shared.connect import connect
from turnbus.shared.envelope import EnvelopeStore
from turnbus.shared.keys import Keys
from turnbus.shared.settings import Settings


def pytest_collection_finish(session: pytest.Session) -> None:
    # The compose tests' image builds while the tests before them run. Not under
    # pytest-xdist: every worker collects every test, and the one that is handed the
    # compose tests builds the image when it gets there.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(item.path.name == "test_compose.py" for item in session.items):
        from tests.e2e import test_compose

        test_compose.start_image_build()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.e2e import test_compose

    test_compose.stop_image_build()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One real Redis server for the whole test session."""
    with start_test_redis() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One local Redis Cluster (3 masters, 3 replicas) for the whole test session."""
    if cluster_binaries() is None:
        pytest.skip("a local Redis Cluster needs redis-server >= 7 and redis-cli on the PATH")
    with local_cluster() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_url(redis_cluster: LocalCluster) -> str:
    return redis_cluster.url


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A module or test marked ``cluster`` runs on one Redis and on the local cluster.
    if "redis_backend" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "cluster"
    ):
        metafunc.parametrize("redis_backend", ["redis", "cluster"], indirect=True)


@pytest.fixture
def redis_backend(request: pytest.FixtureRequest) -> str:
    """``redis`` (one server) or ``cluster`` (tests marked ``cluster`` run on both)."""
    return str(getattr(request, "param", "redis"))


@pytest.fixture
def backend_url(redis_backend: str, request: pytest.FixtureRequest) -> str:
    if redis_backend == "cluster":
        return str(request.getfixturevalue("redis_cluster_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests never see each other's keys."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)


@pytest.fixture
def settings(backend_url: str, redis_backend: str, prefix: str) -> Settings:
    return Settings(
        redis_url=backend_url,
        redis_cluster=redis_backend == "cluster",
        prefix=prefix,
        jwt_secret="test-secret-" + prefix,
    )


@pytest.fixture
async def redis(backend_url: str, redis_backend: str, prefix: str) -> AsyncIterator[aioredis.Redis]:
    if redis_backend == "cluster":
        client = connect(Settings(redis_url=backend_url, redis_cluster=True), "status")
    else:
        client = aioredis.Redis.from_url(backend_url, decode_responses=True)
    try:
        yield client
    finally:
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            await client.unlink(key)
        await client.aclose()


@pytest.fixture
def store(redis: aioredis.Redis, keys: Keys) -> EnvelopeStore:
    return EnvelopeStore(redis, keys)


@pytest.fixture
async def gw(settings: Settings, redis: aioredis.Redis) -> AsyncIterator[LiveGateway]:
    """A live gateway (uvicorn on a free port) on this test's prefix."""
    async with live_gateway(settings) as live:
        yield live


@pytest.fixture
async def http(gw: LiveGateway, settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``gw``, signed in as user ``alice``."""
    async with signed_in(gw, settings) as client:
        yield client


# The fake Messages API the real anthropic SDK talks to: one server per module, reset
# before each test (tests/worker, tests/e2e).
@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def fake(fake_server: FakeAnthropic) -> FakeAnthropic:
    fake_server.reset()
    return fake_server


# The fake Chat Completions API (its own process): one per module, reset before each test.
@pytest.fixture(scope="module")
def openai_server() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as server:
        yield server


@pytest.fixture
def fake_openai(openai_server: FakeOpenAI) -> FakeOpenAI:
    openai_server.reset()
    return openai_server


@pytest.fixture
async def http_mcp_server() -> AsyncIterator[HttpMcpServer]:
    """The test MCP server (tests/mcp_server.py) over streamable HTTP, in its own process."""
    server = HttpMcpServer()
    await server.start()
    try:
        yield server
    finally:
        server.kill()
