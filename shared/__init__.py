"""Code shared by the gateway and the worker: caps, keys, schemas, the envelope store."""

# First: the redis-py internals the clients use are there (a clear error naming the one
# missing, before shared.mux's own imports would fail on it or misread replies).
from shared import redispy as _redispy  # noqa: F401
