"""The event table (protocol.EVENT_TYPES) is the one place that says what each event subject
carries; these check it against the code that publishes, read with `ast` (no service runs)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from belayer_rl.shared import protocol
from belayer_rl.shared.subjects import Subjects, event_kind
from tests.cli.helpers import SAMPLES

NAMES = Subjects()  # the default cluster's names

ROOT = Path(__file__).resolve().parents[2]  # the repository root is the package belayer_rl
PROJECT_FOLDERS = ("cli", "services", "shared", "scripts")  # tests may subscribe to whatever they like


# A declaration's on_event and event (shared/declaration.py) hand their `kind` parameter on to
# Subjects.event: the kinds are the literals of their callers, which are collected as calls of their own.
FORWARDERS = {("shared/declaration.py", "kind")}
DECLARED_EVENTS = ("on_event", "event")
# A cluster's names (a Subjects) are reached as `<x>.subjects`, or held as `names` or `s`.
NAMES_HOLDERS = ("names", "s")


def is_names(receiver: ast.expr) -> bool:
    text = ast.unparse(receiver)
    return text in NAMES_HOLDERS or text == "subjects" or text.endswith(".subjects")


def event_calls() -> list[tuple[str, str, ast.Call]]:
    """(where, function, call) for every <names>.event(...), <names>.weights_published(...) and
    declared event (on_event(kind, ...), event(kind, ...)) in the project's code."""
    calls = []
    for folder in PROJECT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.Call):
                    continue
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if isinstance(node.func, ast.Name) and node.func.id in DECLARED_EVENTS:
                    calls.append((where, "event", node))
                if not isinstance(node.func, ast.Attribute):
                    continue
                receiver = node.func.value
                if node.func.attr in ("event", "weights_published") and is_names(receiver):
                    calls.append((where, node.func.attr, node))
    return calls


def test_the_table_holds_exactly_the_kinds_the_code_uses() -> None:
    used: set[str] = set()
    for where, function, call in event_calls():
        if function == "weights_published":
            used.add("weights_published")
            continue
        kind = call.args[0] if call.args else None
        if isinstance(kind, ast.Name) and (where.split(":")[0], kind.id) in FORWARDERS:
            continue
        # A kind computed at run time could not be checked here (subjects.event still refuses it).
        assert isinstance(kind, ast.Constant) and isinstance(kind.value, str), f"{where}: kind not a literal"
        used.add(kind.value)
    assert used == set(protocol.EVENT_TYPES), "kinds used but not declared, or declared but never used"


def test_the_union_and_the_samples_cover_the_table() -> None:
    assert set(typing.get_args(protocol.AnyEvent)) == set(protocol.EVENT_TYPES.values())
    assert len(set(protocol.EVENT_TYPES.values())) == len(protocol.EVENT_TYPES), "one type per kind"
    assert set(SAMPLES) == set(protocol.EVENT_TYPES)
    for kind, (_, message) in SAMPLES.items():
        assert type(message) is protocol.EVENT_TYPES[kind]


def test_a_kind_is_its_publishing_name_and_its_tag_but_for_one_documented_exception() -> None:
    """The rule (protocol.py, "event kinds"): the kind is the name after `belayer.evt.`; it is also
    the Struct's tag except for worker_registered, whose tag "register" predates the table. A new
    mismatch must be a decision, recorded here and in that comment."""
    mismatched = {k for k, t in protocol.EVENT_TYPES.items() if t.__struct_config__.tag != k}
    assert mismatched == {"worker_registered"}


def test_subjects_refuse_an_undeclared_kind_and_give_back_the_kind_of_a_subject() -> None:
    with pytest.raises(ValueError, match="not declared"):
        NAMES.event("handovr", "e0")
    for kind in protocol.EVENT_TYPES:
        assert event_kind(NAMES.event(kind, "x", "y")) == kind
    assert event_kind(NAMES.weights_published("v3")) == "weights_published"
    assert event_kind(NAMES.router_status) == ""


def test_each_kind_decodes_its_own_type_only() -> None:
    for kind, (_, message) in SAMPLES.items():
        payload = protocol.encode(message)
        assert protocol.decode(protocol.decoder_for(protocol.EVENT_TYPES[kind]), payload) == message
        assert protocol.decode(protocol.decoder_for(protocol.AnyEvent), payload) == message
        for other, other_type in protocol.EVENT_TYPES.items():
            if other != kind:
                with pytest.raises(protocol.BadMessage):
                    protocol.decode(protocol.decoder_for(other_type), payload)
