"""A dead transport is a lost connection on every kind of link, on uvloop as the
services run (:mod:`turnbus.shared.transport`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from harness.fault_proxy import fault_proxy
from turnbus.shared.connect import connect, own_link
from turnbus.shared.settings import Settings
from turnbus.shared.transport import lost_link_error


def test_what_a_closed_uvloop_transport_raises_is_a_lost_connection() -> None:
    closed = RuntimeError(
        "unable to perform operation on <TCPTransport closed=True reading=False 0x1>; "
        "the handler is closed"
    )
    lost = lost_link_error(closed)
    assert isinstance(lost, RedisConnectionError)
    assert "the handler is closed" in str(lost)
    assert lost_link_error(RuntimeError("Event loop stopped before Future completed")) is None
    assert lost_link_error(ValueError("closed=True")) is None


def test_every_link_kind_fails_with_connection_error_after_a_reset_then_reconnects(
    settings: Settings,
) -> None:
    uvloop.run(_every_link_kind(settings))


async def _every_link_kind(settings: Settings) -> None:
    async with fault_proxy(settings.redis_url) as proxy:
        client = connect(Settings(redis_url=proxy.url, prefix=settings.prefix), "worker")
        stream = f"{settings.prefix}:stream"
        await client.xgroup_create(stream, "g", mkstream=True)
        pubsub = client.pubsub()
        await pubsub.subscribe(f"{settings.prefix}:channel")

        async def blocking_read() -> object:
            return await client.xreadgroup("g", "c", {stream: ">"}, count=1, block=10)

        async def write_and_wait() -> object:
            link = own_link(client)
            try:
                await link.set(f"{settings.prefix}:k", "v")
                return await link.wait(0, 10)
            finally:
                await link.aclose()

        async def listen() -> object:
            return await pubsub.get_message(timeout=0.05)

        async def multiplexed() -> object:
            return await client.get(f"{settings.prefix}:k")

        # The multiplexed link first: once it has heard of the reset (its use fails,
        # or connects again), the event loop has seen every link's transport die.
        kinds: list[Callable[[], Awaitable[object]]] = [
            multiplexed,
            blocking_read,
            write_and_wait,
            listen,
        ]
        try:
            for kind in kinds:
                await kind()  # connected, then idle in its pool
            await proxy.reset()
            for kind in kinds:
                # The first use finds its transport dead: a ConnectionError (the mux
                # has heard of the loss already and connects again at once) ...
                try:
                    await kind()
                except RedisConnectionError:
                    pass
                except Exception as exc:  # the defect: any other error
                    pytest.fail(f"{kind.__name__}: {type(exc).__name__}: {exc}")
                await kind()  # ... and the next connects again
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await client.aclose()
