"""Shared steps of the checkpointer tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiodocker
import msgspec

from belayer_rl.services.checkpointer.linux import HOST_CGROUPS, parent_of
from belayer_rl.services.checkpointer.store import (
    MANIFEST,
    FileSum,
    Manifest,
    Store,
    checkpoint_key,
    sha256_file,
)
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import SandboxEvent
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names


async def kill_container(container_id: str, docker_url: str | None = None) -> None:
    docker = aiodocker.Docker(url=docker_url)
    try:
        await docker.containers.container(container_id).kill()
    finally:
        await docker.close()


async def init_pid(container_id: str) -> int:
    docker = aiodocker.Docker()
    try:
        return int((await docker.containers.container(container_id).show())["State"]["Pid"])
    finally:
        await docker.close()


def freeze_behind_dockers_back(pid: int) -> None:
    """Freeze the cgroup holding `pid` through its freezer control, as Docker would, but without it."""
    control = HOST_CGROUPS.freezer(pid)
    assert control is not None, f"no freezer cgroup holds {pid}"
    control.write_text("FROZEN" if control.name == "freezer.state" else "1")


def stop_first_dump(container_id: str, program: str, within_s: float) -> int:
    """SIGSTOP the first `runc checkpoint` of the container seen within `within_s` (`program`
    "runc"), or the CRIU that runc starts ("criu") once the dump has written pages, and return its
    pid (0: none seen). runc also runs a CRIU of its own before the dump, to learn its version.
    Polls /proc without pause: the process must be caught while it runs."""
    deadline = time.monotonic() + within_s
    wanted = container_id.encode()
    while time.monotonic() < deadline:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                argv = Path(entry.path, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if not (argv[0].endswith(b"runc") and b"checkpoint" in argv and wanted in argv):
                continue
            runc = int(entry.name)
            if program == "runc":
                os.kill(runc, signal.SIGSTOP)
                return runc
            images = Path(argv[argv.index(b"--image-path") + 1].decode())
            if any(images.glob("pages-*.img")) and (criu := child_named(runc, "criu")):
                os.kill(criu, signal.SIGSTOP)
                return criu
    return 0


def child_named(parent: int, name: str) -> int:
    """A child of `parent` whose command name is `name` (CRIU rewrites its command line); 0 when
    none."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (
                    parent_of(int(entry.name)) == parent
                    and Path(entry.path, "comm").read_text().strip() == name
                ):
                    return int(entry.name)
    return 0


def checkpoint_dir(state_dir: Path, trajectory: str, checkpoint_id: str) -> Path:
    return state_dir / "checkpoints" / trajectory / checkpoint_id


def reseal(folder: Path, key_file: Path) -> None:
    """Rewrite the manifest's checksums to match the folder and sign it with the checkpointer's own
    key: a tampered artifact that neither the checksums nor the MAC would catch (an attacker who
    holds the key), left to the layer's own checks."""
    manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=Manifest)
    files = [
        FileSum(path=f.path, size=(folder / f.path).stat().st_size, sha256=sha256_file(folder / f.path))
        for f in manifest.files
    ]
    store = Store(folder.parent.parent, checkpoint_key(key_file, create=False))
    store.write_signed(folder / MANIFEST, msgspec.json.encode(msgspec.structs.replace(manifest, files=files)))


def rewrite_spec(folder: Path, key_file: Path, **changes: object) -> None:
    """Sign the manifest again with its spec changed: a checkpoint as an earlier checkpointer wrote
    it (one holding the key)."""
    manifest = msgspec.json.decode((folder / MANIFEST).read_bytes(), type=Manifest)
    spec = msgspec.structs.replace(manifest.spec, **changes)
    store = Store(folder.parent.parent, checkpoint_key(key_file, create=False))
    store.write_signed(folder / MANIFEST, msgspec.json.encode(msgspec.structs.replace(manifest, spec=spec)))


def replace_layer(folder: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], key_file: Path) -> None:
    import io

    with tarfile.open(folder / "layer.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    reseal(folder, key_file)


@contextlib.asynccontextmanager
async def events(nats_url: str, pattern: str = NAMES.events_all) -> AsyncIterator[list[SandboxEvent]]:
    """Collect sandbox events published while the block runs."""
    nc = await bus.connect(nats_url, "test-events")
    seen: list[SandboxEvent] = []
    decoder = protocol.decoder_for(SandboxEvent)

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(protocol.BadMessage):
            seen.append(protocol.decode(decoder, msg.data))

    sub = await nc.subscribe(pattern, cb=on)
    try:
        yield seen
        await asyncio.sleep(0.2)
    finally:
        await sub.unsubscribe()
        await nc.close()
