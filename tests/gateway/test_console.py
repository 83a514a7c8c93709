"""The web console at ``/console``: served by the gateway, driven in a real Chromium.

The browser tests use Debian's ``chromium`` through Playwright (``executable_path``;
Playwright's own browser download is never used). Without chromium they skip with the
reason, except in CI (``CI=true``), where a missing browser is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest
import redis.asyncio as aioredis
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import async_playwright, expect

from harness.redis_server import free_port, private_redis_server, redis_binary
from tests.gateway_server import LiveGateway, live_gateway, signed_in
from tests.turn_kit import append_events, end_turn
from tests.worker.test_approvals import registry as approval_tools
from tests.worker.test_pipeline import sample_registry
from tests.worker_kit import running_worker
from turnbus.gateway.auth import mint_token
from turnbus.gateway.console_page import CONSOLE_DIR
from turnbus.redis_local import PrivateRedis
from turnbus.shared.events import (
    Event,
    RoundStarted,
    RoundWaiting,
    TextDelta,
    ToolCall,
    ToolResult,
    TurnRequiresAction,
    TurnStarted,
    Usage,
)
from turnbus.shared.keys import Keys
from turnbus.shared.records import PendingCall
from turnbus.shared.settings import Settings
from turnbus.shared.turns import TurnStore
from turnbus.worker.models.scripted import ScriptedModel
from turnbus.worker.tools import redact_notes

CHROMIUM = os.environ.get("TURNBUS_TEST_CHROMIUM", "/usr/bin/chromium")
# Opt-in: where the notes test saves its screenshot of the console (docs/console.png).
SCREENSHOT_ENV = "TURNBUS_TEST_SCREENSHOT"
WAIT_MS = 30_000
USER = "alice"
SESSIONS_PAGE = 20  # the console's page of the sessions list (console.js)


def _token(settings: Settings) -> str:
    assert settings.jwt_secret
    return mint_token(settings.jwt_secret, USER, 3600)


# ---------------------------------------------------------------- served files


async def test_console_is_served_same_origin_without_a_token(http: httpx.AsyncClient) -> None:
    bare = httpx.AsyncClient(base_url=str(http.base_url), timeout=10)
    async with bare:
        page = await bare.get("/console")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert '<script src="/console/console.js"' in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert page.headers["referrer-policy"] == "no-referrer"
        assert "access-control-allow-origin" not in page.headers

        script = await bare.get("/console/console.js")
        assert script.status_code == 200
        assert script.headers["content-type"].startswith("text/javascript")
        statuses = await bare.get("/console/statuses.js")
        assert statuses.status_code == 200
        assert statuses.headers["content-type"].startswith("text/javascript")
        assert page.text.index("/console/statuses.js") < page.text.index("/console/console.js")
        style = await bare.get("/console/console.css")
        assert style.status_code == 200
        assert style.headers["content-type"].startswith("text/css")
        icon = await bare.get("/console/favicon.svg")
        assert icon.status_code == 200
        assert icon.headers["content-type"].startswith("image/svg+xml")
        assert '<link rel="icon" href="/console/favicon.svg"' in page.text

        missing = await bare.get("/console/secrets.txt")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        escape = await bare.get("/console/..%2Fapp.py")
        assert escape.status_code == 404


def test_console_script_never_writes_html() -> None:
    """Model and user text reach the page through textContent only."""
    source = (CONSOLE_DIR / "console.js").read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in source, sink


# ---------------------------------------------------------------- browser harness


def _chromium() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    found = shutil.which("chromium")
    if found:
        return found
    reason = f"chromium is not installed ({CHROMIUM}); `apt-get install chromium`"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + ": CI must run the browser tests")
    pytest.skip(reason)


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    executable = _chromium()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=executable)
        try:
            yield launched
        finally:
            await launched.close()


class ConsolePage:
    """A console tab, with the uncaught page errors it raised."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.console: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        page.on("console", lambda msg: self.console.append(f"{msg.type}: {msg.text}"))
        page.on("dialog", lambda dialog: dialog.accept())
        page.set_default_timeout(WAIT_MS)

    async def open(self, base_url: str, token: str) -> None:
        await self.page.goto(f"{base_url}/console#token={token}")
        await self.page.wait_for_selector("#app:not([hidden])")

    async def new_session(self, title: str) -> str:
        before = await self.page.locator("#session-list li").count()
        shown = self.page.locator("#session-id")
        previous = await shown.text_content()
        await self.page.fill("#new-title", title)
        await self.page.click("#new-session button")
        # The page's own CSP forbids string evaluation, so waits use locators only.
        await self.page.locator("#session-list li").nth(before).wait_for()
        await expect(shown).not_to_have_text(previous or "")
        await expect(shown).to_have_text(re.compile(r"^s_"))
        return str(await shown.text_content())

    async def send(self, message: str) -> Any:
        """Send a turn; returns the locator of its view once the page shows it."""
        count = await self.page.locator(".turn").count()
        await self.page.fill("#message", message)
        await self.page.click("#send")
        turn = self.page.locator(".turn").nth(count)
        await turn.wait_for()
        return turn

    async def wait_status(self, turn: Any, status: str) -> None:
        await turn.and_(self.page.locator(f'[data-status="{status}"]')).wait_for()

    async def listed(self) -> list[str]:
        """The session ids of the list, top to bottom."""
        ids: list[str] = await self.page.locator("#session-list li").evaluate_all(
            "items => items.map(i => i.dataset.sessionId)"
        )
        return ids

    async def event_ids(self, turn: Any) -> list[str]:
        ids: list[str] = await turn.locator(".event-log li[data-event-id]").evaluate_all(
            "items => items.map(i => i.dataset.eventId)"
        )
        return ids


@contextlib.asynccontextmanager
async def console_tab(browser: Any, base_url: str, token: str) -> AsyncIterator[ConsolePage]:
    context = await browser.new_context(
        viewport={"width": 1440, "height": 900},
        permissions=["clipboard-read", "clipboard-write"],
    )
    try:
        tab = ConsolePage(await context.new_page())
        await tab.open(base_url, token)
        yield tab
        assert tab.errors == [], tab.errors
    finally:
        await context.close()


async def _stream_ids(redis: aioredis.Redis, keys: Keys, session: str, turn_id: str) -> list[str]:
    entries = await redis.xrange(keys.turn_events(USER, session, turn_id))
    return [entry_id for entry_id, _ in entries]


async def _shown_markdown(turn: Any) -> str:
    """The reply's text as the page holds it, before Markdown rendering."""
    texts: list[str] = await turn.locator(".reply .text").evaluate_all(
        "items => items.map(i => i.dataset.markdown)"
    )
    return "".join(texts)


async def _stream_texts(redis: aioredis.Redis, keys: Keys, session: str, turn_id: str) -> str:
    entries = await redis.xrange(keys.turn_events(USER, session, turn_id))
    events = [json.loads(fields["data"]) for _, fields in entries]
    return "".join(e["text"] for e in events if e["type"] == "text.delta")


def _slow(settings: Settings, *, delay_ms: int, rounds: int) -> Settings:
    return dataclasses.replace(settings, scripted_delay_ms=delay_ms, scripted_rounds=rounds)


# ---------------------------------------------------------------- browser tests


