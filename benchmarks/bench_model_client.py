"""The Anthropic model client alone: its CPU per "remember" turn, two ways of sending.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_model_client.py [--turns 300]

One process runs ``--turns`` two-round "remember" turns at once through
``AnthropicModel`` (round 1 a ``working_notes_update`` call, round 2 the text, the
history and tool result sent back as the engine does) against the fake Messages API in
a process of its own (``harness/fake_anthropic.py``, paced like the API as in
``bench_load --scenario sdk``). Two ways of sending the round's POST, turn about in one
run (``--rounds`` passes, each pass both ways, the order alternating):

- ``sdk_post``: the SDK's ``client.post`` for every request (the path before);
- ``direct``: the request built once by the SDK, sent on its aiohttp session
  (``worker.models.transport.DirectPost``, what the worker uses).

Reported: this process's CPU per turn (``time.process_time``) for each pass, the medians,
and the direct / sdk_post ratio, with ``python_loop_2m_s``. Saved as
``bench_model_client.json`` under ``--results-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import uvloop

from benchmarks.benchlib import arguments, python_speed_s, write_results
from harness.fake_anthropic import FakeAnthropicProcess
from turnbus.shared.settings import Settings
from turnbus.shared.system import resolve_system, resolve_system_blocks
from turnbus.worker.models.anthropic import AnthropicModel, sdk_client
from turnbus.worker.models.base import ModelRequest, RoundResult
from turnbus.worker.models.ratelimit import RateGate
from turnbus.worker.models.transport import DirectPost, Post, SdkPost
from turnbus.worker.tools import NOTES_TOOL_SPECS

TOOLS = list(NOTES_TOOL_SPECS)  # what the engine offers every round


def _request(messages: list[dict[str, Any]]) -> ModelRequest:
    return ModelRequest(
        system_blocks=resolve_system_blocks(None, None, None),
        system=resolve_system(None, None, None),
        messages=messages,
        tools=TOOLS,
    )


async def _turn(model: AnthropicModel, i: int) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"remember the finding number {i} of this run"}
    ]
    for _ in range(2):
        result: RoundResult | None = None
        async for item in model.stream_round(_request(messages)):
            if isinstance(item, RoundResult):
                result = item
        assert result is not None
        if not result.tool_uses:
            return
        messages = [
            *messages,
            {"role": "assistant", "content": result.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": t.id, "content": "updated (40 bytes)"}
                    for t in result.tool_uses
                ],
            },
        ]
    raise AssertionError("the turn did not end in two rounds")


async def _pass(fake: FakeAnthropicProcess, way: str, turns: int) -> float:
    """CPU ms per turn of ``turns`` turns at once on a fresh client (warmed up first)."""
    client = sdk_client(api_key=fake.api_key, base_url=fake.url)
    model = AnthropicModel(Settings(), client=client, gate=RateGate())
    post: Post | None = (
        SdkPost(client, "/v1/messages")
        if way == "sdk_post"
        else await DirectPost.build(client, "/v1/messages")
    )
    assert post is not None
    model._post = post
    try:
        await asyncio.gather(*(_turn(model, i) for i in range(10)))  # connections, imports
        cpu = time.process_time()
        await asyncio.gather(*(_turn(model, i) for i in range(turns)))
        return (time.process_time() - cpu) * 1000 / turns
    finally:
        await client.close()


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"sdk_post": [], "direct": []}
    with FakeAnthropicProcess(responder="remember", ttft_s=0.5, tokens_per_s=50) as fake:
        for r in range(args.rounds):
            order = ("sdk_post", "direct") if r % 2 == 0 else ("direct", "sdk_post")
            for way in order:
                ms = uvloop.run(_pass(fake, way, args.turns))
                runs[way].append(round(ms, 3))
                print(f"pass {r + 1}: {way:8} {ms:.3f} ms CPU per turn", flush=True)
    medians = {way: statistics.median(values) for way, values in runs.items()}
    ratio = medians["direct"] / medians["sdk_post"]
    print(
        f"median CPU ms per turn: sdk_post {medians['sdk_post']:.3f}, direct "
        f"{medians['direct']:.3f} ({ratio:.2f}x); python_loop_2m_s {python_speed_s()}"
    )
    figures = {
        "turns_at_once": args.turns,
        "profile": {"ttft_s": 0.5, "tokens_per_s": 50, "rounds": 2},
        "cpu_ms_per_turn_runs": runs,
        "cpu_ms_per_turn_median": medians,
        "direct_to_sdk_post": round(ratio, 3),
    }
    print(f"wrote {write_results('bench_model_client', figures, args.results_dir)}")


if __name__ == "__main__":
    main()
