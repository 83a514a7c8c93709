"""The suite. Its folders mirror the package (shared, gateway, worker, client, cli) and
``e2e`` holds whole-stack cases; the harness (Redis servers and containers, a live
gateway, a worker kit, the fake Messages API, a fault proxy) stands here at the top."""

from pathlib import Path

# The checkout's root, for tests that read its files (README, docs, compose.yaml, ...).
ROOT = Path(__file__).resolve().parent.parent
