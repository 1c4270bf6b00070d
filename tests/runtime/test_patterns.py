"""Every pattern of the wire contract matches the whole value. Python's `$` also matches before a
final newline, and ids become NATS subject tokens, file names and container names."""

from __future__ import annotations

import msgspec
import pytest

from belayer_rl.shared import protocol


def patterns() -> list[tuple[str, str, str]]:
    """(message type, field, pattern) for every str field with a pattern, nested ones included."""
    found: list[tuple[str, str, str]] = []

    def walk(owner: str, name: str, info: msgspec.inspect.Type) -> None:
        match info:
            case msgspec.inspect.StrType(pattern=str() as pattern):
                found.append((owner, name, pattern))
            case msgspec.inspect.ListType() | msgspec.inspect.DictType():
                for inner in (getattr(info, "item_type", None), getattr(info, "key_type", None),
                              getattr(info, "value_type", None)):  # fmt: skip
                    if inner is not None:
                        walk(owner, name, inner)
            case msgspec.inspect.UnionType():
                for inner in info.types:
                    walk(owner, name, inner)

    for kind in vars(protocol).values():
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            for field in msgspec.inspect.type_info(kind).fields:
                walk(kind.__name__, field.name, field.type)
    return found


def test_no_pattern_lets_a_trailing_newline_through() -> None:
    """Mutation check, run by hand: with `$` (the earlier patterns) the sandbox id "abc\\n"
    decodes, and every pattern is listed."""
    found = patterns()
    assert len(found) >= 20, found  # the walk reaches the contract's ids
    assert [(owner, name) for owner, name, pattern in found if not pattern.endswith(r"\Z")] == []
    payload = b'{"type":"sandbox_exec","sandbox":"abc\\n","command":"true"}'
    with pytest.raises(protocol.BadMessage, match="sandbox"):
        protocol.decode(protocol.decoder_for(protocol.SandboxExec), payload)
    ok = protocol.decode(protocol.decoder_for(protocol.SandboxExec), payload.replace(b"\\n", b""))
    assert ok.sandbox == "abc"
