// turnbus console: plain JS, no build step. Model and user text only ever goes
// into the page through textContent and createElement, never parsed as markup
// (the Markdown of replies is rendered by building elements, see renderMarkdown).
"use strict";

(() => {
  const NOTES_CAP = 32 * 1024;
  const TOKEN_KEY = "turnbus.token";
  const OPEN_KEY = "turnbus.open"; // the session this tab has open, reopened on reload
  const SESSIONS_PAGE = 20;
  // STATUS, ACTIVE_STATUSES, TERMINAL_STATUSES, REASON: from statuses.js, loaded before
  // this script.
  const TERMINAL = new Set(TERMINAL_STATUSES.map((status) => `turn.${status}`));
  const TURN_TYPES = [
    "turn.queued", "turn.started", "round.started", "round.waiting", "text.delta", "tool.call",
    "tool.result", "working_notes", "usage", "turn.requires_action", ...TERMINAL, "resync",
    "stream.dropped",
  ];
  const LOG_TYPES = ["working_notes", "envelope.patched", "resync", "stream.dropped"];
  // Events the gateway sends without an `id:` line; EventSource then reports the
  // previous id in lastEventId, so these must not go through the duplicate check.
  const NO_ID = new Set(["resync", "stream.dropped"]);
  const NOTES_TOOLS = new Set(["working_notes_get", "working_notes_update", "working_notes_clear"]);
  // What events and the stored history keep of notes text (worker/tools.py).
  const NOTES_DIGEST = /^\[working notes: (\d+) bytes, sha256 [0-9a-f]{64}\]$/;
  // Past turns whose events are read at once when a session opens; older ones on demand.
  const PAST_RECORDS = 50;
  const PAST_EVENTS = 20;
  const PROBE_MS = 2000;
  const LOST = "connection lost: the gateway does not answer";

  const state = {
    token: null,
    user: null,
    sessionId: null,
    turn: null, // the turn being shown live: see attachTurn()
    log: null, // the session log follower: {es, retry}
    notesTimer: null,
  };
  // The sessions list as shown: rows from GET /v1/sessions, and the cursor of the next page.
  const listed = { rows: [], nextCursor: null, loaded: false, generation: 0 };
  // The connection's health: `outage` says why the page is reconnecting (null when fine);
  // `stream` is the live turn stream's own state, shown when there is no outage.
  const health = {
    outage: null, notDone: false, timer: null, probing: false,
    stream: { kind: "idle", text: "idle" },
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  // A server's sentence into `node`: its `quoted` parts as code, the rest as text (the
  // API's messages quote names that way); never parsed as markup.
  function setMessage(node, text) {
    const parts = String(text || "").split("`");
    if (parts.length % 2 === 0) {
      node.textContent = String(text || ""); // an unpaired backtick: the text as it is
      return;
    }
    node.replaceChildren(...parts.map((part, i) => (i % 2 ? el("code", "", part) : document.createTextNode(part))));
  }

  function button(className, text, onClick) {
    const node = el("button", className, text);
    node.type = "button";
    node.addEventListener("click", onClick);
    return node;
  }

  // One way to show a size: exact bytes (the numbers the API and the tools give).
  const fmtBytes = (n) => `${Number(n).toLocaleString("en-US")} B`;
  const fmtSeconds = (ms) => `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;

  // ---------------------------------------------------------------- token

  function takeFragmentToken() {
    const hash = location.hash.replace(/^#/, "");
    if (!hash) return;
    const params = new URLSearchParams(hash);
    const token = params.get("token");
    if (token === null) return;
    if (token) sessionStorage.setItem(TOKEN_KEY, token);
    // The fragment never reaches the server; remove it from the address bar and history too.
    history.replaceState(null, "", location.pathname + location.search);
  }

  function claimsOf(token) {
    try {
      const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
      const padded = part + "=".repeat((4 - (part.length % 4)) % 4);
      const bytes = Uint8Array.from(atob(padded), (c) => c.charCodeAt(0));
      return JSON.parse(new TextDecoder().decode(bytes));
    } catch {
      return null;
    }
  }

  function useToken(token) {
    const claims = claimsOf(token);
    if (!claims || typeof claims.sub !== "string" || !claims.sub) {
      showTokenPanel("That is not a JWT with a `sub` claim.");
      return false;
    }
    state.token = token;
    state.user = claims.sub;
    sessionStorage.setItem(TOKEN_KEY, token);
    const expires = typeof claims.exp === "number" ? new Date(claims.exp * 1000) : null;
    $("whoami").textContent = expires
      ? `${claims.sub} · token expires ${expires.toLocaleString()}`
      : claims.sub;
    $("token-forget").hidden = false;
    $("token-panel").hidden = true;
    $("app").hidden = false;
    return true;
  }

  function showTokenPanel(message) {
    $("token-panel").hidden = false;
    $("app").hidden = true;
    $("token-forget").hidden = true;
    $("whoami").textContent = "no token";
    const error = $("token-error");
    error.hidden = !message;
    setMessage(error, message);
    $("token-input").focus();
  }

  function forgetToken(message) {
    closeTurnStream();
    closeLog();
    stopProbing();
    sessionStorage.removeItem(TOKEN_KEY);
    state.token = null;
    state.user = null;
    state.sessionId = null;
    sessionStorage.removeItem(OPEN_KEY);
    resetSessions();
    showTokenPanel(message);
  }

  // ---------------------------------------------------------------- HTTP

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail.message || `HTTP ${status}`);
      this.status = status;
      this.code = detail.code || `http_${status}`;
      this.detail = detail;
    }
  }

  async function api(method, path, body, headers) {
    const init = { method, headers: { Authorization: `Bearer ${state.token}`, ...headers } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    if (method === "POST" && path.endsWith("/turns")) init.headers["Idempotency-Key"] = randomKey();
    let response;
    try {
      response = await fetch(path, init);
    } catch (error) {
      setOutage(LOST);
      throw error;
    }
    if (!response.ok) {
      let detail = { code: `http_${response.status}`, message: response.statusText };
      try {
        detail = (await response.json()).error || detail;
      } catch {
        // not JSON: keep the status line
      }
      if (response.status === 401) forgetToken(`The gateway refused the token: ${detail.message}`);
      if (response.status === 503) setOutage(unavailableReason(detail.message));
      throw new ApiError(response.status, detail);
    }
    return response;
  }

  function randomKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  const sessionPath = (id) => `/v1/sessions/${encodeURIComponent(id)}`;
  const turnPath = (sessionId, turnId) => `${sessionPath(sessionId)}/turns/${encodeURIComponent(turnId)}`;

  function streamUrl(path, after) {
    const query = new URLSearchParams({ access_token: state.token });
    if (after) query.set("after", after);
    return `${path}?${query}`;
  }

  function notice(message) {
    const node = $("notice");
    node.hidden = !message;
    setMessage(node, message);
  }

  function report(error) {
    const unreachable = error instanceof ApiError ? error.status === 503 : Boolean(health.outage);
    if (unreachable) {
      // One message in one place: the outage banner says why and that this was not done.
      notice("");
      health.notDone = true;
      if (!health.outage) setOutage(error instanceof ApiError ? unavailableReason(error.message) : LOST);
      else renderBadge();
    } else if (error instanceof ApiError) {
      notice(`${error.code}: ${error.message}`);
    } else {
      notice(`Network error: ${error.message}`);
    }
  }

  // ---------------------------------------------------------------- outage state
  // An open event stream can stay silent while the gateway cannot reach Redis, so the page
  // also asks /readyz every few seconds: a 503 or no answer shows "reconnecting" and why;
  // an answer again resumes the streams, and the state clears once they are open.

  function unavailableReason(message) {
    return /redis/i.test(message || "")
      ? "the server can't reach Redis (503)"
      : `the server is unavailable (503${message ? `: ${message}` : ""})`;
  }

  function startProbing() {
    stopProbing();
    health.timer = setInterval(probe, PROBE_MS);
  }

  function stopProbing() {
    clearInterval(health.timer);
    health.timer = null;
  }

  async function probe() {
    if (health.probing || document.visibilityState === "hidden") return;
    health.probing = true;
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), PROBE_MS + 1000);
    try {
      const response = await fetch("/readyz", { cache: "no-store", signal: abort.signal });
      if (response.ok) {
        clearOutage();
      } else {
        let message = response.statusText;
        try {
          message = (await response.json()).error.message || message;
        } catch {
          // keep the status line
        }
        setOutage(response.status === 503
          ? unavailableReason(message) : `the server answered ${response.status}`);
      }
    } catch {
      setOutage(LOST);
    } finally {
      clearTimeout(timer);
      health.probing = false;
    }
  }

  function setOutage(why) {
    if (!state.token || health.outage === why) return;
    health.outage = why;
    renderBadge();
    if (state.log) setLogState("reconnecting");
  }

  function clearOutage() {
    if (!health.outage) return;
    health.outage = null;
    if (health.notDone) notice("The server answers again. What was not sent is still in the box: send it again.");
    health.notDone = false;
    resumeStreams();
    renderBadge();
  }

  function resumeStreams() {
    const turn = state.turn;
    if (turn && !turn.ended && !(turn.es && turn.es.readyState === EventSource.OPEN)) {
      clearTimeout(turn.retryTimer);
      turn.retry = 0;
      if (turn.es) turn.es.close();
      openTurnStream(turn);
    }
    const log = state.log;
    if (log) {
      if (log.es && log.es.readyState === EventSource.OPEN) {
        setLogState("live");
      } else {
        clearTimeout(log.timer);
        log.retry = 0;
        log.open();
      }
    }
  }

  function setStreamState(kind, text) {
    health.stream = { kind, text };
    renderBadge();
  }

  function renderBadge() {
    // The badge only names the state; the banner alone says why.
    const { kind, text } = health.outage ? { kind: "reconnecting", text: "reconnecting" } : health.stream;
    const node = $("stream-state");
    node.dataset.state = kind;
    node.textContent = text;
    document.body.dataset.stream = kind;
    const banner = $("outage");
    banner.hidden = !health.outage;
    setMessage(banner, health.outage ? outageText() : "");
  }

  // The banner's one sentence: what is wrong, what that means for the turns (without
  // Redis no turn moves; without the gateway the workers carry on), and what was not done.
  function outageText() {
    const redis = /redis/i.test(health.outage);
    const turns = redis
      ? "Running turns wait for Redis and carry on when it is back (a round cut off by a long pause plays again)"
      : "Running turns go on on the workers; the page resumes their events once the server answers";
    const unsent = health.notDone ? " Not done: your last action; a message stays in the box to send again." : "";
    return `Reconnecting: ${health.outage}. ${turns}.${unsent}`;
  }

  // ---------------------------------------------------------------- sessions
  // The list is the server's (GET /v1/sessions): the caller's sessions, newest first, a
  // page at a time ("more"). Nothing of it is kept in the browser.

  async function fetchPage(cursor, limit) {
    const query = new URLSearchParams({ limit: String(limit) });
    if (cursor) query.set("cursor", cursor);
    return (await api("GET", `/v1/sessions?${query}`)).json();
  }

  // Whether row `a` comes at or after row `b` in the list's order (newest first: by
  // createdAt, then by id, as the server sorts).
  function atOrAfter(a, b) {
    return a.createdAt !== b.createdAt ? a.createdAt < b.createdAt : a.sessionId <= b.sessionId;
  }

  // Reads the list again from the start, down to at least the oldest row shown: new
  // sessions come in at the top, deleted ones drop out, pages opened stay open.
  async function refreshSessions() {
    const generation = ++listed.generation;
    const oldest = listed.rows[listed.rows.length - 1];
    const limit = Math.min(100, Math.max(SESSIONS_PAGE, listed.rows.length + 1));
    const rows = [];
    let cursor = null;
    do {
      const page = await fetchPage(cursor, limit);
      rows.push(...page.sessions);
      cursor = page.nextCursor;
    } while (cursor && oldest && !(rows.length && atOrAfter(rows[rows.length - 1], oldest)));
    if (generation !== listed.generation) return; // a later refresh or page won
    listed.rows = rows;
    listed.nextCursor = cursor;
    listed.loaded = true;
    renderSessions();
  }

  async function moreSessions() {
    if (!listed.nextCursor) return;
    const generation = ++listed.generation;
    const page = await fetchPage(listed.nextCursor, SESSIONS_PAGE);
    if (generation !== listed.generation) return;
    const shown = new Set(listed.rows.map((s) => s.sessionId));
    listed.rows.push(...page.sessions.filter((s) => !shown.has(s.sessionId)));
    listed.nextCursor = page.nextCursor;
    renderSessions();
  }

  function resetSessions() {
    listed.generation++;
    listed.rows = [];
    listed.nextCursor = null;
    listed.loaded = false;
    renderSessions();
  }

  function updateRow(id, change) {
    const row = listed.rows.find((s) => s.sessionId === id);
    if (!row) return;
    Object.assign(row, change);
    renderSessions();
  }

  function renderSessions() {
    const node = $("session-list");
    node.replaceChildren();
    for (const session of listed.rows) {
      const id = session.sessionId;
      const item = el("li", id === state.sessionId ? "active" : "");
      item.dataset.sessionId = id;
      const open = button("open", undefined, () => openSession(id).catch(report));
      // A session's first message gives it a title (the server's); until then it has none.
      const title = el("span", "title", session.title || "new session · no message yet");
      if (!session.title) title.classList.add("untitled");
      open.title = id;
      open.append(title);
      const times = el("span", "meta times", `created ${when(session.createdAt)} · updated ${when(session.updatedAt)}`);
      times.title = `created ${iso(session.createdAt)}\nupdated ${iso(session.updatedAt)}`;
      open.append(times);
      const facts = el("span", "meta facts");
      if (session.activeTurn) {
        const waiting = session.activeTurn.status === STATUS.requires_action;
        const marker = el("span", "active-turn", waiting ? "● waiting for your answer" : `● ${session.activeTurn.status}`);
        marker.dataset.status = session.activeTurn.status;
        marker.title = `turn ${session.activeTurn.turnId}`;
        facts.append(marker, " · ");
      }
      const notes = el("span", "notes-size", session.notesBytes ? `notes ${fmtBytes(session.notesBytes)}` : "no notes");
      notes.dataset.bytes = String(session.notesBytes);
      facts.append(notes);
      if (session.title) facts.append(` · ${id}`);
      open.append(facts);
      const remove = button("delete", "×", () => deleteSession(id));
      remove.title = "Delete this session on the server";
      remove.setAttribute("aria-label", `Delete session ${session.title || id}`);
      item.append(open, remove);
      node.append(item);
    }
    $("sessions-more").hidden = !listed.nextCursor;
    $("sessions-empty").hidden = !listed.loaded || listed.rows.length > 0;
  }

  // A readable time: the clock today, the day and clock this year, else the date.
  function when(ms) {
    if (typeof ms !== "number") return "";
    const date = new Date(ms);
    const now = new Date();
    const clock = { hour: "2-digit", minute: "2-digit", hour12: false };
    if (date.toDateString() === now.toDateString()) return date.toLocaleTimeString([], clock);
    const day = { month: "short", day: "numeric" };
    if (date.getFullYear() !== now.getFullYear()) day.year = "numeric";
    return date.toLocaleString([], { ...day, ...clock });
  }

  const iso = (ms) => (typeof ms === "number" ? new Date(ms).toISOString() : "");

  async function createSession(title) {
    const body = title ? { meta: { title } } : {};
    const envelope = await (await api("POST", "/v1/sessions", body)).json();
    await Promise.all([openSession(envelope.sessionId), refreshSessions()]);
  }

  async function deleteSession(id) {
    // The list is the server's, so removing a row means deleting the session there.
    if (!confirm(`Delete session ${id} and everything in it, on the server?`)) return;
    try {
      await api("DELETE", sessionPath(id));
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 404)) return report(error);
    }
    listed.rows = listed.rows.filter((s) => s.sessionId !== id);
    if (state.sessionId === id) clearSession();
    else renderSessions();
    refreshSessions().catch(report);
  }

  function clearSession() {
    closeTurnStream();
    closeLog();
    state.sessionId = null;
    sessionStorage.removeItem(OPEN_KEY);
    $("session-title").textContent = "No session open";
    $("session-id").textContent = "";
    $("transcript").replaceChildren();
    setNotes(null, 0);
    $("system-text").textContent = "";
    setComposer(false);
    setStreamState("idle", "idle");
    renderSessions();
  }

  // Opens a session (one in the list, or any id of the caller's); false when it cannot.
  async function openSession(id) {
    clearSession();
    notice("");
    let envelope;
    try {
      envelope = await (await api("GET", sessionPath(id))).json();
    } catch (error) {
      report(error);
      return false;
    }
    state.sessionId = id;
    sessionStorage.setItem(OPEN_KEY, id);
    renderSessions();
    $("session-title").textContent = envelope.meta.title || "untitled";
    $("session-id").textContent = id;
    setComposer(true);
    // A turn still running (e.g. after a reload) is shown live from its first event, so
    // the history leaves that turn out.
    const running = await runningTurn(id, envelope.meta);
    await Promise.all([
      loadHistory(id, running ? running.turnId : null), refreshNotes(), refreshSystem(),
    ]);
    followLog(id);
    if (running && state.sessionId === id) attachTurn(running.turnId, running.message || "");
    return true;
  }

  // The turn that holds the session: running, or paused for its caller's answer.
  async function runningTurn(id, meta) {
    if (!meta.turnRunId || ![STATUS.running, STATUS.requires_action].includes(meta.turnStatus)) return null;
    try {
      const record = await (await api("GET", turnPath(id, meta.turnRunId))).json();
      return ACTIVE_STATUSES.includes(record.status) ? record : null;
    } catch {
      return null; // expired or gone: nothing to follow
    }
  }

  // ---------------------------------------------------------------- Markdown
  // A small renderer that builds elements: no string of the model's is ever parsed as
  // HTML. Blocks: paragraphs, headings, fenced code, lists, quotes, rules; inline: code,
  // bold, italic, and links to http(s) and mailto only.

  const INLINE = new RegExp([
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code
    "\\[([^\\]\\n]+)\\]\\(([^()\\s]+)\\)", // 3, 4: link
    "\\*\\*(?=\\S)([^*\\n]*?\\S)\\*\\*", // 5: bold
    "__(?=\\S)([^_\\n]*?\\S)__", // 6: bold
    "\\*(?=\\S)([^*\\n]*?\\S)\\*", // 7: italic
    "(?<![\\w])_(?=\\S)([^_\\n]*?\\S)_(?![\\w])", // 8: italic
  ].join("|"), "g");

  function safeHref(raw) {
    try {
      const url = new URL(raw);
      return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
    } catch {
      return null;
    }
  }

  function inline(parent, text) {
    let at = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > at) parent.append(text.slice(at, m.index));
      at = m.index + m[0].length;
      if (m[2] !== undefined) {
        parent.append(el("code", "", m[2]));
      } else if (m[3] !== undefined) {
        const href = safeHref(m[4]);
        if (!href) {
          parent.append(m[0]);
          continue;
        }
        const link = el("a");
        link.href = href;
        link.rel = "noopener noreferrer nofollow";
        link.target = "_blank";
        inline(link, m[3]);
        parent.append(link);
      } else {
        const strong = m[5] !== undefined || m[6] !== undefined;
        const node = el(strong ? "strong" : "em");
        inline(node, m[5] ?? m[6] ?? m[7] ?? m[8]);
        parent.append(node);
      }
    }
    if (at < text.length) parent.append(text.slice(at));
  }

  const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)\s*$/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
  const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
  const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;

  function renderMarkdown(text) {
    const out = document.createDocumentFragment();
    const lines = text.split(/\r\n|\r|\n/);
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        const body = [];
        i += 1;
        while (i < lines.length && !lines[i].trim().startsWith(m[1])) body.push(lines[i++]);
        i += 1;
        const pre = el("pre", "md-code");
        const code = el("code", "", body.join("\n"));
        if (m[2]) code.dataset.lang = m[2];
        pre.append(code);
        out.append(pre);
      } else if ((m = HEADING.exec(line))) {
        const heading = el(`h${Math.min(m[1].length + 2, 6)}`, "md-heading");
        inline(heading, m[2]);
        out.append(heading);
        i += 1;
      } else if (RULE.test(line)) {
        out.append(el("hr"));
        i += 1;
      } else if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
          body.push(m[1]);
          i += 1;
        }
        const quote = el("blockquote");
        quote.append(renderMarkdown(body.join("\n")));
        out.append(quote);
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        const numbered = !BULLET.test(line);
        const pattern = numbered ? NUMBERED : BULLET;
        const list = el(numbered ? "ol" : "ul");
        if (numbered) list.start = Number(NUMBERED.exec(line)[1]);
        while (i < lines.length && (m = pattern.exec(lines[i]))) {
          const item = el("li");
          inline(item, numbered ? m[2] : m[1]);
          list.append(item);
          i += 1;
        }
        out.append(list);
      } else {
        const body = [];
        while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i])
          && !RULE.test(lines[i]) && !QUOTE.test(lines[i]) && !BULLET.test(lines[i])
          && !NUMBERED.test(lines[i])) {
          body.push(lines[i]);
          i += 1;
        }
        const paragraph = el("p");
        inline(paragraph, body.join("\n"));
        out.append(paragraph);
      }
    }
    return out;
  }

  // ---------------------------------------------------------------- turn views
  // A turn on the page, live or from the history: its prompt, its rounds (each with its
  // text, its tool boxes and its latency and tokens), its status, usage and events.

  function turnView(sessionId, turnId, message, past) {
    const section = el("section", past ? "turn past" : "turn");
    section.dataset.turnId = turnId;
    section.dataset.status = past ? "unknown" : STATUS.queued;
    section.dataset.duplicates = "0";
    if (message !== null) section.append(el("div", "bubble user", message));
    const reply = el("div", "reply");
    const footer = el("div", "turn-footer");
    const status = el("span", "turn-status", past ? "" : STATUS.queued);
    const attempt = el("span", "turn-attempt");
    const usage = el("span", "turn-usage");
    const timing = el("span", "turn-time");
    const events = el("details", "event-log");
    events.append(el("summary", "", "events"));
    const eventList = el("ol");
    events.append(eventList);
    const view = {
      sessionId, id: turnId, path: turnPath(sessionId, turnId), past,
      section, reply, status, attempt, usage, timing, events, eventList,
      rounds: new Map(), calls: new Map(), current: null, attemptNote: null,
      attemptNumber: 1, cumulative: null, firstAt: null, eventsRequested: false,
      waiting: null, // the round held by the model's rate limit: {node, timer}
      pending: null, // the calls a pause waits on: see showPending()
      resumes: 0, // the turn.started events that resumed an answered pause
    };
    const copy = button("link copy", "copy reply", () => copyReply(view, copy));
    copy.title = "Copy the reply's text (Markdown) to the clipboard";
    footer.append(status, attempt, usage, timing, copy);
    section.append(reply, footer, events);
    if (past) events.addEventListener("toggle", () => events.open && loadPastEvents(view));
    return view;
  }

  function roundOf(view, n) {
    let round = view.rounds.get(n);
    if (round) return round;
    const node = el("div", "round");
    node.dataset.round = String(n);
    const body = el("div", "round-body");
    const stats = el("div", "round-stats");
    stats.hidden = true;
    node.append(body, stats);
    const later = [...view.rounds.values()].filter((r) => r.n > n).sort((a, b) => a.n - b.n)[0];
    if (later) later.node.before(node);
    else view.reply.append(node);
    round = {
      n, node, body, stats, text: "", textBlock: null,
      started: false, startedAt: null, endedAt: null, usageBase: null, tokens: null, replayedBy: 0,
    };
    view.rounds.set(n, round);
    return round;
  }

  function addText(view, n, text) {
    const round = roundOf(view, n);
    round.text += text;
    if (!round.textBlock) {
      round.textBlock = el("div", "text assistant md");
      round.body.prepend(round.textBlock);
    }
    round.textBlock.replaceChildren(renderMarkdown(round.text));
    round.textBlock.dataset.markdown = round.text;
  }

  function replyText(view) {
    return [...view.rounds.values()].sort((a, b) => a.n - b.n)
      .map((r) => r.text).filter(Boolean).join("\n\n");
  }

  async function copyReply(view, node) {
    const text = replyText(view);
    try {
      await navigator.clipboard.writeText(text);
    } catch {
      // No clipboard API (a page not served over https or from localhost): select the text.
      const area = el("textarea", "copy-buffer");
      area.value = text;
      document.body.append(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    node.textContent = "copied";
    node.dataset.copied = "true";
    setTimeout(() => {
      node.textContent = "copy reply";
      delete node.dataset.copied;
    }, 1500);
  }

  // A new attempt replays the round that was streaming when the previous worker was lost:
  // its second round.started supersedes what the page showed of that round.
  function startRound(view, data) {
    const round = roundOf(view, data.round);
    const prev = view.current;
    if (prev && prev !== round && prev.endedAt === null && prev.startedAt !== null) {
      prev.endedAt = data.at || null;
      renderStats(prev);
    }
    if (round.started) {
      round.replayedBy = view.attemptNumber;
      round.node.dataset.replayedBy = String(view.attemptNumber);
      round.tokens = null;
    }
    if (round.started && !view.past) {
      for (const later of [...view.rounds.values()].filter((r) => r.n > round.n)) {
        later.node.remove();
        view.rounds.delete(later.n);
      }
      round.body.replaceChildren();
      round.text = "";
      round.textBlock = null;
      if (view.attemptNote) {
        view.attemptNote.textContent = `${attemptCause(view)}; round ${round.n} plays again, `
          + "its text replaces what was shown";
        round.node.before(view.attemptNote);
      }
    }
    if (!round.started) round.usageBase = view.cumulative;
    round.started = true;
    round.startedAt = data.at || null;
    round.endedAt = null;
    view.current = round;
    renderStats(round);
  }

  function renderStats(round) {
    const parts = [`round ${round.n}`];
    if (round.startedAt && round.endedAt) parts.push(fmtSeconds(round.endedAt - round.startedAt));
    if (round.tokens) parts.push(`${round.tokens.in.toLocaleString()} in · ${round.tokens.out.toLocaleString()} out tokens`);
    if (round.replayedBy) parts.push(`played again by attempt ${round.replayedBy}`);
    round.stats.textContent = parts.join(" · ");
    round.stats.hidden = parts.length === 1;
  }

  function onUsage(view, data) {
    const now = { in: data.inputTokens || 0, out: data.outputTokens || 0 };
    const round = view.current;
    if (round) {
      const base = round.usageBase || { in: 0, out: 0 };
      round.tokens = { in: now.in - base.in, out: now.out - base.out };
      renderStats(round);
    }
    view.cumulative = now;
    showUsage(view, data);
  }

  function showUsage(view, usage) {
    const cache = (usage.cacheReadTokens || 0) + (usage.cacheWriteTokens || 0);
    view.usage.textContent = `${usage.inputTokens || 0} in · ${usage.outputTokens || 0} out tokens`
      + (cache ? ` · ${usage.cacheReadTokens || 0} cache read, ${usage.cacheWriteTokens || 0} written` : "");
  }

  // Why a new attempt runs, as its turn.started says: the worker lost Redis for a
  // while (the same worker, no worker lost), else a worker was lost. (An attempt that
  // resumes an answered pause, after: "answered", is no new attempt: applyEvent.)
  function attemptCause(view) {
    const why = view.attemptAfter || {};
    if (why.after === "redis_lost") {
      return `attempt ${view.attemptNumber}: the worker lost Redis for ${Math.round((why.redisLostMs || 0) / 1000)} s`;
    }
    return `attempt ${view.attemptNumber} after a worker was lost`;
  }

  function noteAttempt(view, attempt, data) {
    view.attemptNumber = attempt;
    view.attemptAfter = data;
    view.attempt.textContent = `attempt ${attempt}`;
    view.section.dataset.attempt = String(attempt);
    view.section.dataset.attemptAfter = data.after || "";
    if (view.past) return;
    const note = el("div", "divider warn attempt-note", attemptCause(view));
    if (view.attemptNote) view.attemptNote.remove();
    view.attemptNote = note;
    view.reply.append(note);
  }

  // round.waiting: the model's rate limit holds the round before any of its text. The
  // note counts down the server's estimate (from when the page got it: the worker's
  // clock is not the browser's) and goes with the round's next event of any kind.
  const WAITING_WHY = {
    rate_limited: "waiting for the model's rate limit",
    overloaded: "waiting: the model is overloaded",
  };

  function showWaiting(view, data) {
    clearWaiting(view);
    const why = WAITING_WHY[data.reason] || `waiting for the model (${data.reason || "busy"})`;
    const node = el("div", "divider warn waiting");
    node.dataset.reason = String(data.reason || "");
    const until = Date.now() + Math.max(0, Number(data.waitMs) || 0);
    const render = () => {
      const left = Math.ceil((until - Date.now()) / 1000);
      node.textContent = left > 0 ? `${why} · retrying in ${left} s` : `${why} · retrying…`;
    };
    render();
    roundOf(view, data.round).body.append(node);
    view.section.dataset.waiting = node.dataset.reason;
    view.waiting = { node, timer: setInterval(render, 1000) };
  }

  function clearWaiting(view) {
    if (!view.waiting) return;
    clearInterval(view.waiting.timer);
    view.waiting.node.remove();
    view.waiting = null;
    delete view.section.dataset.waiting;
  }

  // ---------------------------------------------------------------- pending calls
  // turn.requires_action: the turn waits, holding no worker, until every call it lists is
  // answered in one request (POST …/actions). A client call (kind "client") gets a form
  // for its result; an approval (kind "approval") Approve / Edit / Reject. Each form sits
  // in its call's tool box; one Submit under the round sends them all. The answers'
  // tool.result events settle the forms, and the turn.started that resumes the turn
  // (after: "answered") clears them.

  function showPending(view, round, calls) {
    clearPending(view);
    if (view.past || !calls.length) return;
    const bar = el("div", "pending-actions");
    const what = calls.length === 1 ? "1 call waits" : `${calls.length} calls wait`;
    const error = el("div", "pending-error");
    error.hidden = true;
    const submit = button("pending-submit", "Submit", () => submitPending(view));
    bar.append(el("span", "pending-summary", `${what} for your answer`), submit, error);
    const pending = {
      round, bar, submit, error, entries: [], key: null, sentBody: null, sending: false,
    };
    view.pending = pending;
    for (const call of calls) {
      let box = view.calls.get(call.callId);
      if (!box) {
        box = toolBox(call.name, call.input);
        box.dataset.callId = call.callId;
        view.calls.set(call.callId, box);
        roundOf(view, round).body.append(box);
      }
      const entry = call.kind === "approval" ? approvalForm(call) : clientForm(call);
      entry.box = box;
      box.classList.add("pending");
      box.dataset.kind = call.kind || "client";
      box.append(entry.node);
      pending.entries.push(entry);
    }
    roundOf(view, round).body.append(bar);
    view.section.dataset.pending = String(calls.length);
    setTurnStatus(view, REQUIRES_ACTION_TEXT, STATUS.requires_action);
    if (state.turn === view) {
      setStreamState("live", "live · waiting for your answer");
      refreshSessions().catch(() => {}); // its "waiting for your answer" marker
    }
  }

  function clientForm(call) {
    const node = el("div", "pending-call");
    node.dataset.callId = call.callId;
    const output = el("textarea", "pending-output");
    output.rows = 3;
    output.placeholder = `The result of ${call.name}`;
    output.setAttribute("aria-label", `Result of ${call.name}`);
    const errorLabel = el("label", "pending-is-error");
    const isError = el("input");
    isError.type = "checkbox";
    errorLabel.append(isError, " error");
    node.append(el("span", "tool-tag", "your result"), output, errorLabel);
    const inputs = [output, isError];
    return {
      call, node, inputs,
      answer: () => ({ callId: call.callId, output: output.value, isError: isError.checked }),
    };
  }

  function approvalForm(call) {
    const node = el("div", "pending-call approval");
    node.dataset.callId = call.callId;
    const edited = el("textarea", "pending-input");
    edited.rows = 4;
    edited.value = JSON.stringify(call.input || {}, null, 2);
    edited.setAttribute("aria-label", `Input for ${call.name}`);
    edited.hidden = true;
    const reason = el("input", "pending-reason");
    reason.placeholder = "Why (the model sees this)";
    reason.setAttribute("aria-label", `Reason to reject ${call.name}`);
    reason.hidden = true;
    const entry = { call, node, decision: null, inputs: [edited, reason], buttons: [] };
    const choose = (decision) => {
      entry.decision = decision;
      node.dataset.decision = decision;
      for (const b of entry.buttons) b.setAttribute("aria-pressed", String(b.dataset.decision === decision));
      edited.hidden = decision !== "edit";
      reason.hidden = decision !== "reject";
    };
    for (const [decision, label] of [["approve", "Approve"], ["edit", "Edit"], ["reject", "Reject"]]) {
      const b = button(`decision ${decision}`, label, () => choose(decision));
      b.dataset.decision = decision;
      b.setAttribute("aria-pressed", "false");
      entry.buttons.push(b);
      entry.inputs.push(b);
    }
    const row = el("div", "decisions");
    row.append(...entry.buttons);
    node.append(el("span", "tool-tag", "needs your approval"), row, edited, reason);
    entry.answer = () => {
      if (!entry.decision) throw new Error(`Approve, edit or reject ${call.name} first.`);
      const answer = { callId: call.callId, decision: entry.decision };
      if (entry.decision === "edit") {
        let input;
        try {
          input = JSON.parse(edited.value);
        } catch (error) {
          throw new Error(`The input for ${call.name} is not JSON: ${error.message}`);
        }
        if (!input || typeof input !== "object" || Array.isArray(input)) {
          throw new Error(`The input for ${call.name} must be a JSON object.`);
        }
        answer.input = input;
      }
      if (entry.decision === "reject" && reason.value.trim()) answer.reason = reason.value.trim();
      return answer;
    };
    return entry;
  }

  function setPendingBusy(pending, busy) {
    pending.sending = busy;
    pending.submit.disabled = busy;
    pending.submit.textContent = busy ? "submitting…" : "Submit";
    for (const entry of pending.entries) for (const input of entry.inputs) input.disabled = busy;
  }

  async function submitPending(view) {
    const pending = view.pending;
    if (!pending || pending.sending) return;
    const toolResults = [];
    const approvals = [];
    try {
      for (const entry of pending.entries) {
        (entry.call.kind === "approval" ? approvals : toolResults).push(entry.answer());
      }
    } catch (error) {
      pending.error.hidden = false;
      pending.error.textContent = error.message;
      return;
    }
    const body = {};
    if (toolResults.length) body.toolResults = toolResults;
    if (approvals.length) body.approvals = approvals;
    // The same answer sent again (its response lost) repeats under its key; another one
    // gets a key of its own.
    const text = JSON.stringify(body);
    if (text !== pending.sentBody) {
      pending.key = randomKey();
      pending.sentBody = text;
    }
    pending.error.hidden = true;
    setPendingBusy(pending, true);
    try {
      await api("POST", `${view.path}/actions`, body, { "Idempotency-Key": pending.key });
    } catch (error) {
      if (view.pending !== pending) return;
      setPendingBusy(pending, false);
      pending.error.hidden = false;
      if (error instanceof ApiError) setMessage(pending.error, `${error.code}: ${error.message}`);
      else pending.error.textContent = `Not sent: ${error.message}`;
      return;
    }
    if (view.pending !== pending) return; // the stream already moved on
    pending.submit.textContent = "answered · resuming…";
    pending.bar.dataset.answered = "true";
    setTurnStatus(view, STATUS.queued, STATUS.queued);
  }

  // The answer's tool.result for one call: its form goes.
  function settlePending(view, callId) {
    const pending = view.pending;
    if (!pending) return;
    const entry = pending.entries.find((e) => e.call.callId === callId);
    if (!entry) return;
    entry.node.remove();
    entry.box.classList.remove("pending");
    pending.entries = pending.entries.filter((e) => e !== entry);
    if (!pending.entries.length) pending.bar.remove();
  }

  function clearPending(view) {
    const pending = view.pending;
    if (!pending) return;
    for (const entry of pending.entries) {
      entry.node.remove();
      entry.box.classList.remove("pending");
    }
    pending.bar.remove();
    view.pending = null;
    delete view.section.dataset.pending;
  }

  // The events that said what the turn waits on expired: its record still lists the calls.
  async function pendingFromRecord(view) {
    try {
      const record = await (await api("GET", view.path)).json();
      if (record.status === STATUS.requires_action && record.pendingCalls && !view.ended && !view.pending) {
        showPending(view, view.current ? view.current.n : 1, record.pendingCalls);
      }
    } catch {
      // the stream says how the turn goes on
    }
  }

  const REQUIRES_ACTION_TEXT = "requires action: waiting for your answer";

  function statusText(type, data) {
    const status = type.replace("turn.", "");
    if (type === "turn.timed_out" && data.reason === REASON.action_timeout) return "timed_out: no answer in time";
    if (type === "turn.failed") return `failed: ${data.reason}${data.message ? ` (${data.message})` : ""}`;
    if (type === "turn.cancelled" && data.reason === REASON.interrupted) return "cancelled (interrupted)";
    if (type === "turn.completed" && data.stopReason && data.stopReason !== "end_turn") {
      return `completed (${data.stopReason})`;
    }
    return status;
  }

  function setTurnStatus(view, text, status) {
    view.status.textContent = text;
    view.section.dataset.status = status || text.split(" ")[0];
  }

  // One event of a turn, live or read back for a past turn. A past turn's text and tool
  // boxes come from the history; its events add the rounds' latency and tokens.
  function applyEvent(view, type, data, id) {
    logEvent(view, type, id, data);
    if (type !== "round.waiting") clearWaiting(view);
    switch (type) {
      case "turn.queued":
        if (!view.past) setTurnStatus(view, STATUS.queued);
        break;
      case "turn.started":
        if (view.firstAt === null) view.firstAt = data.at || null;
        if (data.after === "answered") {
          // The attempt that an answer started: the turn resumes at its next round.
          clearPending(view);
          view.resumes += 1;
          view.attemptNumber = data.attempt;
          if (!view.past) view.reply.append(el("div", "divider resumed", "resumed with your answer"));
        } else if (data.attempt - view.resumes > 1) {
          noteAttempt(view, data.attempt, data);
        }
        if (!view.past) {
          const replayed = data.attempt - view.resumes > 1;
          setTurnStatus(view, replayed ? `${STATUS.running} (attempt ${data.attempt})` : STATUS.running);
        }
        break;
      case "turn.requires_action":
        showPending(view, data.round, data.calls || []);
        break;
      case "round.started":
        startRound(view, data);
        break;
      case "round.waiting":
        if (!view.past) showWaiting(view, data);
        break;
      case "text.delta":
        if (!view.past) addText(view, data.round, data.text);
        else keepStreamedText(view, data.round, data.text);
        break;
      case "tool.call":
        if (!view.past) {
          const box = toolBox(data.name, data.input);
          box.dataset.callId = data.callId;
          view.calls.set(data.callId, box);
          roundOf(view, data.round).body.append(box);
        }
        break;
      case "tool.result":
        if (!view.past) {
          let box = view.calls.get(data.callId);
          if (!box) {
            box = toolBox(data.name, {});
            roundOf(view, data.round).body.append(box);
          }
          addToolResult(box, data.output, data.isError, data.truncated, data.durationMs);
          settlePending(view, data.callId);
        }
        break;
      case "working_notes":
        if (!view.past) onNotesEvent();
        break;
      case "usage":
        onUsage(view, data);
        break;
      case "resync":
        if (!view.past) {
          view.reply.append(el("div", "divider warn",
            "some events of this turn expired before they could be shown"));
          refreshNotes();
          pendingFromRecord(view);
        }
        break;
      default:
        if (TERMINAL.has(type)) {
          const round = view.current;
          if (round && round.endedAt === null && round.startedAt !== null && data.at) {
            round.endedAt = data.at;
            renderStats(round);
          }
          setTurnStatus(view, statusText(type, data), type.replace("turn.", ""));
          if (data.reason) view.section.dataset.reason = data.reason;
          if (view.firstAt && data.at) view.timing.textContent = fmtSeconds(data.at - view.firstAt);
          if (view.past) showUnkeptText(view, type);
        }
    }
  }

  // A past turn's text comes from the history, which keeps only the rounds that were
  // committed: a round cut short (a cancel, a timeout) streamed text that is not there.
  // Its events still hold it for a while; it is shown from them, marked as not kept.
  function keepStreamedText(view, n, text) {
    if (!view.streamed) view.streamed = new Map();
    view.streamed.set(n, (view.streamed.get(n) || "") + text);
  }

  function showUnkeptText(view, type) {
    const ended = type === "turn.cancelled" ? STATUS.cancelled : type.replace("turn.", "").replace("_", " ");
    for (const [n, text] of view.streamed || []) {
      const round = roundOf(view, n);
      if (round.text || !text) continue;
      addText(view, n, text);
      round.node.dataset.unkept = ended;
      round.textBlock.classList.add("unkept");
      round.body.append(el("div", "divider warn unkept-note",
        `${ended} mid-round: this text streamed, but the history does not keep it, so the model will not see it`));
    }
    view.streamed = null;
  }

  function logEvent(view, type, id, data) {
    const item = el("li");
    item.dataset.type = type;
    if (id) item.dataset.eventId = id;
    // The event's raw JSON, on click.
    const raw = el("details", "event-raw");
    raw.append(el("summary", "", id ? `${type} · ${id}` : type));
    raw.addEventListener("toggle", () => {
      if (raw.open && raw.childElementCount === 1) {
        raw.append(el("pre", "event-json", JSON.stringify(data, null, 2)));
      }
    });
    item.append(raw);
    view.eventList.append(item);
  }

  function notesLine(name, input, output) {
    if (name === "working_notes_clear") return "cleared the working notes";
    if (name === "working_notes_update") {
      const notes = input && input.notes;
      if (typeof notes !== "string") return "updating the working notes";
      const m = NOTES_DIGEST.exec(notes);
      const size = m ? Number(m[1]) : new TextEncoder().encode(notes.trim()).length;
      return size ? `updated the working notes (${fmtBytes(size)})` : "cleared the working notes";
    }
    if (output === undefined) return "reading the working notes…";
    const m = NOTES_DIGEST.exec(output);
    if (m) return `read the working notes (${fmtBytes(Number(m[1]))})`;
    if (output.startsWith("(empty")) return "read the working notes (empty)";
    if (output === "(unavailable)") return "could not read the working notes (unavailable)";
    return `read the working notes (${fmtBytes(new TextEncoder().encode(output).length)})`;
  }

  function toolBox(name, input) {
    const box = el("div", "tool");
    box.dataset.tool = name;
    const head = el("div", "tool-head");
    head.append(el("span", "tool-tag", "tool call"), el("span", "tool-name", name));
    box.append(head);
    if (NOTES_TOOLS.has(name)) {
      // The notes' text is never in events or the history (a clear must leave no copy):
      // say what the tool did, and point at the panel that shows the notes.
      box.classList.add("notes-tool");
      box.dataset.input = JSON.stringify(input || {});
      const line = el("div", "notes-line");
      line.append(el("span", "notes-action", notesLine(name, input)), " · ",
        button("link notes-link", "see the notes panel", showNotesPanel));
      box.append(line);
    } else {
      box.append(el("pre", "tool-input", JSON.stringify(input || {}, null, 2)));
    }
    return box;
  }

  // A call's result: its output, whether it is an error, whether it was cut, and (live)
  // how long the call took.
  function addToolResult(box, output, isError, truncated, durationMs) {
    const name = box.dataset.tool;
    if (isError) box.classList.add("failed");
    if (name === "working_notes_get" && !isError) {
      box.querySelector(".notes-action").textContent = notesLine(name, {}, output);
      return;
    }
    const result = el("div", isError ? "tool-result error" : "tool-result");
    let label = isError ? "result (error)" : "result";
    if (truncated) label += ", truncated";
    if (typeof durationMs === "number") label += ` · ${durationMs} ms`;
    result.append(el("span", "tool-tag", label));
    result.append(el("pre", "", output));
    box.append(result);
  }

  function showNotesPanel() {
    const panel = $("notes-panel");
    panel.scrollIntoView({ block: "nearest", behavior: "smooth" });
    panel.classList.remove("flash");
    void panel.offsetWidth; // restart the animation
    panel.classList.add("flash");
    $("notes-text").focus();
  }

  // ---------------------------------------------------------------- history

  // Renders the session's history as one view per past turn (`skip`: a turn shown live).
  async function loadHistory(id, skip) {
    let messages;
    try {
      messages = (await (await api("GET", `${sessionPath(id)}/messages`)).json()).messages;
    } catch (error) {
      return report(error);
    }
    if (state.sessionId !== id) return;
    const blocksOf = (message) => (typeof message.content === "string"
      ? [{ type: "text", text: message.content }]
      : message.content || []);
    const views = [];
    let view = null;
    let rowRound = 0;
    for (const message of messages) {
      const turnId = message.turnId || (view ? view.id : "");
      if (turnId === skip) continue;
      if (!view || view.id !== turnId) {
        const prompt = message.kind === "prompt" || (message.role === "user" && !message.kind)
          ? blocksOf(message).filter((b) => b.type === "text").map((b) => b.text).join("")
          : null;
        view = turnView(id, turnId, prompt, true);
        views.push(view);
        rowRound = 0;
        if (prompt !== null) continue;
      }
      if (message.role === "user" && message.kind === "prompt") continue;
      const n = Number.isInteger(message.round) && message.round > 0 ? message.round : (rowRound += 1);
      for (const block of blocksOf(message)) {
        if (block.type === "text" && block.text && message.role === "assistant") {
          addText(view, n, block.text);
        } else if (block.type === "tool_use") {
          const box = toolBox(block.name, block.input);
          view.calls.set(block.id, box);
          roundOf(view, n).body.append(box);
        } else if (block.type === "tool_result") {
          const output = typeof block.content === "string"
            ? block.content
            : (block.content || []).map((b) => b.text || "").join("");
          const box = view.calls.get(block.tool_use_id);
          if (box) addToolResult(box, output, block.is_error, false);
        }
      }
    }
    const transcript = $("transcript");
    for (const past of views) transcript.append(past.section);
    if (views.length) transcript.append(el("div", "divider", "↑ earlier in this session"));
    transcript.scrollTop = transcript.scrollHeight;
    loadPastDetails(id, views.filter((v) => v.id).reverse());
  }

  // Each past turn's record (status, usage, timing), newest first; the events of the
  // newest few, the others' when their event list is opened.
  async function loadPastDetails(id, views) {
    await Promise.all(views.slice(0, PAST_RECORDS).map(async (view, i) => {
      let record;
      try {
        record = await (await api("GET", view.path)).json();
      } catch (error) {
        if (error instanceof ApiError && error.status === 404) {
          setTurnStatus(view, "details expired", "expired");
          view.events.hidden = true;
        }
        return;
      }
      if (state.sessionId !== id) return;
      showRecord(view, record);
      if (i < PAST_EVENTS && TERMINAL_STATUSES.includes(record.status)) {
        await loadPastEvents(view);
      } else if (record.status === STATUS.cancelled && record.reason !== REASON.interrupted) {
        view.reply.append(el("div", "divider unkept-note",
          "cancelled: the text of the round it cut short is not kept in the history; its events hold it for a while"));
      }
    }));
  }

  function showRecord(view, record) {
    const type = `turn.${record.status}`;
    if (record.reason) view.section.dataset.reason = record.reason;
    const data = { reason: record.reason, message: record.error, stopReason: record.stopReason };
    const text = record.status === STATUS.requires_action ? REQUIRES_ACTION_TEXT : record.status;
    setTurnStatus(view, TERMINAL.has(type) ? statusText(type, data) : text, record.status);
    if (record.usage) showUsage(view, record.usage);
    if (record.startedAt && record.endedAt) view.timing.textContent = fmtSeconds(record.endedAt - record.startedAt);
    if (record.attempt - (record.resumes || 0) > 1) {
      view.attempt.textContent = `attempt ${record.attempt}`;
      view.section.dataset.attempt = String(record.attempt);
    }
  }

  async function loadPastEvents(view) {
    if (view.eventsRequested) return;
    view.eventsRequested = true;
    let text;
    try {
      const response = await api("GET", `${view.path}/events`);
      text = response.status === 204 ? "" : await response.text();
    } catch (error) {
      view.eventList.append(el("li", "muted", `events unavailable (${error.message})`));
      return;
    }
    const status = view.status.textContent;
    for (const event of parseSse(text)) {
      let data;
      try {
        data = JSON.parse(event.data);
      } catch {
        continue;
      }
      applyEvent(view, event.type, data, event.id);
    }
    if (status) view.status.textContent = status; // the record's words, with its error
    view.section.dataset.eventsLoaded = "true";
  }

  // A whole, finished SSE response: [{id, type, data}], comments skipped.
  function parseSse(text) {
    const events = [];
    let event = { id: "", type: "message", data: [] };
    for (const line of text.split(/\r\n|\r|\n/)) {
      if (!line) {
        if (event.data.length) events.push({ id: event.id, type: event.type, data: event.data.join("\n") });
        event = { id: "", type: "message", data: [] };
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "id") event.id = value;
      else if (field === "event") event.type = value;
      else if (field === "data") event.data.push(value);
    }
    return events;
  }

  // ---------------------------------------------------------------- live turns

  // While a turn runs, Send interrupts it (the new turn starts next) and Queue waits
  // for it; otherwise a send is refused if another client's turn runs.
  async function sendTurn(message, queue) {
    const id = state.sessionId;
    const running = state.turn && !state.turn.ended ? state.turn : null;
    const multitask = running ? (queue ? "enqueue" : "interrupt") : "reject";
    let accepted;
    try {
      const response = await api("POST", `${sessionPath(id)}/turns`, { message, multitask });
      accepted = await response.json();
    } catch (error) {
      if (error instanceof ApiError && error.code === "session_busy") {
        notice(`This session is busy with turn ${error.detail.activeTurnId}; wait or cancel it.`);
      } else {
        report(error);
      }
      return false;
    }
    refreshSessions().catch(() => {}); // its active-turn marker
    if (state.sessionId !== id) return true;
    attachTurn(accepted.turnId, message);
    if (running) followToEnd(running).catch(() => {});
    return true;
  }

  // A turn no longer followed live (a send interrupted it or queued behind it): its end
  // is read from its record.
  async function followToEnd(view) {
    for (let delay = 100; ; delay = Math.min(delay * 2, 2000)) {
      await new Promise((resolve) => setTimeout(resolve, delay));
      const record = await (await api("GET", view.path)).json();
      if (TERMINAL_STATUSES.includes(record.status)) {
        view.ended = true;
        showRecord(view, record);
        return;
      }
    }
  }

  function attachTurn(turnId, message) {
    closeTurnStream();
    const view = turnView(state.sessionId, turnId, message, false);
    $("transcript").append(view.section);
    state.turn = Object.assign(view, {
      es: null, seen: new Set(), duplicates: 0, lastId: null,
      ended: false, retry: 0, retryTimer: null,
    });
    setComposer(true);
    openTurnStream(state.turn);
  }

  function openTurnStream(turn) {
    if (turn.ended || state.turn !== turn) return;
    // A fresh EventSource resumes with ?after=; one that reconnects by itself sends Last-Event-ID.
    const es = new EventSource(streamUrl(`${turn.path}/events`, turn.lastId));
    turn.es = es;
    setStreamState(turn.lastId ? "reconnecting" : "connecting",
      turn.lastId ? `reconnecting · resuming from ${turn.lastId}…` : "connecting…");
    es.onopen = () => {
      turn.retry = 0;
      setStreamState("live", turn.lastId ? `live · resumed after ${turn.lastId}` : "live");
    };
    es.onerror = () => {
      if (turn.ended || state.turn !== turn || turn.es !== es) return;
      probe(); // says why: the gateway is gone, or it cannot reach Redis
      if (es.readyState === EventSource.CONNECTING) {
        setStreamState("reconnecting", dropText(turn, "connection lost"));
        return;
      }
      // The browser gave up (e.g. an error status): reconnect ourselves, with backoff.
      setStreamState("reconnecting", dropText(turn, "connection closed"));
      scheduleTurnRetry(turn);
    };
    for (const type of TURN_TYPES) {
      es.addEventListener(type, (event) => onTurnEvent(turn, type, event));
    }
  }

  function dropText(turn, why) {
    const from = turn.lastId ? ` from ${turn.lastId}` : "";
    return `reconnecting · stream dropped (${why}) · resuming${from}…`;
  }

  function scheduleTurnRetry(turn) {
    if (turn.es) turn.es.close();
    turn.es = null;
    const delay = Math.min(1000 * 2 ** turn.retry, 15000);
    turn.retry += 1;
    clearTimeout(turn.retryTimer);
    turn.retryTimer = setTimeout(async () => {
      if (turn.ended || state.turn !== turn) return;
      try {
        // Ask for the record first: a turn that is gone would answer 404 forever.
        await api("GET", turn.path);
      } catch (error) {
        if (error instanceof ApiError && error.status === 404) {
          return endTurn(turn, "turn.failed", { reason: "gone", message: "the turn no longer exists" });
        }
        if (error instanceof ApiError && error.status !== 503) return report(error);
        return scheduleTurnRetry(turn); // still unreachable; the outage state says why
      }
      openTurnStream(turn);
    }, delay);
  }

  function onTurnEvent(turn, type, event) {
    if (turn.ended || state.turn !== turn) return;
    let data;
    try {
      data = JSON.parse(event.data);
    } catch {
      return;
    }
    let id = NO_ID.has(type) ? "" : event.lastEventId;
    // A terminal event rebuilt from the turn record (its stream expired) has no id of its
    // own: EventSource repeats the previous one. It is shown once, as the turn ends.
    if (TERMINAL.has(type) && turn.seen.has(id)) id = "";
    if (TERMINAL.has(type) && id) turn.seen.add(id);
    if (!NO_ID.has(type) && !TERMINAL.has(type)) {
      if (!id) return;
      if (turn.seen.has(id)) {
        // Shown once already (a replay after a reconnect): count it, show it no more.
        turn.duplicates += 1;
        turn.section.dataset.duplicates = String(turn.duplicates);
        return;
      }
      turn.seen.add(id);
    }
    if (id) turn.lastId = id;
    if (type === "stream.dropped") {
      logEvent(turn, type, id, data);
      setStreamState("reconnecting", dropText(turn, data.reason || "dropped"));
      return;
    }
    applyEvent(turn, type, data, id);
    if (["text.delta", "tool.call", "tool.result"].includes(type)) scrollDown();
    if (TERMINAL.has(type)) endTurn(turn, type, data);
  }

  function endTurn(turn, type, data) {
    turn.ended = true;
    clearWaiting(turn);
    clearPending(turn);
    clearTimeout(turn.retryTimer);
    if (turn.es) turn.es.close();
    turn.es = null;
    setTurnStatus(turn, statusText(type, data), type.replace("turn.", ""));
    setStreamState("ended", `turn ${type.replace("turn.", "")}`);
    setComposer(true);
    if ($("system-panel").open) refreshSystem();
    refreshSessions().catch(() => {}); // its updatedAt, notes size, no active turn
  }

  function closeTurnStream() {
    const turn = state.turn;
    if (!turn) return;
    clearWaiting(turn);
    clearTimeout(turn.retryTimer);
    if (turn.es) turn.es.close();
    turn.es = null;
    state.turn = null;
  }

  async function cancelTurn() {
    const turn = state.turn;
    if (!turn || turn.ended) return;
    $("cancel").disabled = true;
    try {
      await api("POST", `${turn.path}/cancel`);
      if (!turn.ended) turn.status.textContent = "cancelling…";
    } catch (error) {
      report(error);
      $("cancel").disabled = false;
    }
  }

  function scrollDown() {
    const transcript = $("transcript");
    transcript.scrollTop = transcript.scrollHeight;
  }

  // Between a send and the server's answer (seconds while it cannot reach Redis), the
  // button says so at once.
  function showSending(sending) {
    const button = $("send");
    button.textContent = sending ? "sending…" : "Send";
    button.dataset.sending = String(sending);
    if (sending) button.disabled = true;
  }

  function setComposer(enabled) {
    const running = Boolean(state.turn && !state.turn.ended);
    const open = enabled && Boolean(state.sessionId);
    $("message").disabled = !open;
    $("send").disabled = !open;
    $("send").title = running ? "Interrupt the running turn: this message goes next" : "";
    $("queue").hidden = !running;
    $("queue").disabled = !open || !running;
    $("cancel").disabled = !running;
  }

  // ---------------------------------------------------------------- notes and system

  function setNotes(notes, bytes) {
    const text = $("notes-text");
    const size = typeof bytes === "number" ? bytes : new TextEncoder().encode(notes || "").length;
    text.textContent = notes || "(no notes)";
    text.classList.toggle("empty", !notes);
    $("notes-meter").value = Math.min(size, NOTES_CAP);
    const label = $("notes-bytes");
    label.dataset.bytes = String(size);
    const percent = ((100 * size) / NOTES_CAP).toFixed(1);
    label.textContent = `${fmtBytes(size)} of ${fmtBytes(NOTES_CAP)} (${percent}%)`;
  }

  function onNotesEvent() {
    // Events carry only the notes' bytes and sha256, never their text: fetch it.
    clearTimeout(state.notesTimer);
    state.notesTimer = setTimeout(refreshNotes, 100);
  }

  async function refreshNotes() {
    const id = state.sessionId;
    if (!id) return;
    try {
      const body = await (await api("GET", `${sessionPath(id)}/notes`)).json();
      if (state.sessionId === id) setNotes(body.notes, body.bytes);
      updateRow(id, { notesBytes: body.bytes });
    } catch (error) {
      report(error);
    }
  }

  async function refreshSystem() {
    const id = state.sessionId;
    if (!id || !$("system-panel").open) return;
    try {
      const text = await (await api("GET", `${sessionPath(id)}/system`)).text();
      if (state.sessionId === id) $("system-text").textContent = text || "(empty system prompt)";
    } catch (error) {
      report(error);
    }
  }

  // ---------------------------------------------------------------- session log

  function followLog(id) {
    closeLog();
    const log = { es: null, lastId: null, retry: 0, timer: null, open: null };
    state.log = log;
    log.open = () => {
      if (state.log !== log) return;
      if (log.es) log.es.close();
      const es = new EventSource(streamUrl(`${sessionPath(id)}/events`, log.lastId));
      log.es = es;
      es.onopen = () => {
        log.retry = 0;
        if (!health.outage) setLogState("live");
      };
      es.onerror = () => {
        if (state.log !== log || log.es !== es) return;
        setLogState("reconnecting");
        probe();
        if (es.readyState === EventSource.CLOSED) {
          clearTimeout(log.timer);
          log.timer = setTimeout(log.open, Math.min(1000 * 2 ** log.retry++, 15000));
        }
      };
      for (const type of LOG_TYPES) {
        es.addEventListener(type, (event) => {
          if (event.lastEventId && !NO_ID.has(type)) log.lastId = event.lastEventId;
          let data;
          try {
            data = JSON.parse(event.data);
          } catch {
            return;
          }
          if (type === "stream.dropped") setLogState("reconnecting");
          const notesPatched = type === "envelope.patched"
            && Array.isArray(data.keys) && data.keys.includes("workingNotes");
          if (type === "working_notes" || type === "resync" || notesPatched) onNotesEvent();
          if (type === "envelope.patched" && data.set && typeof data.set.title === "string") {
            $("session-title").textContent = data.set.title || "untitled";
            updateRow(id, { title: data.set.title || null });
          }
        });
      }
    };
    log.open();
  }

  function closeLog() {
    const log = state.log;
    if (!log) return;
    clearTimeout(log.timer);
    if (log.es) log.es.close();
    state.log = null;
    setLogState("idle");
  }

  function setLogState(kind) {
    const node = $("log-state");
    node.dataset.state = kind;
    node.textContent = kind === "idle" ? "" : kind;
  }

  // ---------------------------------------------------------------- the sessions drawer

  // In a narrow window (console.css) the sessions list is a drawer over the page: the
  // Sessions button opens it; picking a session, the backdrop or Escape closes it.
  function setDrawer(open) {
    document.body.dataset.drawer = open ? "open" : "closed";
    $("sessions-toggle").setAttribute("aria-expanded", String(open));
  }

  function wireSessionsDrawer() {
    $("sessions-toggle").addEventListener("click", () => setDrawer(document.body.dataset.drawer !== "open"));
    $("drawer-backdrop").addEventListener("click", () => setDrawer(false));
    document.addEventListener("keydown", (event) => {
      if (event.key === "Escape" && document.body.dataset.drawer === "open") setDrawer(false);
    });
    // Opening or making a session from the drawer closes it, back to the conversation.
    $("session-list").addEventListener("click", (event) => {
      if (event.target.closest(".open")) setDrawer(false);
    });
    for (const form of ["new-session", "open-session"]) {
      $(form).addEventListener("submit", () => setDrawer(false));
    }
  }

  // ---------------------------------------------------------------- wiring

  function wire() {
    wireSessionsDrawer();
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const token = $("token-input").value.trim();
      $("token-input").value = "";
      if (useToken(token)) start();
    });
    $("token-forget").addEventListener("click", () => forgetToken(""));
    $("new-session").addEventListener("submit", (event) => {
      event.preventDefault();
      const title = $("new-title").value.trim();
      $("new-title").value = "";
      createSession(title).catch(report);
    });
    $("open-session").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = $("open-id").value.trim();
      $("open-id").value = "";
      if (id) openSession(id).catch(report);
    });
    $("sessions-more").addEventListener("click", () => moreSessions().catch(report));
    const submitComposer = async (queue) => {
      const box = $("message");
      const message = box.value;
      if (!message.trim() || !state.sessionId) return;
      notice("");
      showSending(true);
      try {
        if (await sendTurn(message, queue)) box.value = "";
      } finally {
        showSending(false);
      }
      setComposer(true);
    };
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      submitComposer(false).catch(report);
    });
    $("queue").addEventListener("click", () => submitComposer(true).catch(report));
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("cancel").addEventListener("click", cancelTurn);
    $("system-panel").addEventListener("toggle", refreshSystem);
    $("system-refresh").addEventListener("click", refreshSystem);
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState !== "visible" || !state.token) return;
      probe();
      refreshSessions().catch(() => {}); // sessions made elsewhere meanwhile
    });
  }

  async function start() {
    startProbing();
    resetSessions();
    await refreshSessions();
    if (state.sessionId) return;
    // This tab's session again after a reload, else the newest; one gone since is skipped.
    const saved = sessionStorage.getItem(OPEN_KEY);
    if (saved && (await openSession(saved))) return;
    notice("");
    const first = listed.rows[0];
    if (first) await openSession(first.sessionId);
  }

  wire();
  takeFragmentToken();
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved && useToken(saved)) start().catch(report);
  else showTokenPanel("");
})();
