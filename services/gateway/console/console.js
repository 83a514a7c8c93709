// turnbus console: plain JS, no build step. Model and user text only ever goes
// into the page through textContent, never parsed as markup.
"use strict";

(() => {
  const NOTES_CAP = 32 * 1024;
  const TOKEN_KEY = "turnbus.token";
  const TERMINAL = new Set(["turn.completed", "turn.failed", "turn.cancelled", "turn.timed_out"]);
  const TURN_TYPES = [
    "turn.queued", "turn.started", "round.started", "text.delta", "tool.call", "tool.result",
    "working_notes", "usage", "turn.completed", "turn.failed", "turn.cancelled",
    "turn.timed_out", "resync", "stream.dropped",
  ];
  const LOG_TYPES = ["working_notes", "envelope.patched", "resync", "stream.dropped"];
  // Events the gateway sends without an `id:` line; EventSource then reports the
  // previous id in lastEventId, so these must not go through the duplicate check.
  const NO_ID = new Set(["resync", "stream.dropped"]);

  const state = {
    token: null,
    user: null,
    sessionId: null,
    turn: null, // the turn being shown live: see startTurnView()
    log: null, // the session log follower: {es, retry}
    notesTimer: null,
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

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
    error.textContent = message || "";
    $("token-input").focus();
  }

  function forgetToken(message) {
    closeTurnStream();
    closeLog();
    sessionStorage.removeItem(TOKEN_KEY);
    state.token = null;
    state.user = null;
    state.sessionId = null;
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

  async function api(method, path, body) {
    const init = { method, headers: { Authorization: `Bearer ${state.token}` } };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    if (method === "POST" && path.endsWith("/turns")) init.headers["Idempotency-Key"] = randomKey();
    const response = await fetch(path, init);
    if (!response.ok) {
      let detail = { code: `http_${response.status}`, message: response.statusText };
      try {
        detail = (await response.json()).error || detail;
      } catch {
        // not JSON: keep the status line
      }
      if (response.status === 401) forgetToken(`The gateway refused the token: ${detail.message}`);
      throw new ApiError(response.status, detail);
    }
    return response;
  }

  function randomKey() {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  const sessionPath = (id) => `/v1/sessions/${encodeURIComponent(id)}`;

  function streamUrl(path, after) {
    const query = new URLSearchParams({ access_token: state.token });
    if (after) query.set("after", after);
    return `${path}?${query}`;
  }

  function notice(message) {
    const node = $("notice");
    node.hidden = !message;
    node.textContent = message || "";
  }

  function report(error) {
    if (error instanceof ApiError) notice(`${error.code}: ${error.message}`);
    else notice(`Network error: ${error.message}`);
  }

  // ---------------------------------------------------------------- sessions
  // There is no server route listing a user's sessions (every key is per session, and a
  // per-user index would span cluster slots), so the list is kept in this browser.

  const listKey = () => `turnbus.sessions.${state.user}`;

  function storedSessions() {
    try {
      const list = JSON.parse(localStorage.getItem(listKey()) || "[]");
      return Array.isArray(list) ? list.filter((s) => s && typeof s.id === "string") : [];
    } catch {
      return [];
    }
  }

  function saveSessions(list) {
    list.sort((a, b) => (b.updatedAt || 0) - (a.updatedAt || 0));
    localStorage.setItem(listKey(), JSON.stringify(list));
    renderSessions();
  }

  function remember(envelope) {
    const list = storedSessions().filter((s) => s.id !== envelope.sessionId);
    list.push({
      id: envelope.sessionId,
      title: (envelope.meta && envelope.meta.title) || "",
      updatedAt: envelope.updatedAt,
    });
    saveSessions(list);
  }

  function forget(id) {
    saveSessions(storedSessions().filter((s) => s.id !== id));
  }

  function renderSessions() {
    const list = $("session-list");
    list.replaceChildren();
    for (const session of storedSessions()) {
      const item = el("li", session.id === state.sessionId ? "active" : "");
      item.dataset.sessionId = session.id;
      const open = el("button", "open");
      open.type = "button";
      open.append(el("span", "title", session.title || "untitled"));
      open.append(el("span", "meta", `${session.id} · ${when(session.updatedAt)}`));
      open.addEventListener("click", () => openSession(session.id));
      const remove = el("button", "delete", "×");
      remove.type = "button";
      remove.title = "Delete this session";
      remove.setAttribute("aria-label", `Delete session ${session.title || session.id}`);
      remove.addEventListener("click", () => deleteSession(session.id));
      item.append(open, remove);
      list.append(item);
    }
  }

  function when(ms) {
    return typeof ms === "number" ? new Date(ms).toLocaleString() : "";
  }

  async function refreshSessions() {
    const list = storedSessions();
    const fresh = await Promise.all(
      list.map(async (s) => {
        try {
          const envelope = await (await api("GET", sessionPath(s.id))).json();
          return { id: s.id, title: envelope.meta.title || "", updatedAt: envelope.updatedAt };
        } catch (error) {
          return error instanceof ApiError && error.status === 404 ? null : s;
        }
      }),
    );
    saveSessions(fresh.filter(Boolean));
  }

  async function createSession(title) {
    const body = title ? { meta: { title } } : {};
    const envelope = await (await api("POST", "/v1/sessions", body)).json();
    remember(envelope);
    await openSession(envelope.sessionId);
  }

  async function deleteSession(id) {
    if (!confirm(`Delete session ${id} and everything in it?`)) return;
    try {
      await api("DELETE", sessionPath(id));
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 404)) return report(error);
    }
    forget(id);
    if (state.sessionId === id) clearSession();
  }

  function clearSession() {
    closeTurnStream();
    closeLog();
    state.sessionId = null;
    $("session-title").textContent = "No session open";
    $("session-id").textContent = "";
    $("transcript").replaceChildren();
    setNotes(null, 0);
    $("system-text").textContent = "";
    setComposer(false);
    setStreamState("idle", "idle");
    renderSessions();
  }

  async function openSession(id) {
    clearSession();
    notice("");
    let envelope;
    try {
      envelope = await (await api("GET", sessionPath(id))).json();
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) forget(id);
      return report(error);
    }
    state.sessionId = id;
    remember(envelope);
    $("session-title").textContent = envelope.meta.title || "untitled";
    $("session-id").textContent = id;
    setComposer(true);
    // A turn still running (e.g. after a reload) is shown live from its first event, so
    // the history stops before that turn's prompt.
    const running = await runningTurn(id, envelope.meta);
    await Promise.all([
      loadHistory(id, running ? running.message : null), refreshNotes(), refreshSystem(),
    ]);
    followLog(id);
    if (running && state.sessionId === id) attachTurn(running.turnId, running.message || "");
  }

  async function runningTurn(id, meta) {
    if (!meta.turnRunId || meta.turnStatus !== "running") return null;
    try {
      const path = `${sessionPath(id)}/turns/${encodeURIComponent(meta.turnRunId)}`;
      const record = await (await api("GET", path)).json();
      return ["queued", "running"].includes(record.status) ? record : null;
    } catch {
      return null; // expired or gone: nothing to follow
    }
  }

  // ---------------------------------------------------------------- history

  // Renders the session's history; `until` (a prompt) stops it at that prompt's last copy.
  async function loadHistory(id, until) {
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
    let stop = messages.length;
    if (until) {
      for (let i = messages.length - 1; i >= 0; i -= 1) {
        const isPrompt = (b) => b.type === "text" && b.text === until;
        if (messages[i].role === "user" && blocksOf(messages[i]).some(isPrompt)) {
          stop = i;
          break;
        }
      }
    }
    const transcript = $("transcript");
    const calls = new Map();
    for (const message of messages.slice(0, stop)) {
      for (const block of blocksOf(message)) {
        if (block.type === "text" && block.text) {
          const cls = message.role === "user" ? "bubble user" : "text assistant";
          transcript.append(el("div", `${cls} past`, block.text));
        } else if (block.type === "tool_use") {
          const box = toolBox(block.name, block.input);
          calls.set(block.id, box);
          transcript.append(box);
        } else if (block.type === "tool_result") {
          const output = typeof block.content === "string"
            ? block.content
            : (block.content || []).map((b) => b.text || "").join("");
          const box = calls.get(block.tool_use_id);
          if (box) addToolResult(box, output, block.is_error, false);
        }
      }
    }
    if (stop) transcript.append(el("div", "divider", "↑ earlier in this session"));
    transcript.scrollTop = transcript.scrollHeight;
  }

  function toolBox(name, input) {
    const box = el("div", "tool");
    const head = el("div", "tool-head");
    head.append(el("span", "tool-tag", "tool call"), el("span", "tool-name", name));
    box.append(head, el("pre", "tool-input", JSON.stringify(input || {}, null, 2)));
    return box;
  }

  function addToolResult(box, output, isError, truncated) {
    const result = el("div", isError ? "tool-result error" : "tool-result");
    const label = isError ? "result (error)" : "result";
    result.append(el("span", "tool-tag", truncated ? `${label}, truncated` : label));
    result.append(el("pre", "", output));
    box.append(result);
  }

  // ---------------------------------------------------------------- turns

  async function sendTurn(message) {
    const id = state.sessionId;
    let accepted;
    try {
      const response = await api("POST", `${sessionPath(id)}/turns`, { message, multitask: "reject" });
      accepted = await response.json();
    } catch (error) {
      if (error instanceof ApiError && error.code === "session_busy") {
        notice(`This session is busy with turn ${error.detail.activeTurnId}; wait or cancel it.`);
      } else {
        report(error);
      }
      return false;
    }
    if (state.sessionId !== id) return true;
    attachTurn(accepted.turnId, message);
    return true;
  }

  function attachTurn(turnId, message) {
    closeTurnStream();
    const view = el("section", "turn");
    view.dataset.turnId = turnId;
    view.dataset.status = "queued";
    view.dataset.duplicates = "0";
    if (message !== null) view.append(el("div", "bubble user", message));
    const reply = el("div", "reply");
    const footer = el("div", "turn-footer");
    const status = el("span", "turn-status", "queued");
    const usage = el("span", "turn-usage");
    footer.append(status, usage);
    const events = el("details", "event-log");
    events.append(el("summary", "", "events"));
    const eventList = el("ol");
    events.append(eventList);
    view.append(reply, footer, events);
    $("transcript").append(view);
    state.turn = {
      id: turnId,
      sessionId: state.sessionId,
      path: `${sessionPath(state.sessionId)}/turns/${encodeURIComponent(turnId)}`,
      es: null,
      seen: new Set(),
      duplicates: 0,
      lastId: null,
      ended: false,
      retry: 0,
      retryTimer: null,
      view, reply, status, usage, eventList,
      calls: new Map(),
      textNode: null,
      textRound: null,
    };
    setComposer(true);
    openTurnStream(state.turn);
  }

  function openTurnStream(turn) {
    if (turn.ended || state.turn !== turn) return;
    // A fresh EventSource resumes with ?after=; one that reconnects by itself sends Last-Event-ID.
    const es = new EventSource(streamUrl(`${turn.path}/events`, turn.lastId));
    turn.es = es;
    setStreamState(turn.lastId ? "reconnecting" : "connecting",
      turn.lastId ? `reconnecting from ${turn.lastId}…` : "connecting…");
    es.onopen = () => {
      turn.retry = 0;
      setStreamState("live", turn.lastId ? `live · resumed after ${turn.lastId}` : "live");
    };
    es.onerror = () => {
      if (turn.ended || state.turn !== turn) return;
      if (es.readyState === EventSource.CONNECTING) {
        setStreamState("dropped", dropText(turn, "connection lost"));
        return;
      }
      // The browser gave up (e.g. an error status): reconnect ourselves, with backoff.
      setStreamState("dropped", dropText(turn, "connection closed"));
      scheduleTurnRetry(turn);
    };
    for (const type of TURN_TYPES) {
      es.addEventListener(type, (event) => onTurnEvent(turn, type, event));
    }
  }

  function dropText(turn, why) {
    const from = turn.lastId ? ` from ${turn.lastId}` : "";
    return `stream dropped (${why}) · resuming${from}…`;
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
        if (error instanceof ApiError) return report(error);
        return scheduleTurnRetry(turn); // the gateway is still unreachable
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
        turn.view.dataset.duplicates = String(turn.duplicates);
        return;
      }
      turn.seen.add(id);
    }
    if (id) turn.lastId = id;
    logEvent(turn, type, id);
    switch (type) {
      case "turn.queued":
        setTurnStatus(turn, "queued");
        break;
      case "turn.started":
        setTurnStatus(turn, data.attempt > 1 ? `running (attempt ${data.attempt})` : "running");
        break;
      case "round.started":
        turn.textNode = null;
        break;
      case "text.delta":
        appendText(turn, data.round, data.text);
        break;
      case "tool.call": {
        const box = toolBox(data.name, data.input);
        box.dataset.callId = data.callId;
        turn.calls.set(data.callId, box);
        turn.reply.append(box);
        turn.textNode = null;
        scrollDown();
        break;
      }
      case "tool.result": {
        let box = turn.calls.get(data.callId);
        if (!box) {
          box = toolBox(data.name, {});
          turn.reply.append(box);
        }
        addToolResult(box, data.output, data.isError, data.truncated);
        scrollDown();
        break;
      }
      case "working_notes":
        onNotesEvent();
        break;
      case "usage":
        turn.usage.textContent = `${data.inputTokens} in · ${data.outputTokens} out tokens`;
        break;
      case "resync":
        turn.reply.append(el("div", "divider warn",
          "some events of this turn expired before they could be shown"));
        refreshNotes();
        break;
      case "stream.dropped":
        setStreamState("dropped", dropText(turn, data.reason || "dropped"));
        break;
      default:
        if (TERMINAL.has(type)) endTurn(turn, type, data);
    }
  }

  function logEvent(turn, type, id) {
    const item = el("li", "", id ? `${type} · ${id}` : type);
    item.dataset.type = type;
    if (id) item.dataset.eventId = id;
    turn.eventList.append(item);
  }

  function appendText(turn, round, text) {
    if (!turn.textNode || turn.textRound !== round) {
      const block = el("div", "text assistant");
      turn.textNode = document.createTextNode("");
      turn.textRound = round;
      block.append(turn.textNode);
      turn.reply.append(block);
    }
    turn.textNode.appendData(text);
    scrollDown();
  }

  function setTurnStatus(turn, status) {
    turn.status.textContent = status;
    turn.view.dataset.status = status.split(" ")[0];
  }

  function endTurn(turn, type, data) {
    turn.ended = true;
    clearTimeout(turn.retryTimer);
    if (turn.es) turn.es.close();
    turn.es = null;
    const status = type.replace("turn.", "");
    let text = status;
    if (type === "turn.failed") text = `failed: ${data.reason}${data.message ? ` (${data.message})` : ""}`;
    if (type === "turn.completed" && data.stopReason && data.stopReason !== "end_turn") {
      text = `completed (${data.stopReason})`;
    }
    turn.status.textContent = text;
    turn.view.dataset.status = status;
    setStreamState("ended", `turn ${status}`);
    setComposer(true);
    if ($("system-panel").open) refreshSystem();
    api("GET", sessionPath(turn.sessionId))
      .then((r) => r.json())
      .then(remember)
      .catch(() => {});
  }

  function closeTurnStream() {
    const turn = state.turn;
    if (!turn) return;
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

  function setStreamState(kind, text) {
    const node = $("stream-state");
    node.dataset.state = kind;
    node.textContent = text;
    document.body.dataset.stream = kind;
  }

  function setComposer(enabled) {
    const running = Boolean(state.turn && !state.turn.ended);
    const open = enabled && Boolean(state.sessionId);
    $("message").disabled = !open || running;
    $("send").disabled = !open || running;
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
    label.textContent = `${size.toLocaleString()} B of 32 KiB (${percent}%)`;
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
    const log = { es: null, lastId: null, retry: 0, timer: null, started: false };
    state.log = log;
    const open = () => {
      if (state.log !== log) return;
      const es = new EventSource(streamUrl(`${sessionPath(id)}/events`, log.lastId));
      log.es = es;
      es.onopen = () => {
        log.retry = 0;
        setLogState("live");
      };
      es.onerror = () => {
        if (state.log !== log) return;
        setLogState("reconnecting");
        if (es.readyState === EventSource.CLOSED) {
          log.timer = setTimeout(open, Math.min(1000 * 2 ** log.retry++, 15000));
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
          const notesPatched = type === "envelope.patched"
            && Array.isArray(data.keys) && data.keys.includes("workingNotes");
          if (type === "working_notes" || type === "resync" || notesPatched) onNotesEvent();
          if (type === "envelope.patched" && data.set && typeof data.set.title === "string") {
            $("session-title").textContent = data.set.title || "untitled";
          }
        });
      }
    };
    open();
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

  // ---------------------------------------------------------------- wiring

  function wire() {
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
    $("composer").addEventListener("submit", async (event) => {
      event.preventDefault();
      const box = $("message");
      const message = box.value;
      if (!message.trim() || !state.sessionId) return;
      $("send").disabled = true;
      notice("");
      if (await sendTurn(message)) box.value = "";
      setComposer(true);
    });
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("cancel").addEventListener("click", cancelTurn);
    $("system-panel").addEventListener("toggle", refreshSystem);
    $("system-refresh").addEventListener("click", refreshSystem);
  }

  async function start() {
    renderSessions();
    await refreshSessions();
    const first = storedSessions()[0];
    if (first && !state.sessionId) await openSession(first.id);
  }

  wire();
  takeFragmentToken();
  const saved = sessionStorage.getItem(TOKEN_KEY);
  if (saved && useToken(saved)) start().catch(report);
  else showTokenPanel("");
})();
