"""Names that become paths: a checkpoint id from a stored pointer or from a manifest on disk is
pattern-checked where it is decoded, so none can lead outside the checkpoint store."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from belayer_rl.services.checkpointer.store import MANIFEST, CorruptCheckpoint, Manifest, Store
from belayer_rl.shared import protocol
from belayer_rl.shared.protocol import PrefixPointer, SandboxSpec

HOSTILE = ["../../etc", "/abs", "a/b", "..", "x" * 97, "dot.dot", "nul\x00"]


def pointer(checkpoint_id: str) -> bytes:
    value = PrefixPointer(trajectory="t", host_id="h", sandbox="s", checkpoint_id="ok", incarnation=0, k=1)
    as_dict = msgspec.to_builtins(value)
    return msgspec.json.encode({**as_dict, "checkpoint_id": checkpoint_id})


@pytest.mark.parametrize("name", HOSTILE)
def test_a_pointer_naming_a_path_does_not_decode(name: str) -> None:
    decoder = protocol.decoder_for(PrefixPointer)
    assert protocol.decode(decoder, pointer("i0-k1-0a1b2c3d")).checkpoint_id == "i0-k1-0a1b2c3d"
    with pytest.raises(protocol.BadMessage):
        protocol.decode(decoder, pointer(name))


def manifest(checkpoint_id: str) -> bytes:
    value = Manifest(
        checkpoint_id="ok", trajectory="t", sandbox="s", host_id="h", incarnation=0, k=1,
        spec=SandboxSpec(image="busybox"), image_id="", criu_name="criu", context_digest="",
        context_len=0, created_at=0.0, freeze_s=0.0, dump_s=0.0, files=[],
    )  # fmt: skip
    return msgspec.json.encode({**msgspec.to_builtins(value), "checkpoint_id": checkpoint_id})


@pytest.mark.parametrize("name", HOSTILE)
def test_a_manifest_naming_a_path_is_corrupt(tmp_path: Path, name: str) -> None:
    store = Store(tmp_path / "store", b"k" * 32)
    folder = tmp_path / "store" / "t" / "i0-k1-0a1b2c3d"
    folder.mkdir(parents=True)
    store.write_signed(folder / MANIFEST, manifest("i0-k1-0a1b2c3d"))
    assert store.load(folder).checkpoint_id == "i0-k1-0a1b2c3d"
    store.write_signed(folder / MANIFEST, manifest(name))  # signed, and still refused for its name
    with pytest.raises(CorruptCheckpoint):
        store.load(folder)
