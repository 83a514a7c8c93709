"""``turnbus.tools``: the ``@tool`` decorator, the schemas it writes, and how a worker
loads the modules that hold tools (worker/python_tools.py, worker/registry.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import pytest

from turnbus.tools import ToolContext, ToolDefinitionError, tool, tool_of
from turnbus.worker import toolsource
from turnbus.worker.python_tools import ENTRY_POINT_GROUP, PythonToolSource, ToolLoadError
from turnbus.worker.registry import ToolRegistry, ToolRegistryError


class Address(msgspec.Struct):
    city: str
    zip: str | None = None


@tool
async def bare(term: str, limit: int = 3) -> str:
    """Look a term up.

    More words."""
    return term * limit


@tool(idempotent=True, timeout_s=5, max_result_bytes=1024, name="ship_it")
async def with_arguments(
    where: Address,
    speed: Literal["slow", "fast"],
    context: ToolContext,
    tags: list[str] | None = None,
) -> dict[str, str]:
    return {"city": where.city, "call": context.call_id}


def test_bare_and_with_arguments_both_register_the_function_unchanged() -> None:
    plain, shipped = tool_of(bare), tool_of(with_arguments)
    assert plain is not None and shipped is not None
    assert plain.name == "bare" and shipped.name == "ship_it"
    assert (plain.idempotent, plain.timeout_s, plain.max_result_bytes) == (False, 30.0, 16384)
    assert (shipped.idempotent, shipped.timeout_s, shipped.max_result_bytes) == (True, 5.0, 1024)
    assert plain.requires_approval is False
    assert plain.description == "Look a term up.\n\nMore words."
    assert callable(bare) and tool_of(len) is None


def test_the_schema_comes_from_the_type_hints_without_the_context() -> None:
    plain, shipped = tool_of(bare), tool_of(with_arguments)
    assert plain is not None and shipped is not None
    assert plain.input_schema == {
        "type": "object",
        "properties": {"term": {"type": "string"}, "limit": {"type": "integer", "default": 3}},
        "required": ["term"],
        "additionalProperties": False,
    }
    schema = shipped.input_schema
    assert set(schema["properties"]) == {"where", "speed", "tags"}
    assert schema["required"] == ["where", "speed"]
    assert schema["properties"]["speed"] == {"enum": ["fast", "slow"]}
    assert schema["properties"]["where"] == {"$ref": "#/$defs/Address"}
    assert schema["$defs"]["Address"]["required"] == ["city"]
    assert shipped.context_param == "context"


def test_the_context_is_recognised_by_its_annotation_and_is_one_class() -> None:
    from turnbus.tools import ToolContext as Public

    assert Public is toolsource.ToolContext

    @tool
    async def named_oddly(q: str, whatever: ToolContext) -> str:
        return whatever.user_id

    @tool
    async def ctx_is_just_a_name(ctx: str) -> str:
        return ctx

    found = tool_of(named_oddly)
    assert found is not None and found.context_param == "whatever"
    assert list(found.input_schema["properties"]) == ["q"]
    plain = tool_of(ctx_is_just_a_name)
    assert plain is not None and plain.context_param is None
    assert list(plain.input_schema["properties"]) == ["ctx"]


async def test_parse_names_the_field_and_invoke_passes_the_context() -> None:
    shipped = tool_of(with_arguments)
    assert shipped is not None
    with pytest.raises(msgspec.ValidationError, match=r"\$\.where\.city"):
        shipped.parse({"where": {"city": 3}, "speed": "fast"})
    with pytest.raises(msgspec.ValidationError, match="unknown field `user_id`"):
        shipped.parse({"where": {"city": "Oslo"}, "speed": "fast", "user_id": "someone"})
    parsed = shipped.parse({"where": {"city": "Oslo"}, "speed": "fast"})
    context = ToolContext(user_id="u", session_id="s", turn_id="t", call_id="toolu_1")
    assert await shipped.invoke(parsed, context) == {"city": "Oslo", "call": "toolu_1"}


def test_what_cannot_be_a_tool_is_refused_at_definition() -> None:
    def not_async(x: int) -> int:
        return x

    async def star(*args: int) -> int:
        return 0

    async def fine() -> None:
        return None

    with pytest.raises(ToolDefinitionError, match="async"):
        tool(not_async)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        tool(star)
    with pytest.raises(ToolDefinitionError, match="name"):
        tool(name="has space")(fine)
    with pytest.raises(ToolDefinitionError, match="timeout_s"):
        tool(timeout_s=0)


def _module(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


LOOKUP = """
from turnbus.tools import tool

@tool
async def lookup(term: str) -> str:
    '''one'''
    return term
