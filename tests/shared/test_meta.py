from __future__ import annotations

import msgspec
import pytest

from turnbus.shared import caps
from turnbus.shared.meta import (
    HOST_META_KEYS,
    WORKER_META_KEYS,
    Meta,
    MetaInvalid,
    allowed_tools,
    approval_tools,
    meta_bytes,
    sanitize_meta,
    sanitize_working_notes,
    trim_notes,
    validate_host_meta,
    validate_worker_patch,
)


def test_notes_exactly_at_cap_in_multibyte_utf8_are_kept() -> None:
    # "é" is 2 bytes and "€" 3 bytes in UTF-8: 32,768 = 16,383 * 2 + 2
    notes = "é" * 16_383 + "é"
    assert len(notes.encode()) == caps.WORKING_NOTES_MAX_BYTES
    assert sanitize_working_notes(notes) == notes
    three = "€" * (caps.WORKING_NOTES_MAX_BYTES // 3) + "ab"
    assert len(three.encode()) == caps.WORKING_NOTES_MAX_BYTES
    assert sanitize_working_notes(three) == three


def test_notes_one_byte_over_cap_are_dropped() -> None:
    notes = "é" * 16_384 + "x"
    assert len(notes.encode()) == caps.WORKING_NOTES_MAX_BYTES + 1
    assert sanitize_working_notes(notes) is None


def test_notes_are_stripped_before_measuring() -> None:
    notes = "  \n" + "a" * caps.WORKING_NOTES_MAX_BYTES + "\n\t "
    assert sanitize_working_notes(notes) == "a" * caps.WORKING_NOTES_MAX_BYTES


@pytest.mark.parametrize("value", ["", "   ", "\n\t\r ", "\u3000"])
def test_whitespace_only_notes_are_dropped(value: str) -> None:
    assert sanitize_working_notes(value) is None


# Where JavaScript's trim() and Python's str.strip() disagree: the fold follows trim().
@pytest.mark.parametrize("bom", ["\ufeff", "\ufeff\ufeff", " \ufeff\n"])
def test_a_bom_only_note_clears(bom: str) -> None:
    assert sanitize_working_notes(bom) is None
    assert sanitize_working_notes(bom + "note" + bom) == "note"
    assert validate_worker_patch({"workingNotes": bom}) == {"workingNotes": ""}


@pytest.mark.parametrize("kept", ["\u0085", "\u001c", "\u001d", "\u001e", "\u001f"])
def test_nel_and_the_information_separators_are_not_trimmed(kept: str) -> None:
    assert kept.strip() == ""  # Python would strip them...
    assert sanitize_working_notes(kept) == kept  # ...trim() keeps them
    assert sanitize_working_notes(" " + kept + "note" + kept + "\n") == kept + "note" + kept
    _, worker = validate_host_meta(Meta(workingNotes=kept + "x"))
    assert worker == {"workingNotes": kept + "x"}


@pytest.mark.parametrize(
    "space",
    [
        "\t",
        "\n",
        "\v",
        "\f",
        "\r",
        " ",
        "\u00a0",
        "\u1680",
        "\u2000",
        "\u200a",
        "\u2028",
        "\u2029",
        "\u202f",
        "\u205f",
        "\u3000",
        "\ufeff",
    ],
)
def test_every_trim_whitespace_is_trimmed(space: str) -> None:
    assert space in caps.NOTES_WHITESPACE
    assert trim_notes(space + "a b" + space) == "a b"


def test_the_whitespace_set_is_ecmascript_whitespace_and_line_terminators() -> None:
    import unicodedata

    space_separators = {chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Zs"}
    expected = space_separators | set("\t\v\f\ufeff") | set("\n\r\u2028\u2029")
    assert set(caps.NOTES_WHITESPACE) == expected


@pytest.mark.parametrize("value", [None, 42, 1.5, b"bytes", ["a"], {"a": 1}, True])
def test_non_string_notes_are_dropped(value: object) -> None:
    assert sanitize_working_notes(value) is None


def test_notes_with_lone_surrogates_are_dropped() -> None:
    assert sanitize_working_notes("ok \udcff") is None


def test_key_lists_partition_the_schema() -> None:
    assert set(HOST_META_KEYS) | set(WORKER_META_KEYS) == set(Meta.__struct_fields__)
    assert not set(HOST_META_KEYS) & set(WORKER_META_KEYS)
    assert "workingNotes" in WORKER_META_KEYS


def test_unknown_meta_key_is_rejected_by_the_schema() -> None:
    with pytest.raises(msgspec.ValidationError, match="workingNote"):
        msgspec.json.decode(b'{"workingNote": "typo"}', type=Meta)


def test_non_string_meta_value_is_rejected_by_the_schema() -> None:
    with pytest.raises(msgspec.ValidationError, match="title"):
        msgspec.json.decode(b'{"title": 3}', type=Meta)


def test_sanitize_meta_drops_poison_and_unknown_fields() -> None:
    meta = sanitize_meta(
        {
            "title": "ok",
            "workingNotes": "x" * (caps.WORKING_NOTES_MAX_BYTES + 1),
            "statusSlot": "s" * (caps.STATUS_SLOT_MAX_BYTES + 1),
            "personaId": "",
            "somethingElse": "ignored",
        }
    )
    assert meta == Meta(title="ok")


def test_host_meta_validation_names_the_key() -> None:
    with pytest.raises(MetaInvalid) as info:
        validate_host_meta(Meta(statusSlot="s" * 97))
    assert info.value.key == "statusSlot"
    with pytest.raises(MetaInvalid, match="attachedSkills"):
        validate_host_meta(Meta(attachedSkills="{not json"))
    with pytest.raises(MetaInvalid, match="workingNotes"):
        validate_host_meta(Meta(workingNotes="n" * (caps.WORKING_NOTES_MAX_BYTES + 1)))


def test_host_meta_splits_host_and_present_worker_keys() -> None:
    host, worker = validate_host_meta(Meta(title="t", personaId="", workingNotes="  keep  "))
    assert host == {"title": "t"}
    assert worker == {"workingNotes": "keep"}


def test_worker_patch_refuses_host_keys() -> None:
    with pytest.raises(MetaInvalid, match="not a worker-owned key"):
        validate_worker_patch({"title": "hijack"})
    assert validate_worker_patch({"workingNotes": "", "turnStatus": "running"}) == {
        "workingNotes": "",
        "turnStatus": "running",
    }


def test_meta_bytes_counts_keys_and_utf8_values() -> None:
    assert meta_bytes({"title": "é"}) == len("title") + 2
    # A field written around the API whose name is not UTF-8, read back as surrogates:
    # counted as its bytes, as the scripts count it, not an error in the worker.
    assert meta_bytes({b"ti\xfftle".decode("utf-8", "surrogateescape"): "x"}) == 7


def test_allowed_tools_takes_names_and_entries_that_require_approval() -> None:
    value = '["a", {"name": "b", "requiresApproval": true}, {"name": "c"}, "a"]'
    assert allowed_tools(value) == ("a", "b", "c")
    assert approval_tools(value) == frozenset({"b"})
    assert approval_tools('["a"]') == frozenset() and approval_tools(None) == frozenset()
    for bad in ('[{"name": "b", "bogus": 1}]', '[{"requiresApproval": true}]', "[3]",
                '[{"name": "b", "requiresApproval": "yes"}]'):  # fmt: skip
        assert allowed_tools(bad) is None
        with pytest.raises(MetaInvalid, match="allowedTools"):
            validate_host_meta(Meta(allowedTools=bad))
