"""Failures around checkpoints: corrupt and hostile artifacts, crashes at each phase, CRIU failing,
a full disk. In every case the pointer stays on the previous ready checkpoint and restore works."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.linux import ProcScanner, process_alive
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import CHECKPOINT_PHASES
from belayer_rl.shared.protocol import SandboxRestored, SandboxSpec
from tests.support import poll

from .conftest import ROOT, Service
from .helpers import checkpoint_dir, events, kill_container, replace_layer, rewrite_spec, stop_first_dump
from .test_layer import entry, hostile_members

COUNTER = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/seen; sleep 0.1; done) >/dev/null 2>&1 </dev/null &"
SEEN = 'v=; while [ -z "$v" ]; do v=$(cat /tmp/seen); done; echo $v'  # the writer truncates first


async def two_checkpoints(
    client: SandboxClient, sandbox: str, trajectory: str, image: str
) -> tuple[str, str]:
    """Sandbox with a file per step: checkpoints at k=1 (file one) and k=2 (files one, two)."""
    await client.create(SandboxSpec(image=image, user=ROOT), sandbox=sandbox)
    await client.exec(sandbox, f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint(sandbox, trajectory, k=1, context_tokens=[1])
    await client.exec(sandbox, "echo two > /tmp/two")
    second = await client.checkpoint(sandbox, trajectory, k=2, context_tokens=[1, 2])
    return first.checkpoint_id, second.checkpoint_id


async def assert_restored_at_one(client: SandboxClient, sandbox: str) -> None:
    files = await client.exec(
        sandbox, f"cat /tmp/one; ls /tmp/two 2>/dev/null; sleep 0.3; {SEEN}", expect_step=1
    )
    lines = files.stdout.split()
    assert lines[0] == "one" and "/tmp/two" not in lines and int(lines[-1]) > 0
    # the counter process came back from the checkpoint: it keeps writing
    later = await client.exec(sandbox, f"sleep 0.5; {SEEN}")
    assert int(later.stdout) > int(lines[-1])


async def dump_in_flight(procs: ProcScanner, container_id: str) -> bool:
    """Whether a dump of the container runs; /proc not read in time counts as one, as the
    checkpointer counts it."""
    dumps = await procs.dumps_in_flight()
    return dumps is None or container_id in dumps


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["flip-criu", "truncate-layer", "drop-manifest", "edit-context", "edit-manifest"]
)
async def test_corrupt_newest_falls_back_to_previous(
    client: SandboxClient, service: Service, image: str, damage: str
) -> None:
    first, second = await two_checkpoints(client, "c", "traj-c", image)
    folder = checkpoint_dir(service.state_dir, "traj-c", second)
    if damage == "flip-criu":
        flip_byte(max((folder / "criu").iterdir(), key=lambda p: p.stat().st_size))
    elif damage == "truncate-layer":
        os.truncate(folder / "layer.tar", (folder / "layer.tar").stat().st_size // 2)
    elif damage == "drop-manifest":
        (folder / "manifest.json").unlink()
    elif damage == "edit-context":
        (folder / "context.json").write_text('{"tokens":[9,9],"ref":""}')
    else:  # the settings of the container to create, edited; the MAC no longer matches
        manifest = (folder / "manifest.json").read_text()
        assert manifest.count('"cap_add": []') == 1
        (folder / "manifest.json").write_text(manifest.replace('"cap_add": []', '"cap_add": ["SYS_ADMIN"]'))
    async with events(service.nats_url) as seen:
        restored = await client.restore("traj-c")
    assert folder.is_dir() == (damage == "edit-manifest")  # refused for its MAC only: kept
    assert (restored.source, restored.checkpoint_id, restored.k) == ("previous", first, 1)
    assert restored.incarnation == 1 and restored.context_tokens == [1]
    assert len(restored.rejected) == 1 and second in restored.rejected[0]
    assert any(isinstance(e, SandboxRestored) and e.source == "previous" for e in seen)
    await assert_restored_at_one(client, "c")
    # the new incarnation checkpoints on from its own k
    three = await client.exec("c", "echo three > /tmp/three")
    again = await client.checkpoint("c", "traj-c", k=three.step)
    assert (again.incarnation, again.k) == (1, 4)


async def test_everything_corrupt_falls_back_to_base(
    client: SandboxClient, service: Service, image: str
) -> None:
    first, second = await two_checkpoints(client, "b", "traj-b", image)
    for checkpoint_id in (first, second):
        flip_byte(checkpoint_dir(service.state_dir, "traj-b", checkpoint_id) / "layer.tar")
    restored = await client.restore("traj-b")
    assert (restored.source, restored.k, restored.incarnation, restored.checkpoint_id) == ("base", 0, 1, "")
    assert len(restored.rejected) == 2
    fresh = await client.exec("b", "ls /tmp/one /tmp/two 2>&1; echo done", expect_step=0)
    assert "No such file" in fresh.stdout


async def test_a_checkpoint_whose_spec_names_no_user_restores_as_the_images_user(
    client: SandboxClient, service: Service, image: str
) -> None:
    """Checkpoints made before specs named the image's user hold `user: ""`; the init now runs as
    root, so such a restore must still run the actions as the image's USER (nobody here), not as
    root. Mutation, run by hand: without the USER filled in by `fresh_container`, `id -u` answers 0."""
    await client.create(SandboxSpec(image=image), sandbox="u")
    await client.exec("u", "echo kept > /tmp/kept")
    first = await client.checkpoint("u", "traj-u", k=1)
    rewrite_spec(
        checkpoint_dir(service.state_dir, "traj-u", first.checkpoint_id),
        service.state_dir / "checkpoint.key",
        user="",
    )
    restored = await client.restore("traj-u")
    assert (restored.source, restored.checkpoint_id) == ("latest", first.checkpoint_id)
    after = await client.exec("u", "id -u; cat /tmp/kept", expect_step=1)
    assert after.stdout == "65534\nkept\n"


@pytest.mark.parametrize("variant", sorted(hostile_members(Path("/x"))))
async def test_hostile_layer_rejected_and_clean_one_restores(
    client: SandboxClient, service: Service, image: str, canary_dir: Path, variant: str
) -> None:
    first, second = await two_checkpoints(client, "h", "traj-h", image)
    folder = checkpoint_dir(service.state_dir, "traj-h", second)
    replace_layer(
        folder,
        [(entry("two"), b"two\n"), *hostile_members(canary_dir)[variant]],
        service.state_dir / "checkpoint.key",
    )
    restored = await client.restore("traj-h")
    assert (restored.source, restored.checkpoint_id) == ("previous", first)
    assert "HostileLayer" in restored.rejected[0]
    assert (canary_dir / "canary").read_text() == "untouched\n"
    assert sorted(os.listdir(canary_dir)) == ["canary"]
    await assert_restored_at_one(client, "h")  # the clean artifact beside it restores


@pytest.mark.parametrize("phase", CHECKPOINT_PHASES)
async def test_checkpointer_killed_at_each_phase(
    client: SandboxClient, service: Service, image: str, phase: str
) -> None:
    info = await client.create(SandboxSpec(image=image, user=ROOT), sandbox="p")
    await client.exec("p", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("p", "traj-p", k=1)
    await client.exec("p", "echo two > /tmp/two")
    service.stop()
    service.start("--crash-at", phase)
    await service.ready(client)
    attempt = asyncio.create_task(client.checkpoint("p", "traj-p", k=2, timeout_s=30))
    assert service.process is not None
    for _ in range(600):  # the process SIGKILLs itself at the phase
        if service.process.poll() is not None or attempt.done():
            break
        await asyncio.sleep(0.05)
    attempt.cancel()  # nobody will answer it
    with contextlib.suppress(asyncio.CancelledError, ServiceError):
        await attempt
    assert service.process.wait(10) == -9
    service.start()
    await service.ready(client)
    # reconcile unfroze the container; nothing half-written is left
    alive = await client.exec("p", "cat /tmp/two")
    assert alive.stdout == "two\n"
    leftovers = sorted(p.name for p in (service.state_dir / "checkpoints" / "traj-p").iterdir())
    await kill_container(info.container_id)
    restored = await client.restore("traj-p")
    if phase != "advance":
        assert leftovers == sorted([first.checkpoint_id, "trajectory.json", "trajectory.mac"])
        assert (restored.source, restored.checkpoint_id, restored.k) == ("latest", first.checkpoint_id, 1)
        await assert_restored_at_one(client, "p")
        return
    # Published whole, its pointer update lost with the process: the restart adopts it (E_2 with
    # its own L_2), rather than deleting a ready checkpoint for want of metadata.
    (adopted,) = set(leftovers) - {first.checkpoint_id, "trajectory.json", "trajectory.mac"}
    assert len(leftovers) == 4
    assert (restored.source, restored.checkpoint_id, restored.k) == ("latest", adopted, 2)
    files = await client.exec("p", "cat /tmp/one /tmp/two", expect_step=2)
    assert files.stdout == "one\ntwo\n"


async def test_checkpointer_killed_mid_dump(client: SandboxClient, service: Service, image: str) -> None:
    """A checkpointer SIGKILLed mid-dump leaves runc and CRIU running (a session of their own) and
    the sandbox frozen. Its successor is ready and serves the host's other sandboxes at once, and
    holds the frozen one until the dump ends. Here CRIU is SIGSTOPped, as a slow dump of a large
    memory on a loaded host would be, and continued once the other sandbox was served. (A
    successor that waited for the dump before being ready failed CI's 20 s readiness check.)"""
    await client.create(SandboxSpec(image=image, user=ROOT), sandbox="d-other")
    info = await client.create(SandboxSpec(image=image, user=ROOT, memory_mb=2048), sandbox="d")
    await client.exec("d", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("d", "traj-d", k=1)
    await client.exec("d", "echo two > /tmp/two; (exec memhold 1500) >/dev/null 2>&1 </dev/null & sleep 3")
    attempt = asyncio.create_task(client.checkpoint("d", "traj-d", k=2, timeout_s=30))
    criu = await asyncio.to_thread(stop_first_dump, info.container_id, "criu", 20.0)
    service.kill()
    attempt.cancel()  # nobody will answer it; had it completed, the restore below would say so
    with contextlib.suppress(asyncio.CancelledError, ServiceError):
        await attempt
    assert criu > 0, "no CRIU dumping the sandbox was seen"
    try:
        service.start()
        await service.ready(client)
        assert (await client.exec("d-other", "echo served")).stdout == "served\n"
        held = asyncio.create_task(client.exec("d", "cat /tmp/two"))
        await asyncio.sleep(1.0)
        assert not held.done(), "an action ran on a sandbox still frozen by its orphaned dump"
    finally:
        os.kill(criu, signal.SIGCONT)
    assert (await held).stdout == "two\n"
    # the orphaned dump's half-written checkpoint was removed once it ended
    leftovers = sorted(p.name for p in (service.state_dir / "checkpoints" / "traj-d").iterdir())
    assert leftovers == sorted([first.checkpoint_id, "trajectory.json", "trajectory.mac"])
    await kill_container(info.container_id)
    restored = await client.restore("traj-d")
    assert (restored.source, restored.checkpoint_id) == ("latest", first.checkpoint_id)
    await assert_restored_at_one(client, "d")


async def test_criu_failure_keeps_previous(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image, user=ROOT), sandbox="g")
    await client.exec("g", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("g", "traj-g", k=1)
    # an open, deleted file larger than CRIU's ghost limit: CRIU refuses to dump it
    await client.exec("g", "echo two > /tmp/two; head -c 3000000 /dev/zero > /ghost; "
                           "(exec 3</ghost; exec sleep 100000) >/dev/null 2>&1 </dev/null & sleep 0.2; rm /ghost")  # fmt: skip
    with pytest.raises(ServiceError) as failed:
        await client.checkpoint("g", "traj-g", k=2)
    assert failed.value.code == "checkpoint-failed"
    assert (await client.exec("g", "echo still running")).stdout == "still running\n"  # unfrozen
    restored = await client.restore("traj-g")
    assert (restored.source, restored.checkpoint_id) == ("latest", first.checkpoint_id)
    await assert_restored_at_one(client, "g")


@pytest.fixture
def small_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


async def test_disk_full_keeps_previous(
    docker_env: str, nats_url: str, tmp_path: Path, small_tmpfs: Path
) -> None:
    from belayer_rl.shared import bus

    from .conftest import remove_host_containers

    svc = Service(nats_url, "tfull", small_tmpfs / "state", tmp_path / "checkpointer.log")
    svc.start()
    nc = await bus.connect(nats_url, "test-client")
    client = SandboxClient(nc, svc.host_id)
    try:
        await svc.ready(client)
        await client.create(SandboxSpec(image=docker_env, user=ROOT), sandbox="f")
        await client.exec("f", f"echo one > /tmp/one; {COUNTER}")
        first = await client.checkpoint("f", "traj-f", k=1)
        await client.exec("f", "echo two > /tmp/two; head -c 8000000 /dev/urandom > /big")
        with pytest.raises(ServiceError) as failed:
            await client.checkpoint("f", "traj-f", k=2)
        assert failed.value.code == "checkpoint-failed"
        restored = await client.restore("traj-f")
        assert (restored.source, restored.checkpoint_id) == ("latest", first.checkpoint_id)
        await assert_restored_at_one(client, "f")
    finally:
        await nc.close()
        svc.stop()
        await remove_host_containers(svc.host_id)


async def test_checkpoint_timeout_returns_but_sandbox_stays_locked_until_dump_ends(
    client: SandboxClient, image: str
) -> None:

    procs = ProcScanner()

    info = await client.create(SandboxSpec(image=image, user=ROOT, memory_mb=3072), sandbox="slow")
    await client.exec("slow", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("slow", "traj-slow", k=1)
    await client.exec("slow", "(exec memhold 2500) >/dev/null 2>&1 </dev/null & sleep 4")
    with pytest.raises(ServiceError) as late:
        await client.checkpoint("slow", "traj-slow", k=2, timeout_s=0.3)
    assert late.value.code == "timeout"
    dumping = False
    for _ in range(40):  # the dump of 2.5 GiB runs on after the caller's timeout
        if dumping := await dump_in_flight(procs, info.container_id):
            break
        await asyncio.sleep(0.05)
    after = await client.exec("slow", "echo after")  # queued behind the dump
    assert after.stdout == "after\n" and not await dump_in_flight(procs, info.container_id)
    assert dumping  # the caller got its error while CRIU was still writing
    await kill_container(info.container_id)
    restored = await client.restore("traj-slow")
    assert (restored.source, restored.checkpoint_id) == ("latest", first.checkpoint_id)  # discarded


@pytest.mark.parametrize("stopped", ["runc", "criu"])
async def test_a_dump_that_stops_making_progress_is_killed_and_the_sandbox_restored(
    service: Service, client: SandboxClient, image: str, stopped: str
) -> None:
    """CRIU was seen stuck in wait4 for good after a container kill mid-dump: it held the sandbox's
    lock, and Docker could no longer kill the container. That hang cannot be made on demand; a
    SIGSTOP hangs a dump the same way (nothing more is written, no CPU used), so the test stops
    the real runc of the real dump as soon as it starts, or the CRIU it started once it writes
    pages (2.5 GiB to write). The dump is killed, and the sandbox, whose processes CRIU may have
    left damaged, fails and is restored from its latest checkpoint."""
    service.stop()
    service.start("--dump-stall", "2")
    await service.ready(client)
    info = await client.create(SandboxSpec(image=image, user=ROOT, memory_mb=3072), sandbox="stuck")
    await client.exec("stuck", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("stuck", "traj-stuck", k=1)
    ballast = "(exec memhold 2500) >/dev/null 2>&1 </dev/null & sleep 4" if stopped == "criu" else "true"
    await client.exec("stuck", f"echo two > /tmp/two; {ballast}")
    stopping = asyncio.create_task(asyncio.to_thread(stop_first_dump, info.container_id, stopped, 20.0))
    try:
        with pytest.raises(ServiceError) as stuck:
            await client.checkpoint("stuck", "traj-stuck", k=2, timeout_s=60.0)
    finally:
        pid = await stopping
        if process_alive(pid):  # the test failed: nothing is left stopped
            os.kill(pid, signal.SIGKILL)
    assert pid > 0, f"no {stopped} dumping the sandbox was seen"
    assert stuck.value.code == "env-failure", stuck.value.message
    assert "dump-stuck: the dump made no progress for 2s" in stuck.value.message
    assert not process_alive(pid)  # killed, not left stopped
    restored = await client.restore("traj-stuck")
    assert (restored.checkpoint_id, restored.k) == (first.checkpoint_id, 1)
    after = await client.exec("stuck", "cat /tmp/one; ls /tmp/two 2>/dev/null; echo .")
    assert after.stdout == "one\n.\n"
    await client.checkpoint("stuck", "traj-stuck", k=after.step)  # and the next dump works


async def test_artifact_moves_to_another_host(
    client: SandboxClient, service: Service, image: str, tmp_path: Path
) -> None:
    import shutil

    from belayer_rl.shared import bus

    from .conftest import remove_host_containers

    info = await client.create(SandboxSpec(image=image, user=ROOT), sandbox="mv")
    await client.exec("mv", f"echo one > /tmp/one; {COUNTER}")
    first = await client.checkpoint("mv", "traj-mv", k=1, context_tokens=[7])
    await kill_container(info.container_id)  # the first host's sandbox is lost
    key = ["--checkpoint-key", str(service.state_dir / "checkpoint.key")]  # the hosts share one
    other = Service(service.nats_url, "tother", tmp_path / "other-state", tmp_path / "other.log", extra=key)
    other.start()
    nc = await bus.connect(service.nats_url, "test-other")
    there = SandboxClient(nc, other.host_id)
    try:
        await other.ready(there)
        with pytest.raises(ServiceError) as wrong:
            await there.restore("traj-mv")
        assert wrong.value.code == "wrong-host"
        shutil.copytree(
            service.state_dir / "checkpoints" / "traj-mv", other.state_dir / "checkpoints" / "traj-mv"
        )
        restored = await there.restore("traj-mv")
        assert (restored.source, restored.checkpoint_id, restored.context_tokens) == (
            "latest",
            first.checkpoint_id,
            [7],
        )
        assert restored.incarnation == first.incarnation + 1  # moving hosts starts a new incarnation
        await assert_restored_at_one(there, "mv")
        listing = await there.list()
        assert [(s.sandbox, s.state, s.step) for s in listing.sandboxes] == [("mv", "running", 3)]
    finally:
        await nc.close()
        other.stop()
        await remove_host_containers(other.host_id)


async def test_checkpoint_travels_through_the_object_store(
    service: Service, image: str, tmp_path: Path
) -> None:
    from belayer_rl.shared import bus

    from .conftest import remove_host_containers

    service.stop()
    service.start("--object-store")
    key = ["--checkpoint-key", str(service.state_dir / "checkpoint.key")]  # the hosts share one
    other = Service(
        service.nats_url, "tfar", tmp_path / "far-state", tmp_path / "far.log", extra=["--object-store", *key]
    )
    nc = await bus.connect(service.nats_url, "test-objects")
    here, there = SandboxClient(nc, service.host_id), SandboxClient(nc, other.host_id)
    try:
        await service.ready(here)  # it has made the key the other host is given
        other.start()
        await other.ready(there)
        info = await here.create(SandboxSpec(image=image, user=ROOT), sandbox="far")
        await here.exec("far", f"echo one > /tmp/one; {COUNTER}")
        first = await here.checkpoint("far", "traj-far", k=1, context_tokens=[4, 2])
        await kill_container(info.container_id)  # the first host's sandbox is lost
        for _ in range(100):  # the upload runs in the background
            try:
                restored = await there.restore("traj-far")
                break
            except ServiceError as exc:
                assert exc.code == "wrong-host"
                await asyncio.sleep(0.1)
        assert (restored.source, restored.checkpoint_id, restored.context_tokens) == (
            "latest",
            first.checkpoint_id,
            [4, 2],
        )
        await assert_restored_at_one(there, "far")
        first_host_copies = service.state_dir / "checkpoints" / "traj-far"
        assert first_host_copies.is_dir()
        await there.end("traj-far")  # the second host ends it: the first host's copies go too

        async def gone() -> bool | None:
            return True if not first_host_copies.exists() else None

        await poll(gone, timeout_s=10, every_s=0.1)
    finally:
        await nc.close()
        other.stop()
        await remove_host_containers(other.host_id)