"""


async def test_a_source_loads_files_and_refuses_a_clash_naming_both(tmp_path: Path) -> None:
    one = _module(tmp_path, "one", LOOKUP)
    two = _module(tmp_path, "two", LOOKUP.replace("one", "two"))
    source = PythonToolSource([one], entry_points=False)
    await source.start()
    assert [t.name for t in source.tools()] == ["lookup"]
    clash = PythonToolSource([one, two], entry_points=False)
    with pytest.raises(ToolLoadError, match=r"two tools are named 'lookup'.*one\.py.*two\.py"):
        await clash.start()
    broken = _module(tmp_path, "broken", "raise RuntimeError('no config')\n")
    with pytest.raises(ToolLoadError, match=r"broken\.py.*RuntimeError: no config"):
        await PythonToolSource([broken], entry_points=False).start()
    with pytest.raises(ToolLoadError, match="'no_such_module_here'"):
        await PythonToolSource(["no_such_module_here"], entry_points=False).start()


def _distribution(root: Path, name: str, entry_points: str) -> None:
    """A distribution as an installer leaves it (``<name>-1.0.dist-info``) under ``root``,
    found by importlib.metadata once ``root`` is on sys.path; nothing is installed."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


@pytest.fixture
def site_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory put first on sys.path for one test; the modules imported from it are
    forgotten after."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        module_file = getattr(sys.modules[name], "__file__", None) or ""
        if module_file.startswith(str(root)):
            del sys.modules[name]


async def test_entry_points_of_the_group_name_a_module_a_tool_or_a_list(site_dir: Path) -> None:
    _module(
        site_dir,
        "tb_ep_whole",
        """
        from turnbus.tools import tool

        @tool(idempotent=True)
        async def ep_lookup(term: str) -> str:
            '''Look a term up.'''
            return f"{term}: found"

        async def not_a_tool() -> None:
            return None
        """,
    )
    _module(
        site_dir,
        "tb_ep_picked",
        """
        from turnbus.tools import tool

        @tool
        async def picked(n: int) -> str:
            return str(n)

        @tool
        async def listed_a() -> str:
            return "a"

        @tool
        async def listed_b() -> str:
            return "b"

        @tool
        async def left_out() -> str:
            return "no entry point names this"

        LISTED = [listed_a, listed_b]
        """,
    )
    _distribution(
        site_dir,
        "tb_ep_dist",
        f"""
        [{ENTRY_POINT_GROUP}]
        whole = tb_ep_whole
        one = tb_ep_picked:picked
        some = tb_ep_picked:LISTED

        [console_scripts]
        tb-ep-unrelated = tb_ep_picked:left_out
        """,
    )
    source = PythonToolSource([])
    await source.start()
    tools = {t.name: t for t in source.tools()}
    assert set(tools) == {"ep_lookup", "picked", "listed_a", "listed_b"}
    assert tools["ep_lookup"].idempotent and not tools["picked"].idempotent
    assert tools["ep_lookup"].description == "Look a term up."
    context = ToolContext(user_id="u", session_id="s", turn_id="t", call_id="toolu_1")
    answer = await source.call(tools["ep_lookup"], {"term": "lease"}, context)
    assert (answer.output, answer.is_error) == ("lease: found", False)

    # A module named in TURNBUS_TOOLS and by an entry point gives each tool once.
    both = PythonToolSource(["tb_ep_whole"])
    await both.start()
    assert sorted(t.name for t in both.tools()) == ["ep_lookup", "listed_a", "listed_b", "picked"]
    # entry_points=False reads the modules alone.
    alone = PythonToolSource(["tb_ep_whole"], entry_points=False)
    await alone.start()
    assert [t.name for t in alone.tools()] == ["ep_lookup"]


async def test_an_entry_point_that_does_not_load_stops_the_start_naming_it(
    site_dir: Path,
) -> None:
    _distribution(
        site_dir,
        "tb_ep_broken",
        f"""
        [{ENTRY_POINT_GROUP}]
        gone = tb_ep_no_such_module:lookup
        """,
    )
    with pytest.raises(
        ToolLoadError,
        match=r"entry point 'gone' \(tb_ep_no_such_module:lookup\) of group 'turnbus\.tools' "
        r"does not load: ModuleNotFoundError",
    ):
        await PythonToolSource([]).start()


async def test_a_tool_may_not_take_a_notes_tools_name(tmp_path: Path) -> None:
    path = _module(
        tmp_path,
        "notes_clash",
        """
        from turnbus.tools import tool

        @tool
        async def working_notes_get() -> str:
            return ""
        """,
    )
    registry = ToolRegistry([PythonToolSource([path], entry_points=False)])
    with pytest.raises(ToolRegistryError, match="working_notes_get"):
        await registry.start()


def test_a_worker_with_a_module_that_does_not_import_stops_at_start_naming_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNBUS_")}
    env.update(TURNBUS_TOOLS="tools_that_are_missing", TURNBUS_REDIS_URL="redis://127.0.0.1:1/0")
    done = subprocess.run(
        [sys.executable, "-m", "turnbus", "worker", "--name", "w-bad-tools"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "cannot start its tools" in done.stderr
    assert "'tools_that_are_missing'" in done.stderr
