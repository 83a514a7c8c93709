"""``turnbus chat``: a reused session shows its last exchanges before the prompt."""

from __future__ import annotations

import asyncio
import io

import pytest
from gateway.auth import mint_token
from turnbus import AsyncClient
from turnbus.chat import Chat, exchanges
from worker.models.scripted import ScriptedModel

from shared.settings import Settings
from tests.gateway_server import LiveGateway
from tests.worker_kit import running_worker

pytestmark = pytest.mark.timeout(60)


def test_exchanges_pair_prompts_with_the_replies_text() -> None:
    rows = [
        {"role": "user", "content": [{"type": "text", "text": "one"}], "kind": "prompt"},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                          {"type": "tool_use", "id": "x", "name": "n", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "ok"}],
         "kind": "tool_results"},
        {"role": "assistant", "content": [{"type": "text", "text": " done"}]},
        {"role": "user", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "a plain reply"},
    ]  # fmt: skip
    assert exchanges(rows, 5) == [("one", "calling done"), ("two", ""), ("three", "a plain reply")]
    assert exchanges(rows, 2) == [("two", ""), ("three", "a plain reply")]
    assert exchanges(rows, 0) == []


async def test_chat_on_a_reused_session_shows_its_last_exchanges_first(
    gw: LiveGateway, settings: Settings
) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "alice")
    async with running_worker(settings, ScriptedModel(settings)):
        async with AsyncClient(gw.base_url, token) as tb:
            session = (await tb.create_session()).sessionId
            for message in ("hello there", "remember the build is green", "and one more"):
                events = [e async for e in await tb.run_turn(session, message)]
                assert events, message

        def chat() -> str:
            out = io.StringIO()
            session_chat = Chat(gw.base_url, token, out=out)
            try:
                session_chat.open_session(session)
                session_chat.show_history(2)
                session_chat.repl(io.StringIO("/notes\n/quit\n"))
            finally:
                session_chat.close()
            return out.getvalue()

        text = await asyncio.to_thread(chat)
    history, _, rest = text.partition("---\nsession ")
    assert "--- the last 2 exchanges of this session; 1 earlier not shown ---" in history
    assert "[you]   hello there" not in history
    assert history.index("[you]   remember the build is green") < history.index(
        "[you]   and one more"
    )
    assert "[agent] " in history
    assert "you> " not in history, "the history comes before the first prompt"
    assert "- the build is green" in rest