@pytest.mark.browser
async def test_the_root_url_in_a_browser_lands_on_the_console(
    browser: Any, gw: LiveGateway, settings: Settings
) -> None:
    context = await browser.new_context()
    try:
        tab = ConsolePage(await context.new_page())
        # The URL `make run` prints first, with the token as the console link carries it.
        await tab.page.goto(f"{gw.base_url}/#token={_token(settings)}")
        await tab.page.wait_for_selector("#app:not([hidden])")
        assert urlsplit(tab.page.url).path == "/console"
        assert tab.errors == []
    finally:
        await context.close()


@pytest.mark.browser
async def test_error_texts_show_quoted_names_as_code_not_backticks(
    browser: Any, gw: LiveGateway
) -> None:
    context = await browser.new_context()
    try:
        tab = ConsolePage(await context.new_page())
        await tab.page.goto(f"{gw.base_url}/console")
        await tab.page.fill("#token-input", "not-a-jwt")
        await tab.page.click("#token-form button")
        error = tab.page.locator("#token-error")
        await expect(error).to_have_text("That is not a JWT with a sub claim.")
        await expect(error.locator("code")).to_have_text("sub")
        assert "`" not in str(await error.text_content())
        assert tab.errors == []
    finally:
        await context.close()


async def _in_view(page: Any, selector: str) -> bool:
    """Whether ``selector`` is inside the window as it is, without any scrolling."""
    box = await page.locator(selector).bounding_box()
    size = page.viewport_size
    assert box is not None and size is not None
    return bool(
        box["y"] >= 0
        and box["y"] + box["height"] <= size["height"]
        and box["x"] >= 0
        and box["x"] + box["width"] <= size["width"]
    )


@pytest.mark.browser
@pytest.mark.parametrize("width", [390, 900])
async def test_a_narrow_window_shows_the_composer_first_and_the_sessions_in_a_drawer(
    browser: Any, gw: LiveGateway, settings: Settings, http: httpx.AsyncClient, width: int
) -> None:
    for i in range(30):  # enough rows to fill a screen, as in a used console
        await http.post("/v1/sessions", json={"meta": {"title": f"session {i}"}})
    height = 844 if width == 390 else 700
    context = await browser.new_context(viewport={"width": width, "height": height})
    try:
        tab = ConsolePage(await context.new_page())
        await tab.open(gw.base_url, _token(settings))
        page = tab.page
        await expect(page.locator("#session-id")).to_have_text(re.compile(r"^s_"))
        for part in ("#message", "#send", "#transcript"):
            assert await _in_view(page, part), part
        assert await page.evaluate(
            "() => [window.scrollY, document.scrollingElement.scrollTop]"
        ) == [0, 0]
        # The sessions are behind the button, not on the page.
        await expect(page.locator("#session-list")).not_to_be_visible()
        await page.click("#sessions-toggle")
        rows = page.locator("#session-list li")
        await expect(rows.first).to_be_visible()
        await expect(rows.first).to_be_in_viewport(ratio=1)
        assert await page.get_attribute("#sessions-toggle", "aria-expanded") == "true"
        # Picking a session closes the drawer, back to its conversation.
        await rows.nth(3).locator(".open").click()
        await expect(page.locator("#session-list")).not_to_be_visible()
        await expect(page.locator("#session-title")).to_have_text("session 26")
        assert await _in_view(page, "#message")
        assert tab.errors == [], tab.errors
    finally:
        await context.close()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_each_tool_call_shows_its_input_result_duration_and_error_state(
    browser: Any, gw: LiveGateway, settings: Settings
) -> None:
    message = 'call lookup {"term": "lease"}\ncall boom {"reason": "ticket 7 is gone"}'
    async with (
        running_worker(settings, ScriptedModel(settings), name="console", tools=sample_registry()),
        console_tab(browser, gw.base_url, _token(settings)) as tab,
    ):
        await tab.new_session("Tools")
        turn = await tab.send(message)
        await tab.wait_status(turn, "completed")
        tools = turn.locator(".tool")
        assert await tools.count() == 2
        lookup, boom = tools.nth(0), tools.nth(1)
        assert await lookup.locator(".tool-name").text_content() == "lookup"
        assert '"term": "lease"' in str(await lookup.locator(".tool-input").text_content())
        assert "lease: found" in str(await lookup.locator(".tool-result pre").text_content())
        tag = str(await lookup.locator(".tool-result .tool-tag").text_content())
        assert re.fullmatch(r"result · \d+ ms", tag), tag
        assert "failed" not in str(await lookup.get_attribute("class"))
        assert "failed" in str(await boom.get_attribute("class"))
        tag = str(await boom.locator(".tool-result .tool-tag").text_content())
        assert re.fullmatch(r"result \(error\) · \d+ ms", tag), tag
        shown = str(await boom.locator(".tool-result pre").text_content())
        assert "ValueError: ticket 7 is gone" in shown


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_turn_streams_to_its_end_and_the_notes_panel_follows(
    browser: Any,
    gw: LiveGateway,
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    http: httpx.AsyncClient,
) -> None:
    # A session made elsewhere (curl, a client) is in the list too.
    made = await http.post("/v1/sessions", json={"meta": {"title": "Retry policy"}})
    async with (
        running_worker(settings, ScriptedModel(settings), name="console"),
        console_tab(browser, gw.base_url, _token(settings)) as tab,
    ):
        page = tab.page
        await expect(page.locator("#session-id")).to_have_text(made.json()["sessionId"])
        # The token came from the fragment, which is gone from the address bar.
        assert "#" not in page.url and "token" not in page.url
        assert await page.text_content("#whoami") is not None
        assert USER in str(await page.text_content("#whoami"))

        # Titles are text, never markup.
        hostile = "<img src=x onerror=alert(1)>"
        doomed = await tab.new_session(hostile)
        title = page.locator(f'#session-list li[data-session-id="{doomed}"] .title')
        assert await title.text_content() == hostile
        assert await page.locator("#session-list img").count() == 0
        # Delete it from the list: gone from the page and from the server.
        await page.click(f'#session-list li[data-session-id="{doomed}"] .delete')
        await page.locator(f'#session-list li[data-session-id="{doomed}"]').wait_for(
            state="detached"
        )
        assert (await http.get(f"/v1/sessions/{doomed}")).status_code == 404

        session = await tab.new_session("Choosing a queue")
        assert await page.locator("#notes-bytes").get_attribute("data-bytes") == "0"

        # The model echoes Markdown and markup: the Markdown is rendered, the markup is text.
        hostile_md = "**Redis Streams** for the `turn queue` <img src=x onerror=alert(1)>"
        turn = await tab.send(f"remember that we chose {hostile_md}")
        await tab.wait_status(turn, "completed")
        turn_id = await turn.get_attribute("data-turn-id")
        assert turn_id

        # The reply as streamed is the reply the worker wrote, and the tool call shows apart.
        assert await _shown_markdown(turn) == await _stream_texts(redis, keys, session, turn_id)
        reply = "".join(await turn.locator(".reply .text").all_text_contents())
        assert "Noted: that we chose Redis Streams for the turn queue <img src=x onerror" in reply
        assert await turn.locator(".reply .text strong").all_text_contents() == ["Redis Streams"]
        assert await turn.locator(".reply .text code").all_text_contents() == ["turn queue"]
        assert await page.locator("#transcript img, #notes-text img").count() == 0
        tool = turn.locator(".tool")
        assert await tool.count() == 1
        assert await tool.locator(".tool-name").text_content() == "working_notes_update"
        assert await tool.locator(".tool-result").count() == 1
        assert await tab.event_ids(turn) == await _stream_ids(redis, keys, session, turn_id)

        # The notes panel shows what the server holds, and its size of 32 KiB.
        notes = (await http.get(f"/v1/sessions/{session}/notes")).json()
        assert "Redis Streams" in notes["notes"]
        await page.locator("#notes-text").filter(has_text="Redis Streams").wait_for()
        assert await page.text_content("#notes-text") == notes["notes"]
        assert await page.get_attribute("#notes-bytes", "data-bytes") == str(notes["bytes"])
        assert "of 32,768 B" in str(await page.text_content("#notes-bytes"))

        # The notes box says what the tool did, in words, and leads to the notes panel.
        updated = f"updated the working notes ({notes['bytes']} B)"
        assert await tool.locator(".notes-action").text_content() == updated
        assert "sha256" not in str(await page.text_content("#transcript"))
        await tool.locator(".notes-link").click()
        await page.locator("#notes-panel.flash").wait_for()

        # Each round shows its latency and tokens; an event's raw JSON opens on click.
        stats = await turn.locator(".round-stats").all_text_contents()
        assert len(stats) == 2, stats
        for n, line in enumerate(stats, 1):
            assert re.fullmatch(rf"round {n} · \d+\.\d+ s · \d+ in · \d+ out tokens", line), line
        await turn.locator(".event-log > summary").click()
        await turn.locator('.event-log li[data-type="turn.queued"] summary').click()
        raw = json.loads(str(await turn.locator(".event-json").text_content()))
        assert raw["type"] == "turn.queued" and raw["turnId"] == turn_id

        # The copy button puts the reply's text (its Markdown) on the clipboard.
        await turn.locator(".copy").click()
        await turn.locator(".copy[data-copied]").wait_for()
        copied = await page.evaluate("navigator.clipboard.readText()")
        assert hostile_md in copied and "Noted:" in copied

        # The system prompt view shows the notes folded in.
        await page.click("#system-panel summary")
        await page.locator("#system-text").filter(has_text="Redis Streams").wait_for()
        system = (await http.get(f"/v1/sessions/{session}/system")).text
        assert await page.text_content("#system-text") == system

        # A second turn reads the notes back through a tool.
        turn2 = await tab.send("what did we conclude?")
        await tab.wait_status(turn2, "completed")
        assert await turn2.locator(".tool-name").text_content() == "working_notes_get"
        read = f"read the working notes ({notes['bytes']} B)"
        assert await turn2.locator(".notes-action").text_content() == read
        # Its answer lists the notes: a Markdown list, its markup still text.
        item = turn2.locator(".reply .text ul > li")
        assert await item.count() == 1
        assert "Redis Streams for the turn queue <img src=x" in str(await item.text_content())

        shot = os.environ.get(SCREENSHOT_ENV)
        if shot:
            await turn.locator(".event-log > summary").click()  # folded again
            await turn.locator(".copy:not([data-copied])").wait_for()  # its label is back
            await page.locator("#transcript").evaluate("t => { t.scrollTop = 0; }")
            await page.screenshot(path=shot)

        # The session log carries only the notes' size and digest: on a host's notes
        # write (envelope.patched naming workingNotes) the panel fetches the text.
        env = (await http.get(f"/v1/sessions/{session}")).json()
        put = await http.put(
            f"/v1/sessions/{session}/meta",
            json={"updatedAt": env["updatedAt"] + 1, "meta": {"workingNotes": "set by the host"}},
        )
        assert put.status_code == 200, put.text
        await page.locator("#notes-text").filter(has_text="set by the host").wait_for()

        # A reload finds the token in sessionStorage and the session in the list, with
        # history: each turn with its status, usage, rounds and events, as before.
        shown_usage = await turn.locator(".turn-usage").text_content()
        await page.reload()
        await page.wait_for_selector("#app:not([hidden])")
        await page.locator(f'#session-list li[data-session-id="{session}"]').wait_for()
        past = page.locator(f'.turn.past[data-turn-id="{turn_id}"][data-events-loaded="true"]')
        await past.wait_for()
        assert await past.get_attribute("data-status") == "completed"
        assert await past.locator(".turn-status").text_content() == "completed"
        assert await past.locator(".turn-usage").text_content() == shown_usage
        assert await past.locator(".bubble.user").text_content() == (
            f"remember that we chose {hostile_md}"
        )
        assert await past.locator(".reply .text strong").all_text_contents() == ["Redis Streams"]
        assert await past.locator(".notes-action").text_content() == updated
        assert await past.locator(".round-stats").all_text_contents() == stats
        assert await tab.event_ids(past) == await _stream_ids(redis, keys, session, turn_id)
        turn2_id = await turn2.get_attribute("data-turn-id")
        past2 = page.locator(f'.turn.past[data-turn-id="{turn2_id}"]')
        assert await past2.locator(".notes-action").text_content() == read

        assert await page.locator("#transcript img").count() == 0
        assert not [m for m in tab.console if m.startswith("error")], tab.console


