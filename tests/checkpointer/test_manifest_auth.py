"""Authenticated manifests: a checkpoint folder is trusted only when its manifest carries a MAC made
with the store's key, over every file's checksum (the CRIU images among them), the container
settings and L_k's digest. A forged or edited folder is refused before any of it is used."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from belayer_rl.services.checkpointer.store import (
    CONTEXT,
    MANIFEST,
    Context,
    CorruptCheckpoint,
    FileSum,
    Manifest,
    Store,
    Unauthenticated,
    checkpoint_key,
    digest_context,
    sha256_file,
)
from belayer_rl.shared.protocol import SandboxSpec

KEY = bytes(range(32))


def sealed(store: Store, checkpoint_id: str = "i0-k3-00aa11bb") -> Path:
    """A published checkpoint with a layer, L_k and two CRIU images, sealed by `store`."""
    staging = store.staging("traj", checkpoint_id)
    (staging / "layer.tar").write_bytes(b"\0" * 1024)
    context = Context(tokens=[5, 6, 7])
    (staging / CONTEXT).write_bytes(msgspec.json.encode(context))
    (staging / "criu").mkdir()
    (staging / "criu" / "pages-1.img").write_bytes(b"pages" * 100)
    (staging / "criu" / "inventory.img").write_bytes(b"inventory")
    draft = Manifest(
        checkpoint_id=checkpoint_id, trajectory="traj", sandbox="sb", host_id="h1", incarnation=0, k=3,
        spec=SandboxSpec(image="belayer-sandbox:test"), image_id="sha256:" + "ab" * 32, criu_name="criu",
        context_digest=digest_context(context), context_len=3, created_at=0.0, freeze_s=0.1, dump_s=0.1,
        files=[],
    )  # fmt: skip
    return store.publish(staging, store.seal(staging, draft))


def rewrite(folder: Path, **changes: object) -> None:
    """An attacker with write access to the store: edit the manifest, keep its checksums true."""
    manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=Manifest)
    files = [
        FileSum(path=f.path, size=(folder / f.path).stat().st_size, sha256=sha256_file(folder / f.path))
        for f in manifest.files
    ]
    forged = msgspec.structs.replace(manifest, files=files, **changes)
    (folder / MANIFEST).write_bytes(msgspec.json.encode(forged))


def test_a_sealed_checkpoint_verifies(tmp_path: Path) -> None:
    store = Store(tmp_path, KEY)
    folder = sealed(store)
    manifest = store.verify(folder)
    assert manifest.k == 3 and (folder / "manifest.mac").stat().st_size == 64
    assert {f.path for f in manifest.files} == {
        "layer.tar",
        CONTEXT,
        "criu/pages-1.img",
        "criu/inventory.img",
    }


def test_edited_container_settings_are_refused(tmp_path: Path) -> None:
    store = Store(tmp_path, KEY)
    folder = sealed(store)
    hostile = SandboxSpec(image="belayer-sandbox:test", cap_add=["SYS_ADMIN"], network=True)
    rewrite(folder, spec=hostile)
    with pytest.raises(CorruptCheckpoint, match="not authenticated"):
        store.verify(folder)
    assert store.ready("traj")[0].manifest.incarnation == -1  # ordered last, never adopted


def test_a_tampered_criu_image_is_refused_even_with_fresh_checksums(tmp_path: Path) -> None:
    store = Store(tmp_path, KEY)
    folder = sealed(store)
    (folder / "criu" / "pages-1.img").write_bytes(b"evil!" * 100)  # same size
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        store.verify(folder)
    rewrite(folder)  # the checksums now match the tampered image, the MAC does not
    with pytest.raises(CorruptCheckpoint, match="not authenticated"):
        store.verify(folder)


def test_a_folder_forged_with_another_key_is_refused(tmp_path: Path) -> None:
    """Mutation check: the same folder verifies for the forger's key, so the refusal is the key's."""
    forger = Store(tmp_path / "forger", b"\xff" * 32)
    folder = sealed(forger)
    assert forger.verify(folder).k == 3
    with pytest.raises(CorruptCheckpoint, match="not authenticated"):
        Store(tmp_path / "forger", KEY).verify(folder)


def test_a_stripped_or_garbled_mac_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path, KEY)
    folder = sealed(store)
    (folder / "manifest.mac").write_text("é" * 64)  # not even ASCII: refused, not a crash
    with pytest.raises(Unauthenticated, match="not authenticated"):
        store.load(folder)
    (folder / "manifest.mac").unlink()
    with pytest.raises(Unauthenticated, match="No such file"):
        store.load(folder)
    assert store.ready("traj")[0].manifest.incarnation == -1


def test_a_signed_manifest_under_another_name_is_refused(tmp_path: Path) -> None:
    """A genuine checkpoint of trajectory U copied into T's folder would hand T U's context."""
    store = Store(tmp_path, KEY)
    folder = sealed(store)
    elsewhere = store.trajectory_dir("other") / folder.name
    elsewhere.parent.mkdir()
    folder.rename(elsewhere)
    with pytest.raises(CorruptCheckpoint, match=r"holds checkpoint \S+ of traj"):
        store.verify(elsewhere)
    renamed = folder.parent / "i0-k9-00aa11bb"
    elsewhere.rename(renamed)
    with pytest.raises(CorruptCheckpoint, match="holds checkpoint i0-k3-00aa11bb"):
        store.verify(renamed)


def test_the_key_file_is_made_private_once_and_then_read(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.key"
    with pytest.raises(FileNotFoundError):  # a key file the operator named is never made up
        checkpoint_key(path, create=False)
    first = checkpoint_key(path, create=True)
    assert len(first) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert checkpoint_key(path, create=True) == first  # not made again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.key"]
    path.write_text("abcd\n")
    with pytest.raises(ValueError, match="at least 32"):
        checkpoint_key(path, create=False)
    path.write_text("not hex at all\n")
    with pytest.raises(ValueError, match="not hex"):
        checkpoint_key(path, create=False)


def test_a_quarantined_checkpoint_is_set_aside_whole_and_given_back_by_a_rename(tmp_path: Path) -> None:
    """A checkpoint whose restores keep failing for no proven reason (a host fault looks the same)
    is set aside, not deleted: no restore or budget sees it, its bytes stay, and renaming it back
    makes it a candidate again, verified as before."""
    store = Store(tmp_path, KEY)
    older, newer = sealed(store, "i0-k3-00aa11bb"), sealed(store, "i0-k3-00aa11cc")
    assert {s.path for s in store.ready("traj")} == {newer, older}
    used, size = store.usage(), sum(f.stat().st_size for f in newer.rglob("*") if f.is_file())
    aside = store.quarantine(newer)
    assert [s.path for s in store.ready("traj")] == [older]  # restores fall back past it ...
    assert store.quarantined("traj") == [aside] and not newer.exists()
    # ... but every byte of it is kept, outside the budget: it evicts neither it nor others for it.
    assert sum(f.stat().st_size for f in aside.rglob("*") if f.is_file()) == size
    assert store.usage() == used - size
    assert store.enforce_budget(store.usage(), keep={older}) == []
    assert aside.exists()
    # A second copy of it (fetched again from the object store, failing again) is dropped.
    again = sealed(store, "i0-k3-00aa11cc")
    assert store.quarantine(again) == aside and not again.exists()
    aside.rename(newer)  # the operator's way back
    assert store.verify(newer).checkpoint_id == newer.name
    assert {s.path for s in store.ready("traj")} == {newer, older}
    # A trajectory may be named like a quarantined folder: its checkpoints still count.
    before = store.usage()
    odd = store.staging("quarantined-x", "i0-k1-00aa11dd")
    (odd / "layer.tar").write_bytes(b"\0" * 100)
    odd.rename(odd.parent / "i0-k1-00aa11dd")
    assert store.usage() == before + 100
    store.quarantine(newer)
    store.remove_trajectory("traj")  # the trajectory's end removes what it set aside
    assert not store.trajectory_dir("traj").exists()
