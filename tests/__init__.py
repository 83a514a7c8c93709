"""The suite. Its folders mirror the package (shared, gateway, worker, client, cli) and
``e2e`` holds whole-stack cases; the suite's own kits (a live gateway, a worker kit, an
MCP server) stand here at the top. What the benchmarks use too (Redis servers and
containers, a local cluster, the fake model APIs, a fault proxy) is in ``harness/``."""

from pathlib import Path

# The checkout's root, for tests that read its files (README, docs, compose.yaml, ...).
ROOT = Path(__file__).resolve().parent.parent