@pytest.mark.browser
@pytest.mark.timeout(90)
async def test_the_session_list_is_the_users_sessions_on_the_server(
    browser: Any, gw: LiveGateway, settings: Settings, http: httpx.AsyncClient
) -> None:
    """The list is ``GET /v1/sessions``: sessions made through the API show, newest first,
    a page at a time; another browser signed in as the same user shows the same list;
    another user's sessions never show."""
    async with signed_in(gw, settings, user="bob") as bob:
        created = await bob.post("/v1/sessions", json={"meta": {"title": "bob's plans"}})
        theirs = created.json()["sessionId"]
    made = []
    for n in range(SESSIONS_PAGE + 1):  # one more than a page; the oldest has no title
        body = {"meta": {"title": f"made through the API {n}"}} if n else {}
        made.append((await http.post("/v1/sessions", json=body)).json()["sessionId"])
    noted, busy = made[-2], made[-3]
    notes = "- the list is the server's"
    await gw.gateway.envelopes.worker_overlay(USER, noted, {"workingNotes": notes})
    queued = await http.post(f"/v1/sessions/{busy}/turns", json={"message": "no worker runs"})
    assert queued.status_code == 202, queued.text
    rows = (await http.get("/v1/sessions", params={"limit": 100})).json()["sessions"]
    order = [row["sessionId"] for row in rows]
    assert sorted(order) == sorted(made)

    async with console_tab(browser, gw.base_url, _token(settings)) as first:
        page = first.page
        await expect(page.locator("#session-list li")).to_have_count(SESSIONS_PAGE)
        assert await first.listed() == order[:SESSIONS_PAGE]
        await expect(page.locator("#session-id")).to_have_text(order[0])  # the newest opens
        row = page.locator(f'#session-list li[data-session-id="{busy}"]')
        await expect(row.locator(".active-turn")).to_have_text("● queued")
        assert await row.locator(".active-turn").get_attribute("title") == (
            f"turn {queued.json()['turnId']}"
        )
        times = str(await row.locator(".times").text_content())
        assert re.fullmatch(r"created \S.* · updated \S.*", times), times
        size = page.locator(f'#session-list li[data-session-id="{noted}"] .notes-size')
        assert await size.text_content() == f"notes {len(notes)} B"
        assert await row.locator(".notes-size").text_content() == "no notes"

        # The oldest is on the next page: opened by id meanwhile, then listed by "more".
        await page.fill("#open-id", made[0])
        await page.click("#open-session button")
        await expect(page.locator("#session-id")).to_have_text(made[0])
        await page.click("#sessions-more")
        await expect(page.locator("#session-list li")).to_have_count(len(made))
        await expect(page.locator("#sessions-more")).to_be_hidden()
        assert await first.listed() == order
        oldest = page.locator(f'#session-list li[data-session-id="{made[0]}"]')
        # No title and no message yet: it says so, and its id is on hover.
        assert await oldest.locator(".title").text_content() == "new session · no message yet"
        assert await oldest.locator("button").first.get_attribute("title") == made[0]
        assert "active" in str(await oldest.get_attribute("class"))

        # Another browser, the same user: the same sessions. One made there comes in at the
        # top, above every row it had.
        async with console_tab(browser, gw.base_url, _token(settings)) as second:
            await expect(second.page.locator("#session-list li")).to_have_count(SESSIONS_PAGE)
            assert await second.listed() == order[:SESSIONS_PAGE]
            fresh = await second.new_session("made in another browser")
            assert await second.listed() == [fresh, *order[:SESSIONS_PAGE]]
            assert await second.page.locator("#sessions-more").is_visible()

        await page.reload()
        await expect(page.locator("#session-id")).to_have_text(made[0])  # this tab's again
        await expect(page.locator("#session-list li").first).to_have_attribute(
            "data-session-id", fresh
        )
        assert await first.listed() == [fresh, *order[: SESSIONS_PAGE - 1]]

        # Another user's session: in no list, and not opened by its id either.
        await page.fill("#open-id", theirs)
        await page.click("#open-session button")
        await expect(page.locator("#notice")).to_contain_text("not_found")
        assert theirs not in await first.listed()
        assert "bob's plans" not in str(await page.text_content("#session-list"))


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_cancel_ends_the_running_turn(
    browser: Any, gw: LiveGateway, settings: Settings, http: httpx.AsyncClient
) -> None:
    slow = _slow(settings, delay_ms=300, rounds=40)
    async with (
        running_worker(slow, ScriptedModel(slow), name="console"),
        console_tab(browser, gw.base_url, _token(settings)) as tab,
    ):
        page = tab.page
        session = await tab.new_session("cancel me")
        first = await tab.send("take your time")
        await first.locator(".reply .text").first.wait_for()
        turn_id = await first.get_attribute("data-turn-id")

        # A reload mid-turn finds the running turn and follows it live from its start.
        await page.reload()
        await page.wait_for_selector("#app:not([hidden])")
        turn = page.locator(f'.turn[data-turn-id="{turn_id}"]')
        await turn.locator(".reply .text").first.wait_for()
        assert await turn.locator(".bubble.user").text_content() == "take your time"
        assert await page.locator(".past").filter(has_text="take your time").count() == 0
        assert await page.is_enabled("#cancel")
        # While a turn runs, Send interrupts it and Queue waits behind it.
        assert await page.is_enabled("#send")
        assert await page.is_visible("#queue")
        # Cancel while the newest round is streaming text (not between two rounds), so
        # that a round is cut short with text the history does not keep.
        await expect(turn.locator(".round").last.locator(".text")).to_have_count(1)
        await page.click("#cancel")
        await tab.wait_status(turn, "cancelled")
        record = (await http.get(f"/v1/sessions/{session}/turns/{turn_id}")).json()
        assert record["status"] == "cancelled"
        assert await page.get_attribute("#stream-state", "data-state") == "ended"
        assert await page.is_disabled("#cancel")
        assert await page.is_enabled("#send")
        streamed = await _shown_markdown(turn)
        assert streamed

        # After a reload the cancelled round's text is still there, from the turn's
        # events (the history keeps only committed rounds), marked as not kept.
        await page.reload()
        await page.wait_for_selector("#app:not([hidden])")
        past = page.locator(f'.turn[data-turn-id="{turn_id}"]')
        await past.locator('.round[data-unkept="cancelled"]').wait_for()
        assert streamed.startswith(await _shown_markdown(past)) or (
            (await _shown_markdown(past)).startswith(streamed)
        )
        note = past.locator(".unkept-note")
        await expect(note).to_have_count(1)
        await expect(note).to_contain_text("the history does not keep it")


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_send_while_a_turn_runs_interrupts_it_and_queue_waits_instead(
    browser: Any, gw: LiveGateway, settings: Settings, http: httpx.AsyncClient
) -> None:
    slow = _slow(settings, delay_ms=300, rounds=40)
    async with (
        running_worker(slow, ScriptedModel(slow), name="console"),
        console_tab(browser, gw.base_url, _token(settings)) as tab,
    ):
        page = tab.page
        session = await tab.new_session("interrupt me")
        first = await tab.send("take your time")
        await first.locator(".reply .text").first.wait_for()
        first_id = await first.get_attribute("data-turn-id")
        assert await page.is_visible("#queue")

        # Send while it runs: the first turn is cancelled, interrupted; the new one runs.
        second = await tab.send("a new question")
        second_id = await second.get_attribute("data-turn-id")
        await tab.wait_status(first, "cancelled")
        await expect(first.locator(".turn-status")).to_have_text("cancelled (interrupted)")
        assert await first.get_attribute("data-reason") == "interrupted"
        await tab.wait_status(second, "running")
        record = (await http.get(f"/v1/sessions/{session}/turns/{first_id}")).json()
        assert (record["status"], record["reason"], record["by"]) == (
            "cancelled",
            "interrupted",
            second_id,
        )

        # Queue instead: the running turn goes on; the queued one waits for it.
        await page.fill("#message", "after that")
        await page.click("#queue")
        third = page.locator(".turn").nth(2)
        await third.wait_for()
        third_id = await third.get_attribute("data-turn-id")
        record = (await http.get(f"/v1/sessions/{session}/turns/{third_id}")).json()
        assert record["multitask"] == "enqueue"
        assert (await http.get(f"/v1/sessions/{session}/turns/{second_id}")).json()[
            "status"
        ] == "running"
        await page.click("#cancel")  # the queued turn, now followed
        await tab.wait_status(third, "cancelled")
        await http.post(f"/v1/sessions/{session}/turns/{second_id}/cancel")
        await tab.wait_status(second, "cancelled")


