"""schemathesis against the served /openapi.json: bounded, derandomized, no 5xx, no off-schema response."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ensure_resource_availability,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    use_after_free,
)
from starlette.applications import Starlette
from starlette.routing import Route

from tests.gateway_server import live_gateway
from tests.turn_kit import append_events, end_turn
from turnbus.gateway.app import create_app, gateway_routes
from turnbus.gateway.auth import mint_token
from turnbus.gateway.errors import CODES
from turnbus.gateway.openapi import build_openapi
from turnbus.shared.events import TextDelta
from turnbus.shared.records import new_session_id
from turnbus.shared.settings import Settings

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 6}


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    call_kwargs: dict[str, Any],
    real_ids: dict[str, str] | None,
) -> None:
    @hypothesis_settings(
        max_examples=EXAMPLES[mode],
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode), use_real=st.booleans())
    def call(case: Any, use_real: bool) -> None:
        if use_real and real_ids is not None:
            # Half the cases name a real session and a finished turn, so success
            # bodies (and a finished turn's SSE events) are checked too.
            params = case.path_parameters or {}
            for name, value in real_ids.items():
                if name in params:
                    params[name] = value
        case.call_and_validate(**call_kwargs)

    try:
        call()
    except Unsatisfiable:
        # Nothing to negate (no parameters, no body): positive cases only.
        assert mode is GenerationMode.NEGATIVE, operation.label


def _fuzz(base_url: str, token: str, session_id: str, turn_id: str) -> list[str]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=10)
    seen: list[str] = []
    with requests.Session() as session:
        call_kwargs = {
            "base_url": base_url,
            "session": session,
            "headers": {"Authorization": f"Bearer {token}"},
            "checks": CHECKS,
            "timeout": 10,
        }
        for result in schema.get_all_operations():
            operation = result.ok()
            label = operation.label
            # Not the open-ended session log (it never ends) nor delete (the rest would 404).
            real = not label.endswith("/{session_id}/events") and not label.startswith("DELETE")
            real_ids = {"session_id": session_id, "turn_id": turn_id} if real else None
            for mode in EXAMPLES:
                _fuzz_operation(operation, mode, call_kwargs, real_ids)
            seen.append(label)
    return seen


@pytest.mark.timeout(120)
async def test_schemathesis_conformance(settings: Settings, redis: aioredis.Redis) -> None:
    assert settings.jwt_secret
    token = mint_token(settings.jwt_secret, "fuzzer")
    async with live_gateway(settings) as gw:
        store = gw.gateway
        session_id = (await store.envelopes.create("fuzzer", new_session_id())).sessionId
        record, _, _ = await store.turns.submit_queued("fuzzer", session_id, "hello")
        turn_id = record.turnId
        await append_events(
            store.turns,
            "fuzzer",
            session_id,
            turn_id,
            TextDelta(turnId=turn_id, round=1, text="hi"),
        )
        await end_turn(store.turns, "fuzzer", session_id, turn_id, "completed")
        seen = await asyncio.to_thread(_fuzz, gw.base_url, token, session_id, turn_id)
    # Every operation but GET /openapi.json, which schemathesis leaves out: it served the
    # document it read.
    assert len(seen) == 21
    assert "GET /v1/models" in seen
    assert "POST /v1/sessions/{session_id}/turns" in seen


def test_the_schema_says_a_message_is_never_empty() -> None:
    schema = build_openapi(gateway_routes())["components"]["schemas"]["TurnRequest"]
    assert schema["properties"]["message"]["minLength"] == 1


def _operations(document: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path, item in document["paths"].items():
        for operation in item.values():
            if isinstance(operation, dict) and "operationId" in operation:
                found[operation["operationId"]] = (path, operation)
    return found


def _link_targets(document: dict[str, Any], operation_id: str, status: str) -> set[str]:
    operations = _operations(document)
    path, operation = operations[operation_id]
    links = operation["responses"][status]["links"]
    targets = set()
    for link in links.values():
        target_path, _ = operations[link["operationId"]]
        # Every path parameter of the target is filled, from this response or request.
        needed = {seg[1:-1] for seg in target_path.split("/") if seg.startswith("{")}
        assert set(link["parameters"]) == needed, link
        for expression in link["parameters"].values():
            if expression.startswith("$request.path."):
                assert "{" + expression.removeprefix("$request.path.") + "}" in path
            else:
                field = expression.removeprefix("$response.body#/")
                schema_name = operation["responses"][status]["content"]["application/json"][
                    "schema"
                ]["$ref"].rsplit("/", 1)[1]
                schema = document["components"]["schemas"][schema_name]
                assert field in schema["required"], (schema_name, field)
        targets.add(link["operationId"])
    return targets


def test_the_schema_links_a_created_session_to_its_turns_events_and_meta() -> None:
    document = build_openapi(gateway_routes())
    assert {"submitTurn", "sessionEvents", "putMeta", "getSession"} <= _link_targets(
        document, "createSession", "201"
    )
    assert {"getTurn", "turnEvents", "cancelTurn"} <= _link_targets(document, "submitTurn", "202")


def test_the_schema_says_attached_skills_is_json_in_a_string() -> None:
    meta = build_openapi(gateway_routes())["components"]["schemas"]["Meta"]["properties"][
        "attachedSkills"
    ]
    declared = [meta, *meta.get("anyOf", [])]
    assert any(
        part.get("type") == "string" and part.get("contentMediaType") == "application/json"
        for part in declared
    ), meta


def test_the_create_schema_offers_only_the_keys_a_new_session_accepts() -> None:
    from turnbus.shared.meta import HOST_META_KEYS

    schemas = build_openapi(gateway_routes())["components"]["schemas"]
    meta = schemas["CreateSessionRequest"]["properties"]["meta"]
    assert {"$ref": "#/components/schemas/HostMeta"} in meta["anyOf"]
    assert sorted(schemas["HostMeta"]["properties"]) == sorted(HOST_META_KEYS)
    assert "workingNotes" in schemas["Meta"]["properties"]  # PUT /meta still takes it


def _served(app: Starlette) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves, HEAD aside (Starlette adds it to GET)."""
    served = set()
    for route in app.routes:
        assert isinstance(route, Route), route
        if route.include_in_schema:
            served |= {(m, route.path) for m in route.methods or () if m != "HEAD"}
    return served


