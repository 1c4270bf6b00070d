"""The writable-layer archive: hostile archives are rejected whole, clean ones install exactly."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from belayer_rl.services.checkpointer import layer


def make_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def entry(name: str, kind: bytes = tarfile.REGTYPE, **attrs: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = 0o644
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


def hostile_members(canary: Path) -> dict[str, list[tuple[tarfile.TarInfo, bytes | None]]]:
    return {
        "absolute": [(entry(str(canary / "canary")), b"pwned\n")],
        "dotdot": [(entry("a/../../../../../../../../" + str(canary / "canary").lstrip("/")), b"pwned\n")],
        "symlink-then-write": [
            (entry("evil", tarfile.SYMTYPE, linkname=str(canary)), None),
            (entry("evil/canary"), b"pwned\n"),
        ],
        "relative-escape": [(entry("up", tarfile.SYMTYPE, linkname="../../../../../../.."), None)],
        "hardlink-to-host": [(entry("hl", tarfile.LNKTYPE, linkname=str(canary / "canary")), None)],
        "hardlink-dotdot": [(entry("hl", tarfile.LNKTYPE, linkname="../../../canary"), None)],
        "device": [(entry("sda", tarfile.CHRTYPE, devmajor=8, devminor=0), None)],
        "block-device": [(entry("sdb", tarfile.BLKTYPE, devmajor=8, devminor=16), None)],
        "duplicate": [
            (entry("d", tarfile.DIRTYPE, mode=0o755), None),
            (entry("d", tarfile.SYMTYPE, linkname="/"), None),
        ],
    }


@pytest.mark.parametrize("variant", sorted(hostile_members(Path("/x"))))
def test_hostile_archives_are_rejected_whole(tmp_path: Path, canary_dir: Path, variant: str) -> None:
    clean = [(entry("fine.txt"), b"ok\n")]
    archive = make_tar(tmp_path / "layer.tar", clean + hostile_members(canary_dir)[variant])
    target = tmp_path / "upper"
    target.mkdir()
    with pytest.raises(layer.HostileLayer):
        layer.check(archive)
    assert (canary_dir / "canary").read_text() == "untouched\n"
    assert sorted(os.listdir(canary_dir)) == ["canary"]
    assert os.listdir(target) == []


def test_not_a_tar_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "layer.tar"
    bad.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(layer.HostileLayer):
        layer.check(bad)


def cut_in_a_file(data: bytes) -> bytes:
    return data[: 3 * tarfile.BLOCKSIZE + 100]  # headers of a.txt, its data (2 blocks), half of b's


def cut_at_an_entry(data: bytes) -> bytes:
    return data[: 3 * tarfile.BLOCKSIZE]  # a.txt whole, b.txt gone: the shorter archive of old


@pytest.mark.parametrize(
    "damage",
    [
        cut_in_a_file,
        cut_at_an_entry,
        lambda data: data + b"trailing garbage" * 64,
        lambda data: data[: -8 * tarfile.BLOCKSIZE] + b"\x01" + data[-8 * tarfile.BLOCKSIZE + 1 :],
    ],
    ids=["cut-in-a-file", "cut-at-an-entry", "trailing-garbage", "garbage-in-the-end-marker"],
)
def test_a_cut_or_padded_archive_is_rejected_whole(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    """Before: tarfile stopped at the first header it could not read, and the entries before it
    passed as the whole layer. The undamaged archive is accepted (the mutation check)."""
    archive = make_tar(tmp_path / "layer.tar", [(entry("a.txt"), b"a" * 600), (entry("b.txt"), b"b" * 600)])
    names = [e.member.name for e in layer.check(archive)]
    assert names == ["a.txt", "b.txt"]
    archive.write_bytes(damage(archive.read_bytes()))
    with pytest.raises(layer.HostileLayer):
        layer.check(archive)


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and owners need root")
def test_clean_layer_round_trip_keeps_whiteouts_links_modes_and_opaque_dirs(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "dir" / "sub").mkdir(parents=True)
    (upper / "dir" / "file").write_text("content\n")
    os.chmod(upper / "dir" / "file", 0o4750)
    os.chown(upper / "dir" / "file", 1234, 5678)
    os.symlink("/etc/passwd", upper / "abs-link")  # absolute targets resolve inside the container
    os.symlink("dir/file", upper / "rel-link")
    os.link(upper / "dir" / "file", upper / "hard")
    os.mknod(upper / "deleted", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # an overlay whiteout
    os.mkfifo(upper / "fifo")
    os.setxattr(upper / "dir" / "sub", layer.OPAQUE_XATTR, b"y")
    os.chmod(upper / "dir", 0o555)
    archive = tmp_path / "layer.tar"
    layer.archive(upper, archive)
    target = tmp_path / "new"
    target.mkdir()
    layer.install(archive, layer.check(archive), target)

    def describe(root: Path) -> list[tuple]:
        out = []
        for path in sorted(root.rglob("*")):
            st = path.lstat()
            out.append((
                str(path.relative_to(root)), stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                st.st_gid, st.st_rdev, st.st_nlink, int(st.st_mtime),
                os.readlink(path) if path.is_symlink() else None,
                path.read_bytes() if stat.S_ISREG(st.st_mode) else None,
            ))  # fmt: skip
        return out

    assert describe(target) == describe(upper)
    assert os.getxattr(target / "dir" / "sub", layer.OPAQUE_XATTR) == b"y"
    assert os.stat(target / "hard").st_ino == os.stat(target / "dir" / "file").st_ino


def test_sparse_files_are_archived_and_installed_sparse(tmp_path: Path) -> None:
    """A 1 GiB file with two small data regions: the archive holds the regions, not the holes, and
    the installed file has the same bytes and size while taking a few blocks. Mutation: without
    --sparse the archive is 1 GiB; writing every region as zeros gives a fully allocated file."""
    upper = tmp_path / "upper"
    upper.mkdir()
    big = upper / "big"
    with big.open("wb") as f:
        f.truncate(1 << 30)
        f.seek(123_456_789)
        f.write(b"middle")
        f.seek((1 << 30) - 4)
        f.write(b"tail")
    archive = tmp_path / "layer.tar"
    size = layer.archive(upper, archive)
    assert size < 1 << 20

    entries = layer.check(archive, max_bytes=1 << 20)  # counts data regions, not the apparent size
    target = tmp_path / "installed"
    target.mkdir()
    layer.install(archive, entries, target)
    installed = target / "big"
    assert installed.stat().st_size == 1 << 30
    assert installed.stat().st_blocks * 512 < 1 << 20
    with installed.open("rb") as f:
        f.seek(123_456_789 - 3)
        assert f.read(9) == b"\0\0\0middle"
        f.seek((1 << 30) - 6)
        assert f.read() == b"\0\0tail"


def test_a_sparse_map_reaching_outside_its_file_is_hostile(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    with (upper / "s").open("wb") as f:
        f.truncate(1 << 20)
        f.seek(4096 * 10)
        f.write(b"x" * 4096)
    archive = tmp_path / "layer.tar"
    layer.archive(upper, archive)
    data = archive.read_bytes()
    assert data.count(b"GNU.sparse.realsize=1048576") == 1
    # shrink the declared size below the data region: same length record, a region past the end
    archive.write_bytes(data.replace(b"GNU.sparse.realsize=1048576", b"GNU.sparse.realsize=0000010"))
    with pytest.raises(layer.HostileLayer, match="sparse"):
        layer.check(archive)


def test_an_empty_sparse_map_writes_nothing_and_counts_nothing_past_the_bound(tmp_path: Path) -> None:
    """A 10 KiB archive whose member claims 50 MiB and an empty sparse map (GNU tar itself writes a
    closing `(size, 0)` region; this map is edited to have none): installed as a hole, never as
    50 MiB of zeros. Mutation check: with `m.sparse or [(0, m.size)]` the whole size is written."""
    upper = tmp_path / "upper"
    upper.mkdir()
    with (upper / "h").open("wb") as f:
        f.truncate(50 << 20)
    archive = tmp_path / "layer.tar"
    layer.archive(upper, archive)
    data = archive.read_bytes()
    assert data.count(b"1\n52428800\n0\n") == 1  # the map: one region, empty, at the end
    archive.write_bytes(data.replace(b"1\n52428800\n0\n", b"0\n" + b"\0" * 11))
    entries = layer.check(archive, max_bytes=4096)
    (member,) = [e.member for e in entries if e.parts == ("h",)]
    assert member.sparse == []
    target = tmp_path / "installed"
    target.mkdir()
    layer.install(archive, entries, target)
    assert (target / "h").stat().st_size == 50 << 20
    assert (target / "h").stat().st_blocks == 0


def test_one_byte_regions_count_whole_blocks(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    with (upper / "dots").open("wb") as f:
        for i in range(64):
            f.seek(i * 65536)
            f.write(b".")
    archive = tmp_path / "layer.tar"
    layer.archive(upper, archive)
    layer.check(archive, max_bytes=64 * 4096)
    with pytest.raises(layer.HostileLayer, match="more than"):
        layer.check(archive, max_bytes=64 * 4096 - 1)
