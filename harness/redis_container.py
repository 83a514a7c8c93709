"""The test session's Redis as a testcontainers container, when a Docker engine answers.

The image: ``TURNBUS_REDIS_IMAGE`` when set; else the official ``redis:7`` when present or
pullable; else ``turnbus-local/redis:7``, which ``docker/build-base-images.sh`` builds from
Debian's packages where no registry answers.

Testcontainers' reaper (Ryuk) is off: its image cannot be pulled without a registry. So
the harness removes its own containers: each carries labels naming this host and the
pytest process; the session's container is removed when the session ends, failed tests
or not, and one left by a run that was killed (its process gone) is removed when the
next session starts. Containers of other test runs still alive are never touched.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

OFFICIAL_IMAGE = "redis:7"
LOCAL_IMAGE = "turnbus-local/redis:7"
LABEL = "org.turnbus.test-redis"
_LABEL_HOST = LABEL + ".host"
_LABEL_PID = LABEL + ".pid"


def docker_answers() -> bool:
    """Whether a Docker engine answers a ping (within 2 s)."""
    if not os.environ.get("DOCKER_HOST"):
        # A stale socket file with no engine behind it: the docker client would leak
        # its half-open socket while failing, so ask the socket itself first.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(2)
            try:
                probe.connect("/var/run/docker.sock")
            except OSError:
                return False
    try:
        import docker
    except ImportError:
        return False
    client = None
    try:
        client = docker.from_env(timeout=2)
        client.ping()
        return True
    except Exception:
        return False
    finally:
        if client is not None:
            client.close()


def pick_image(client: Any, official: str, stand_in: str) -> str:
    """``official`` when present or pullable, else ``stand_in`` when present."""
    import docker

    for present in (client.images.get, client.images.pull):
        try:
            present(official)
            return official
        except docker.errors.APIError:  # ImageNotFound is one
            pass
    try:
        client.images.get(stand_in)
    except docker.errors.ImageNotFound:
        raise RuntimeError(
            f"{official} cannot be pulled and {stand_in} is missing: "
            "run docker/build-base-images.sh"
        ) from None
    return stand_in


def redis_image(client: Any) -> str:
    """The Redis image to run (see the module's docstring)."""
    return os.environ.get("TURNBUS_REDIS_IMAGE") or pick_image(client, OFFICIAL_IMAGE, LOCAL_IMAGE)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(client: Any) -> int:
    """Remove this host's harness containers whose pytest process is gone; returns how many."""
    import docker

    removed = 0
    # Sparse: the list's own answer, labels included; inspecting each container would
    # race with another test process removing it (pytest-xdist's workers start at once).
    for container in client.containers.list(all=True, filters={"label": LABEL}, sparse=True):
        labels = container.attrs.get("Labels") or {}
        if labels.get(_LABEL_HOST) != socket.gethostname():
            continue
        pid = labels.get(_LABEL_PID, "")
        if pid.isdigit() and _pid_alive(int(pid)):
            continue
        try:
            container.remove(force=True, v=True)
        except docker.errors.APIError as exc:
            # Another test process (pytest-xdist's workers start at once) removes it
            # already, or has: gone is what was wanted.
            if exc.status_code not in (404, 409):
                raise
            continue
        removed += 1
    return removed


@contextlib.contextmanager
def redis_container() -> Iterator[str]:
    """A Redis container on a published loopback port; yields its URL, removes it after."""
    # Read by testcontainers when it is imported.
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.community.redis import RedisContainer

    import docker

    client = docker.from_env()
    try:
        remove_orphans(client)
        image = redis_image(client)
    finally:
        client.close()
    labels = {LABEL: "1", _LABEL_HOST: socket.gethostname(), _LABEL_PID: str(os.getpid())}
    container = RedisContainer(image).with_kwargs(labels=labels)
    with container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}/0"