class GatewayProcess:
    """A gateway in its own process, so that it can be killed (SIGKILL) and started again."""

    def __init__(self, settings: Settings, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TURNBUS_")}
        assert settings.jwt_secret
        self.env.update(
            TURNBUS_REDIS_URL=settings.redis_url,
            TURNBUS_PREFIX=settings.prefix,
            TURNBUS_JWT_SECRET=settings.jwt_secret,
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        code = (
            "import sys; from turnbus.gateway.server import serve; from turnbus.shared.settings import Settings; "
            "serve(Settings.from_env(), '127.0.0.1', int(sys.argv[1]))"
        )
        with self.log.open("ab") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(self.port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )

    async def ready(self) -> None:
        async with httpx.AsyncClient(timeout=2) as client:
            await _until(lambda: self._healthy(client), "the gateway to answer /healthz")

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"gateway exited: {self.log.read_text(errors='replace')}")
        try:
            return (await client.get(f"http://127.0.0.1:{self.port}/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _until(check: Callable[[], Any], what: str, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _is_turn_stream(url: str) -> bool:
    path = urlsplit(url).path
    return "/turns/" in path and path.endswith("/events")


async def _replay_from_the_start(route: Any) -> None:
    """Answer a turn stream request as if it carried no resume cursor: every event again.

    The browser adds ``Last-Event-ID`` below the interception layer, so the request is
    fetched anew without it (and without ``?after=``); a turn stream ends after its
    terminal event, so the whole answer can be fetched before it is handed over."""
    parts = urlsplit(route.request.url)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "after"])
    try:
        response = await route.fetch(
            url=urlunsplit(parts._replace(query=query)), timeout=WAIT_MS * 2
        )
    except PlaywrightError:
        await route.abort()  # the gateway is still down: the browser tries again
        return
    await route.fulfill(response=response)


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("replayed", [False, True], ids=["resumed", "replayed-from-start"])
async def test_gateway_killed_mid_turn_the_page_shows_every_event_once(
    browser: Any,
    settings: Settings,
    redis: aioredis.Redis,
    keys: Keys,
    tmp_path: Path,
    replayed: bool,
) -> None:
    """SIGKILL the gateway mid-turn, start it again on the same port: the page resumes.

    ``resumed``: the browser's own ``Last-Event-ID`` resume; the gateway sends no event
    twice. ``replayed-from-start``: the resume cursor is stripped on the way, so the
    gateway sends every event again, and the page must drop the ones it has shown."""
    slow = _slow(settings, delay_ms=60, rounds=12)
    gateway = GatewayProcess(settings, free_port(), tmp_path / "gateway.log")
    base_url = f"http://127.0.0.1:{gateway.port}"
    gateway.start()
    try:
        await gateway.ready()
        async with (
            running_worker(slow, ScriptedModel(slow), name="console"),
            console_tab(browser, base_url, _token(settings)) as tab,
        ):
            page = tab.page
            session = await tab.new_session("kill the gateway")
            turn = await tab.send("remember the gateway may die mid-turn")
            await turn.locator(".reply .text").first.wait_for()
            turn_id = str(await turn.get_attribute("data-turn-id"))
            seen_before = await tab.event_ids(turn)

            gateway.kill()
            at_kill = await _stream_ids(redis, keys, session, turn_id)
            assert seen_before == at_kill[: len(seen_before)]
            status = await redis.hget(keys.turn(USER, session, turn_id), "status")
            assert status == "running", "the gateway must die mid-turn"
            await page.locator('#stream-state[data-state="reconnecting"]').wait_for()
            # The badge names the state; the banner alone says why, and what goes on.
            banner = page.locator("#outage")
            await expect(banner).to_contain_text("connection lost")
            await expect(banner).to_contain_text("Running turns go on on the workers")

            # The turn goes on without the gateway: wait until it wrote events nobody saw.
            async def grew() -> bool:
                return len(await _stream_ids(redis, keys, session, turn_id)) > len(at_kill)

            await _until(grew, "the worker to write events while the gateway is down")

            if replayed:
                await page.route(_is_turn_stream, _replay_from_the_start)
            gateway.start()
            await gateway.ready()
            await tab.wait_status(turn, "completed")

            shown = await tab.event_ids(turn)
            written = await _stream_ids(redis, keys, session, turn_id)
            assert len(shown) == len(set(shown)), "an event was shown twice"
            assert shown == written, "the page missed or reordered events"
            duplicates = int(await turn.get_attribute("data-duplicates") or "-1")
            if replayed:
                assert duplicates >= len(seen_before), "the replay did not reach the page"
            else:
                assert duplicates == 0, "the gateway sent an event twice on resume"
            reply = "".join(await turn.locator(".reply .text").all_text_contents())
            assert reply == await _stream_texts(redis, keys, session, turn_id)
            await page.locator("#notes-text").filter(has_text="the gateway may die").wait_for()
    finally:
        gateway.stop()


@dataclasses.dataclass
class PlayedTurn:
    """A turn sent from the page with no worker to run it: the test writes its events
    as a worker writes them."""

    tab: ConsolePage
    store: TurnStore
    session: str
    turn: Any  # the locator of its view
    tid: str

    async def emit(self, *events: Event) -> None:
        for event in events:
            await append_events(self.store, USER, self.session, self.tid, event)

    async def stream_ids(self) -> list[str]:
        return await _stream_ids(self.store.redis, self.store.keys, self.session, self.tid)


async def _mark_running(store: TurnStore, session: str, tid: str, worker: str) -> None:
    """The record as a worker's start leaves it (its events are the test's to write)."""
    key = store.keys.turn(USER, session, tid)
    await store.redis.hincrby(key, "attempt", 1)
    await store.redis.hset(key, mapping={"status": "running", "worker": worker})


@pytest.fixture
def turn_player(
    browser: Any, gw: LiveGateway, settings: Settings, redis: aioredis.Redis, keys: Keys
) -> Callable[[str, str], contextlib.AbstractAsyncContextManager[PlayedTurn]]:
    """``async with turn_player(title, message) as played``: a console tab, a new session
    and a turn sent in it, started as worker ``w1``."""

    @contextlib.asynccontextmanager
    async def play(title: str, message: str) -> AsyncIterator[PlayedTurn]:
        store = TurnStore(redis, keys, settings)
        async with console_tab(browser, gw.base_url, _token(settings)) as tab:
            session = await tab.new_session(title)
            turn = await tab.send(message)
            tid = str(await turn.get_attribute("data-turn-id"))
            await _mark_running(store, session, tid, "w1")
            yield PlayedTurn(tab, store, session, turn, tid)

    return play


@pytest.mark.browser
@pytest.mark.timeout(90)
async def test_a_replayed_round_is_shown_once_with_its_attempt(
    turn_player: Callable[[str, str], Any],
) -> None:
    """A worker lost mid-round: the next attempt plays the round again (docs/worker.md).
    The turn's events are written here as the worker writes them, so the replay lands
    exactly while the page shows the first attempt's text of the round."""
    async with turn_player("a worker is lost", "remember z0 … z4") as played:
        tab, page, store, emit = played.tab, played.tab.page, played.store, played.emit
        session, turn, tid = played.session, played.turn, played.tid
        t0 = 1_800_000_000_000
        notes = "- z0 z1 z2 z3 z4"
        saving = "Saving that ([docs](https://example.com/notes), [not](javascript:alert(1)))."
        await emit(
            TurnStarted(turnId=tid, attempt=1, worker="w1", at=t0),
            RoundStarted(turnId=tid, round=1, at=t0),
            TextDelta(turnId=tid, round=1, text=saving),
            ToolCall(
                turnId=tid,
                round=1,
                callId="c1",
                name="working_notes_update",
                input={"notes": redact_notes(notes)},
            ),
            ToolResult(
                turnId=tid, round=1, callId="c1", name="working_notes_update", output="updated"
            ),
            Usage(turnId=tid, inputTokens=100, outputTokens=10),
            RoundStarted(turnId=tid, round=2, at=t0 + 1500),
            # Markup split across deltas is still only text.
            TextDelta(turnId=tid, round=2, text="Noted: **z0** z1 <img src=x "),
            TextDelta(turnId=tid, round=2, text="onerror=alert(1)>"),
        )
        round2 = turn.locator('.round[data-round="2"]')
        await round2.locator(".text").filter(has_text="onerror").wait_for()

        # The worker is lost; attempt 2 plays round 2 again, further this time.
        await _mark_running(store, session, tid, "w2")
        await emit(
            TurnStarted(turnId=tid, attempt=2, worker="w2", at=t0 + 9000),
            RoundStarted(turnId=tid, round=2, at=t0 + 9000),
            TextDelta(turnId=tid, round=2, text="Noted: **z0** z1 <img src=x "),
            TextDelta(turnId=tid, round=2, text="onerror=alert(1)> z2 z3 z4."),
            Usage(turnId=tid, inputTokens=250, outputTokens=30),
        )
        await end_turn(store, USER, session, tid, "completed", at=t0 + 9800)
        await tab.wait_status(turn, "completed")

        # Round 1 stays; round 2's text is the replay's, shown once, after the attempt's line.
        replay = "Noted: **z0** z1 <img src=x onerror=alert(1)> z2 z3 z4."
        assert await turn.locator(".round").count() == 2
        assert await _shown_markdown(turn) == saving + replay
        # Links go to http(s) only, never to script.
        links = turn.locator(".reply a")
        assert await links.count() == 1
        assert await links.get_attribute("href") == "https://example.com/notes"
        assert "noopener" in str(await links.get_attribute("rel"))
        assert "[not](javascript:alert(1))" in str(await turn.locator(".reply").text_content())
        assert await round2.locator(".text").text_content() == (
            "Noted: z0 z1 <img src=x onerror=alert(1)> z2 z3 z4."
        )
        assert await round2.locator("strong").text_content() == "z0"
        assert await page.locator("#transcript img").count() == 0
        order: list[str] = await turn.locator(".reply > *").evaluate_all(
            "nodes => nodes.map(n => n.dataset.round || n.className)"
        )
        assert order == ["1", "divider warn attempt-note", "2"], order
        note = str(await turn.locator(".attempt-note").text_content())
        assert note.startswith("attempt 2 after a worker was lost")
        assert await turn.locator(".turn-attempt").text_content() == "attempt 2"
        assert await turn.locator(".notes-action").text_content() == (
            f"updated the working notes ({len(notes)} B)"
        )
        # Each round's latency and tokens; the replayed one counts from its replay.
        assert await turn.locator(".round-stats").all_text_contents() == [
            "round 1 · 1.50 s · 100 in · 10 out tokens",
            "round 2 · 0.80 s · 150 in · 20 out tokens · played again by attempt 2",
        ]
        # The event list keeps both round.started of round 2: nothing is hidden there.
        assert await tab.event_ids(turn) == await played.stream_ids()


@pytest.mark.browser
@pytest.mark.timeout(90)
async def test_a_round_held_by_the_rate_limit_says_so_until_text_flows(
    turn_player: Callable[[str, str], Any],
) -> None:
    """``round.waiting`` (docs/api.md) is shown in its round, counting down, and goes when
    the round's text flows or the turn ends. The events are written here as the worker
    writes them, so the page shows each state for as long as the test needs."""
    async with turn_player("rate limited", "hello") as played:
        tab, store, emit = played.tab, played.store, played.emit
        session, turn, tid = played.session, played.turn, played.tid
        t0 = 1_800_000_000_000
        await emit(
            TurnStarted(turnId=tid, attempt=1, worker="w1", at=t0),
            RoundStarted(turnId=tid, round=1, at=t0),
            RoundWaiting(turnId=tid, round=1, reason="rate_limited", waitMs=60_000, at=t0),
        )
        waiting = turn.locator('.round[data-round="1"] .waiting')
        await expect(waiting).to_have_text(
            re.compile(r"^waiting for the model's rate limit · retrying in (60|59|58) s$")
        )
        # A second wait of the same round replaces the note.
        await emit(RoundWaiting(turnId=tid, round=1, reason="overloaded", waitMs=0, at=t0))
        await expect(waiting).to_have_text("waiting: the model is overloaded · retrying…")
        assert await turn.locator(".waiting").count() == 1
        await expect(turn).to_have_attribute("data-waiting", "overloaded")

        await emit(TextDelta(turnId=tid, round=1, text="Hello."))
        await turn.locator(".reply .text").filter(has_text="Hello.").wait_for()
        await expect(turn.locator(".waiting")).to_have_count(0)
        await expect(turn).not_to_have_attribute("data-waiting", re.compile(".*"))

        # Held again in round 2, past the bound: the turn fails and the note goes with it.
        await emit(
            RoundStarted(turnId=tid, round=2, at=t0 + 1000),
            RoundWaiting(turnId=tid, round=2, reason="rate_limited", waitMs=5_000, at=t0),
        )
        await turn.locator('.round[data-round="2"] .waiting').wait_for()
        await end_turn(
            store, USER, session, tid, "failed", reason="rate_limited", error="still limited"
        )
        await tab.wait_status(turn, "failed")
        await expect(turn.locator(".waiting")).to_have_count(0)
        assert await turn.locator(".turn-status").text_content() == (
            "failed: rate_limited (still limited)"
        )
        # The event list keeps them: nothing is hidden there.
        assert await tab.event_ids(turn) == await played.stream_ids()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_redis_outage_shows_reconnecting_and_why_then_clears(
    browser: Any, settings: Settings, tmp_path: Path
) -> None:
    """Redis stops under a gateway with a console open: within a few seconds the page
    says it is reconnecting and why; a send meanwhile is refused with a notice. Redis
    starts again (same port, same data): the state and the notice clear, turns run."""
    port = free_port()
    data = tmp_path / "redis"
    async with contextlib.AsyncExitStack() as stack:
        restarted = contextlib.ExitStack()
        stack.callback(restarted.close)  # stopped last, after the gateway and the worker
        first = contextlib.ExitStack()
        stack.callback(first.close)
        url = first.enter_context(private_redis_server(data, aof=True, port=port))
        own = dataclasses.replace(settings, redis_url=url)
        gateway = await stack.enter_async_context(live_gateway(own))
        await stack.enter_async_context(running_worker(own, ScriptedModel(own), name="outage"))
        tab = await stack.enter_async_context(console_tab(browser, gateway.base_url, _token(own)))
        page = tab.page
        await tab.new_session("through an outage")
        await page.locator('#log-state[data-state="live"]').wait_for()
        badge = page.locator("#stream-state")
        assert await badge.get_attribute("data-state") == "idle"

        first.close()  # Redis stops
        await page.locator('#stream-state[data-state="reconnecting"]').wait_for()
        await expect(badge).to_have_text("reconnecting")
        outage = page.locator("#outage")
        await expect(outage).to_contain_text("the server can't reach Redis (503)")
        # No promise that turns go on: without Redis they wait.
        await expect(outage).to_contain_text("Running turns wait for Redis")
        assert await page.get_attribute("#log-state", "data-state") == "reconnecting"
        await page.fill("#message", "are you there?")
        await page.click("#send")
        # The refusal joins the one message, in the banner: nothing more elsewhere.
        await expect(outage).to_contain_text("Not done")
        await expect(page.locator("#notice")).to_be_hidden()
        await expect(badge).to_have_text("reconnecting")
        assert await page.locator(".turn").count() == 0
        assert await page.input_value("#message") == "are you there?"

        restarted.enter_context(private_redis_server(data, aof=True, port=port))
        await page.locator('#stream-state[data-state="idle"]').wait_for()
        await page.locator('#log-state[data-state="live"]').wait_for()
        await expect(outage).to_be_hidden()
        await expect(page.locator("#notice")).to_contain_text("send it again")

        # The streams flow again: a turn runs and the page follows it to its end.
        turn = await tab.send("remember the outage is over")
        await tab.wait_status(turn, "completed")
        await page.locator("#notes-text").filter(has_text="the outage is over").wait_for()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_send_while_redis_is_paused_says_sending_at_once_and_one_message(
    browser: Any, settings: Settings, tmp_path: Path
) -> None:
    """Redis paused (SIGSTOP) under the gateway: a send says "sending…" at once, and
    when the server gives up, the one message of the outage says it was not done."""
    server = PrivateRedis(tmp_path, tmp_path / "redis.log", binary=redis_binary(), aof=False)
    server.start()
    try:
        # The server gives up on a link that answers nothing for 3 s, not the default 10.
        own = dataclasses.replace(settings, redis_url=server.url, redis_reply_timeout_ms=3000)
        async with (
            live_gateway(own) as gateway,
            console_tab(browser, gateway.base_url, _token(own)) as tab,
        ):
            page = tab.page
            await tab.new_session("through a pause")
            assert server.child is not None
            server.child.signal(signal.SIGSTOP)
            try:
                await page.fill("#message", "are you there?")
                await page.click("#send")
                await expect(page.locator("#send")).to_have_text("sending…", timeout=500)
                await expect(page.locator("#send")).to_be_disabled()
                outage = page.locator("#outage")
                await expect(outage).to_contain_text("can't reach Redis")
                await expect(outage).to_contain_text("Not done", timeout=45_000)
                # One message, in one place: the badge names the state, no notice.
                await expect(page.locator("#stream-state")).to_have_text("reconnecting")
                await expect(page.locator("#notice")).to_be_hidden()
                assert await page.locator(".outage:visible, .notice:visible").count() == 1
                await expect(page.locator("#send")).to_have_text("Send")
                assert await page.input_value("#message") == "are you there?"
            finally:
                server.child.signal(signal.SIGCONT)
            await expect(outage).to_be_hidden()
    finally:
        server.stop()


# ---------------------------------------------------------------- a turn paused for its caller

PICK_FILE = {
    "name": "pick_file",
    "description": "Ask the user to pick a file.",
    "inputSchema": {"type": "object", "properties": {"prompt": {"type": "string"}}},
}


async def _paused_turn(http: httpx.AsyncClient, session: str, message: str) -> str:
    """Submit a turn declaring ``pick_file`` as a client tool; its id once it waits."""
    r = await http.post(
        f"/v1/sessions/{session}/turns", json={"message": message, "clientTools": [PICK_FILE]}
    )
    assert r.status_code == 202, r.text
    tid = str(r.json()["turnId"])
    for _ in range(300):
        record = (await http.get(f"/v1/sessions/{session}/turns/{tid}")).json()
        if record["status"] == "requires_action":
            return tid
        await asyncio.sleep(0.05)
    raise AssertionError(f"the turn did not pause: {record}")


@pytest.mark.browser
@pytest.mark.timeout(120)
async def test_pending_client_calls_are_answered_from_the_console_after_a_reload(
    browser: Any, gw: LiveGateway, settings: Settings, http: httpx.AsyncClient
) -> None:
    """Two client calls of one round: each shows its input and a form; the sessions list
    marks the session; a reload shows both again (from the turn's events); one Submit
    answers both in one request, and the turn streams on in place to its end."""
    message = (
        'call pick_file {"prompt": "which file?"}\ncall pick_file {"prompt": "and which log?"}'
    )
    async with running_worker(settings, ScriptedModel(settings), name="console"):
        session = (await http.post("/v1/sessions", json={"meta": {"title": "paused"}})).json()[
            "sessionId"
        ]
        tid = await _paused_turn(http, session, message)
        async with console_tab(browser, gw.base_url, _token(settings)) as tab:
            page = tab.page
            turn = page.locator(f'.turn[data-turn-id="{tid}"]')
            await tab.wait_status(turn, "requires_action")
            await expect(turn.locator(".turn-status")).to_have_text(
                "requires action: waiting for your answer"
            )
            marker = page.locator(f'#session-list li[data-session-id="{session}"] .active-turn')
            await expect(marker).to_have_text("● waiting for your answer")
            assert await marker.get_attribute("data-status") == "requires_action"
            assert await page.is_enabled("#cancel")
            # A message sent meanwhile would queue behind the waiting turn.
            assert await page.is_enabled("#send")

            # A reload shows the same pending calls again, once each.
            await page.reload()
            await page.wait_for_selector("#app:not([hidden])")
            turn = page.locator(f'.turn[data-turn-id="{tid}"]')
            await tab.wait_status(turn, "requires_action")
            boxes = turn.locator('.tool.pending[data-tool="pick_file"]')
            await expect(boxes).to_have_count(2)
            await expect(turn.locator(".tool")).to_have_count(2)
            await expect(boxes.nth(0).locator(".tool-input")).to_contain_text("which file?")
            await expect(boxes.nth(1).locator(".tool-input")).to_contain_text("and which log?")
            assert await page.locator(".past").count() == 0
            record = (await http.get(f"/v1/sessions/{session}/turns/{tid}")).json()
            shown = await boxes.evaluate_all("items => items.map(i => i.dataset.callId)")
            assert shown == [c["callId"] for c in record["pendingCalls"]]

            await boxes.nth(0).locator(".pending-output").fill("notes.txt")
            await boxes.nth(1).locator(".pending-output").fill("no log here")
            await boxes.nth(1).locator(".pending-is-error input").check()
            await turn.locator(".pending-submit").click()
            await tab.wait_status(turn, "completed")
            await expect(turn.locator(".pending-call")).to_have_count(0)
            await expect(turn.locator(".pending-actions")).to_have_count(0)
            await expect(boxes).to_have_count(0)
            results = turn.locator(".tool .tool-result")
            await expect(results.nth(0)).to_contain_text("notes.txt")
            await expect(results.nth(1)).to_contain_text("no log here")
            await expect(results.nth(1)).to_contain_text("result (error)")
            await expect(turn.locator(".reply .text").last).to_contain_text("notes.txt")
            await expect(turn.locator(".divider.resumed")).to_have_count(1)
            # A resume is no replay: no attempt line.
            await expect(turn.locator(".attempt-note")).to_have_count(0)
            assert await turn.locator(".turn-attempt").text_content() == ""
            await expect(marker).to_have_count(0)
            assert await page.is_enabled("#send")

    record = (await http.get(f"/v1/sessions/{session}/turns/{tid}")).json()
    assert record["status"] == "completed" and record["resumes"] == 1
    rows = (await http.get(f"/v1/sessions/{session}/messages")).json()["messages"]
    answers = [b for row in rows for b in row["content"] if isinstance(b, dict)]
    answers = [b for b in answers if b.get("type") == "tool_result"]
    assert [(b["content"], bool(b.get("is_error"))) for b in answers] == [
        ("notes.txt", False),
        ("no log here", True),
    ]


@pytest.mark.browser
@pytest.mark.timeout(120)
async def test_approvals_are_answered_from_the_console_against_a_real_worker(
    browser: Any,
    gw: LiveGateway,
    settings: Settings,
    http: httpx.AsyncClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real worker's tool that needs approval, called twice in one round: the page shows
    both calls, and both again after a reload; one is approved and the other rejected with
    a reason from the page; the turn completes, the tool ran once (for the approved call)
    and the model read the reason."""
    effects = tmp_path / "sent.jsonl"
    monkeypatch.setenv("APPROVAL_TOOLS_LOG", str(effects))
    message = 'call send {"to": "ann", "body": "hi"}\ncall send {"to": "bob", "body": "hi"}'
    reason = "bob is on leave this week"
    async with (
        running_worker(settings, ScriptedModel(settings), name="approver", tools=approval_tools()),
        console_tab(browser, gw.base_url, _token(settings)) as tab,
    ):
        page = tab.page
        session = await tab.new_session("approvals")
        turn = await tab.send(message)
        tid = str(await turn.get_attribute("data-turn-id"))
        await tab.wait_status(turn, "requires_action")
        boxes = turn.locator('.tool.pending[data-kind="approval"]')
        await expect(boxes).to_have_count(2)
        record = (await http.get(f"/v1/sessions/{session}/turns/{tid}")).json()
        calls = {c["input"]["to"]: c["callId"] for c in record["pendingCalls"]}
        assert sorted(calls) == ["ann", "bob"]
        assert [c["kind"] for c in record["pendingCalls"]] == ["approval", "approval"]
        assert not effects.exists(), "nothing runs before the approval"

        # A reload shows the pending approvals again, once each.
        await page.reload()
        await page.wait_for_selector("#app:not([hidden])")
        turn = page.locator(f'.turn[data-turn-id="{tid}"]')
        await tab.wait_status(turn, "requires_action")
        boxes = turn.locator('.tool.pending[data-kind="approval"]')
        await expect(boxes).to_have_count(2)
        await expect(turn.locator(".tool")).to_have_count(2)
        shown = await boxes.evaluate_all("items => items.map(i => i.dataset.callId)")
        assert sorted(shown) == sorted(calls.values())

        ann = turn.locator(f'.tool[data-call-id="{calls["ann"]}"]')
        bob = turn.locator(f'.tool[data-call-id="{calls["bob"]}"]')
        await expect(ann.locator(".tool-input")).to_contain_text('"to": "ann"')
        await ann.locator("button.approve").click()
        await bob.locator("button.reject").click()
        await bob.locator(".pending-reason").fill(reason)
        await turn.locator(".pending-submit").click()

        await tab.wait_status(turn, "completed")
        await expect(turn.locator(".pending-call")).to_have_count(0)
        await expect(turn.locator(".pending-actions")).to_have_count(0)
        await expect(ann.locator(".tool-result")).to_contain_text("sent to ann: hi")
        await expect(bob.locator(".tool-result")).to_contain_text("result (error)")
        await expect(bob.locator(".tool-result")).to_contain_text(reason)
        # The model's reply after the answers quotes what it was given: the reason too.
        await expect(turn.locator(".reply .text").last).to_contain_text(reason)
        await expect(turn.locator(".divider.resumed")).to_have_count(1)
        await expect(turn.locator(".attempt-note")).to_have_count(0)
        assert await turn.locator(".turn-attempt").text_content() == ""

    record = (await http.get(f"/v1/sessions/{session}/turns/{tid}")).json()
    assert record["status"] == "completed" and record["resumes"] == 1
    ran = [json.loads(line) for line in effects.read_text().splitlines()]
    assert ran == [{"to": "ann", "body": "hi", "callId": calls["ann"]}], "once, approved only"
    rows = (await http.get(f"/v1/sessions/{session}/messages")).json()["messages"]
    blocks = [b for row in rows for b in row["content"] if isinstance(b, dict)]
    results = {b["tool_use_id"]: b for b in blocks if b.get("type") == "tool_result"}
    assert results[calls["bob"]]["is_error"] and reason in results[calls["bob"]]["content"]
    assert not results[calls["ann"]].get("is_error")


@pytest.mark.browser
@pytest.mark.timeout(90)
async def test_pending_approvals_are_answered_together_in_one_request(
    turn_player: Callable[[str, str], Any],
) -> None:
    """What the test against a real worker above leaves out: Edit, and a Submit with a
    call not decided yet (nothing is sent); three calls answered in one request with
    every decision (the gateway's answer is stubbed here; the events are written as a
    worker writes them)."""
    async with turn_player("approvals", "send the mails") as played:
        page, turn, tid = played.tab.page, played.turn, played.tid
        calls = [
            ("a1", "send_email", {"to": "ann@example.com"}),
            ("a2", "send_email", {"to": "bob@example.com"}),
            ("a3", "delete_branch", {"branch": "main"}),
        ]
        await played.emit(
            TurnStarted(turnId=tid, attempt=1, worker="w1", at=1),
            RoundStarted(turnId=tid, round=1, at=1),
            *(ToolCall(turnId=tid, round=1, callId=c, name=n, input=i) for c, n, i in calls),
            TurnRequiresAction(
                turnId=tid,
                round=1,
                calls=[
                    PendingCall(callId=c, name=n, input=i, kind="approval") for c, n, i in calls
                ],
            ),
        )
        await played.tab.wait_status(turn, "requires_action")
        sent: list[Any] = []

        async def answer(route: Any) -> None:
            sent.append(json.loads(route.request.post_data or "{}"))
            await route.fulfill(status=202, json={"turnId": tid, "status": "queued"})

        await page.route(f"**/turns/{tid}/actions", answer)
        boxes = turn.locator('.tool.pending[data-kind="approval"]')
        await expect(boxes).to_have_count(3)
        await expect(boxes.nth(2).locator(".tool-input")).to_contain_text('"branch": "main"')
        # Not every call decided: nothing is sent.
        await boxes.nth(0).locator("button.approve").click()
        await turn.locator(".pending-submit").click()
        await expect(turn.locator(".pending-error")).to_contain_text("send_email first")
        await boxes.nth(1).locator("button.edit").click()
        await boxes.nth(1).locator(".pending-input").fill('{"to": "bob@example.org"}')
        await boxes.nth(2).locator("button.reject").click()
        await boxes.nth(2).locator(".pending-reason").fill("never main")
        await turn.locator(".pending-submit").click()
        await expect(turn.locator('.pending-actions[data-answered="true"]')).to_have_count(1)
        assert sent == [
            {
                "approvals": [
                    {"callId": "a1", "decision": "approve"},
                    {"callId": "a2", "decision": "edit", "input": {"to": "bob@example.org"}},
                    {"callId": "a3", "decision": "reject", "reason": "never main"},
                ]
            }
        ]
        # The answers' results settle the calls; the resuming attempt clears the pause.
        await played.emit(
            *(
                ToolResult(turnId=tid, round=1, callId=c, name=n, output="done")
                for c, n, _ in calls
            ),
            TurnStarted(turnId=tid, attempt=2, worker="w2", at=2, after="answered"),
        )
        await expect(turn.locator(".pending-call")).to_have_count(0)
        await played.tab.wait_status(turn, "running")
        await expect(turn.locator(".attempt-note")).to_have_count(0)