def test_every_served_route_is_in_the_document_and_nothing_else(settings: Settings) -> None:
    app = create_app(settings)
    document = msgspec.json.decode(app.state.openapi)
    documented = {
        (method.upper(), path)
        for path, item in document["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert documented == _served(app)
    assert ("GET", "/openapi.json") in documented
    # The console is a page for browsers, served but not part of the API.
    console_paths = {r.path for r in app.routes if isinstance(r, Route) and not r.include_in_schema}
    assert console_paths == {"/console", "/console/", "/console/{name}"}


def test_a_route_that_declares_no_operation_is_refused() -> None:
    async def handler(request: Any) -> Any:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="/undeclared"):
        build_openapi([*gateway_routes(), Route("/undeclared", handler)])


def test_the_document_error_codes_are_the_gateway_codes() -> None:
    document = build_openapi(gateway_routes())
    detail = document["components"]["schemas"]["ErrorDetail"]["properties"]["code"]
    assert detail["enum"] == list(CODES)
    answered: set[str] = set()
    for item in document["paths"].values():
        for method, operation in item.items():
            if method == "parameters":
                continue
            for status, response in operation["responses"].items():
                for code in response.get("x-error-codes", []):
                    assert CODES[code] == int(status), (operation["operationId"], code)
                    answered.add(code)
    # Every code a route can answer is declared on one; the rest are answered below the
    # routes (by the connection guard, the router, the last-resort handler).
    assert set(CODES) - answered == {"method_not_allowed", "request_timeout", "internal"}


def test_the_answer_routes_declare_their_refusals() -> None:
    document = build_openapi(gateway_routes())
    actions = document["paths"]["/v1/sessions/{session_id}/turns/{turn_id}/actions"]["post"]
    assert actions["responses"]["409"]["x-error-codes"] == ["conflict", "turn_not_waiting"]
    refused = set(actions["responses"]["422"]["x-error-codes"])
    assert {"unknown_call", "missing_call", "duplicate_call", "wrong_answer"} <= refused
    submit = document["paths"]["/v1/sessions/{session_id}/turns"]["post"]
    assert submit["responses"]["429"]["x-error-codes"] == ["session_queue_full", "quota_exceeded"]
    assert "Retry-After" in submit["responses"]["429"]["headers"]
    erase = document["paths"]["/v1/users/me"]["delete"]
    assert "confirmation_required" in erase["responses"]["422"]["x-error-codes"]


def test_docs_api_names_every_error_code() -> None:
    text = (Path(__file__).parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    for code, status in CODES.items():
        assert f"| `{code}` | {status} |" in text, code


# The SSE endpoints are left out of the stateful run: a session log never ends, and
# with no worker running a queued turn's stream does not end either (a short timeout
# would only report the timeout). Their single-call checks run above on a finished turn.
SSE_OPERATIONS = ["turnEvents", "sessionEvents"]
# Plus what only a sequence shows: a created resource can be read, a deleted one is gone.
STATEFUL_CHECKS = [
    *CHECKS,
    ensure_resource_availability,
    use_after_free,
]


def _stateful(base_url: str, secret: str) -> list[tuple[str, int]]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=10)
    schema = schema.exclude(operation_id=SSE_OPERATIONS)
    calls: list[tuple[str, int]] = []
    users = itertools.count()
    with requests.Session() as session:

        class Machine(schema.as_state_machine()):  # type: ignore[misc]
            def __init__(self) -> None:
                # A user of its own per scenario: a replayed scenario must meet the same
                # answers (the sessions list of a shared user grows from one to the next).
                self.token = mint_token(secret, f"fuzzer{next(users)}")
                super().__init__()

            def get_call_kwargs(self, case: Any) -> dict[str, Any]:
                return {
                    "session": session,
                    "headers": {"Authorization": f"Bearer {self.token}"},
                    "timeout": 10,
                }

            def after_call(self, response: Any, case: Any) -> None:
                super().after_call(response, case)
                calls.append((case.operation.label, response.status_code))

            def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
                case.validate_response(response, checks=STATEFUL_CHECKS, transport_kwargs=kwargs)

        Machine.run(
            settings=hypothesis_settings(
                max_examples=25,
                stateful_step_count=10,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
        )
    return calls


@pytest.mark.timeout(60)
async def test_schemathesis_stateful_follows_the_links(settings: Settings) -> None:
    assert settings.jwt_secret
    async with live_gateway(settings) as gw:
        calls = await asyncio.to_thread(_stateful, gw.base_url, settings.jwt_secret)
    succeeded = {label for label, status in calls if status < 400}
    # The links took the run from a created session to a submitted turn and on.
    assert "POST /v1/sessions" in succeeded, calls
    assert "POST /v1/sessions/{session_id}/turns" in succeeded, calls
    assert succeeded & {
        "GET /v1/sessions/{session_id}/turns/{turn_id}",
        "POST /v1/sessions/{session_id}/turns/{turn_id}/cancel",
    }, calls
