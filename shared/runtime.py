"""Process settings for the long-running services (the gateway and the workers).

Python's cyclic garbage collector runs a young-generation pass every 700 allocations
and, every so often, a full pass over every live object. A gateway holding thousands
of connections, or a worker running hundreds of turns, keeps hundreds of thousands of
live objects, so the full passes grow with the load: at 3,000 open connections they
were half of the gateway's CPU per request. :func:`tune_gc` moves what startup
created (modules, the app) out of the collector's sight and makes its passes rarer;
almost everything a request or a turn allocates is freed by reference counting, and
the rarer passes still collect the cycles the rest leaves.

A worker's young generation fills with the live state of its running turns (100-150
tracked objects each), so at 50,000 a burst of a few hundred resumed turns ran one or
two young passes over objects that were all alive (7-30 ms each, the worker's loop
stopped meanwhile). :data:`WORKER_GC_THRESHOLDS` sits above what a full worker holds
(1,024 turns): a pass comes once what the worker keeps (its caches) has grown by that
much, longer (about 50 ms) but many bursts apart. A turn's path leaves no cycles (a
full collection after 500 resumed turns found none), so the memory held is the same.
"""

from __future__ import annotations

import gc

__all__ = ["GC_THRESHOLDS", "WORKER_GC_THRESHOLDS", "tune_gc"]

# Young-generation pass every 50,000 net allocations (Python's default: 700); the
# older generations keep their default ratios.
GC_THRESHOLDS = (50_000, 10, 10)
# The worker's: a young pass every 200,000 net allocations.
WORKER_GC_THRESHOLDS = (200_000, 10, 10)


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Call once startup is done, before serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
