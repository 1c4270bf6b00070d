"""The weight server as a real process: versions, pins, publication, dead holders, bad input,
SIGTERM and SIGKILL + restart, and what each leaves in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import nats.js.errors
import pytest
import torch

from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared import protocol, segments
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.params import init_params, save_params, seed_version
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.processes import free_port
from belayer_rl.shared.protocol import (
    Ack,
    ServerPing,
    WeightHandles,
    WeightServerAlive,
    WeightsHandlesRequest,
    WeightsList,
    WeightsPin,
    WeightsPublish,
    WeightsPublished,
    WeightsUnpin,
    WeightVersions,
)
from belayer_rl.shared.subjects import Subjects
from tests.servers.helpers import REPO, call, encode_json, error_code, error_of, running, shm_names, start
from tests.support import poll

NAMES = Subjects()  # the default cluster's names

V0 = seed_version(0, "tiny")


async def versions(nc) -> WeightVersions:
    return await call(nc, NAMES.weights_list, WeightsList(), WeightVersions)


async def pin(nc, holder: str, pid: int, version: str | None = None) -> WeightHandles:
    return await call(
        nc, NAMES.weights_pin("e0"), WeightsPin(version=version, holder=holder, pid=pid), WeightHandles
    )


async def publish(nc, path: Path) -> WeightHandles:
    return await call(nc, NAMES.weights_publish, WeightsPublish(path=str(path)), WeightHandles)


def weights_file(
    tmp_path: Path, seed: int, preset: str = "tiny"
) -> tuple[Path, dict[str, torch.Tensor], str]:
    params = init_params(PRESETS[preset], seed)
    path = tmp_path / f"weights-{preset}-{seed}.pt"
    version = save_params(params, path)
    return path, params, version


async def test_pin_publish_unpin_frees_old_version(nats_server, nc, shm_prefix, tmp_path) -> None:
    announced: list[WeightsPublished] = []

    async def on_published(msg) -> None:  # type: ignore[no-untyped-def]
        announced.append(protocol.decode(protocol.decoder_for(WeightsPublished), msg.data))

    await nc.subscribe(NAMES.weights_published("*"), cb=on_published)
    async with running(
        "weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "tiny", "--free-grace", "0"
    ) as server:
        alive = await call(nc, NAMES.weights_ping, ServerPing(), WeightServerAlive)
        assert (alive.pid, alive.newest, alive.versions) == (server.pid, V0, [V0])

        old = await pin(nc, "worker-a", os.getpid())
        assert old.version == V0
        old_params = segments.map_weights(old)
        reference = init_params(PRESETS["tiny"], 0)
        assert all(torch.equal(old_params[name], reference[name]) for name in reference)

        path, new_params, new_version = weights_file(tmp_path, seed=7)
        new = await publish(nc, path)
        assert new.version == new_version != V0
        listed = await versions(nc)
        assert listed.newest == new_version
        assert [(v.version, v.holders) for v in listed.versions] == [(V0, ["e0:worker-a"]), (new_version, [])]
        mapped_new = segments.map_weights(new)
        assert all(torch.equal(mapped_new[name], new_params[name]) for name in new_params)
        await poll(lambda: asyncio.sleep(0, announced or None), timeout_s=10)
        assert (announced[0].version, announced[0].previous) == (new_version, V0)

        # Publishing the same file again is idempotent: same segment, still the newest.
        again = await publish(nc, path)
        assert again.segment == new.segment

        # The newest version stays even unpinned; the old one goes once its last holder lets go.
        unpinned = await call(nc, NAMES.weights_unpin("e0"), WeightsUnpin(version=V0, holder="worker-a"), Ack)
        assert unpinned.detail == "unpinned"
        listed = await versions(nc)
        assert [v.version for v in listed.versions] == [new_version]
        assert old.segment not in shm_names(shm_prefix)
        # A mapping made before the free stays valid: freeing unlinks, it does not unmap.
        assert all(torch.equal(old_params[name], reference[name]) for name in reference)
        assert await error_code(nc, NAMES.weights_handles, WeightsHandlesRequest(version=V0)) == (
            "unknown-version"
        )
        with pytest.raises(segments.MappingError):
            segments.map_weights(old)
        client = WeightClient(nc)
        assert "was freed" in (await client.why_not_owned(old) or "")
        assert await client.why_not_owned(new) is None

        not_pinned = await call(
            nc, NAMES.weights_unpin("e0"), WeightsUnpin(version=new_version, holder="worker-a"), Ack
        )
        assert not_pinned.detail == "not pinned"
        newest = await call(nc, NAMES.weights_handles, WeightsHandlesRequest(), WeightHandles)
        assert newest == new


async def test_pins_of_a_dead_holder_are_swept(nats_server, nc, shm_prefix, tmp_path) -> None:
    holder = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(600)")
    try:
        async with running(
            "weight_server",
            nats_server.url,
            shm_prefix,
            tmp_path,
            "--sweep-interval",
            "0.1",
            "--free-grace",
            "2",
        ):
            old = await pin(nc, "worker-doomed", holder.pid)
            path, _, new_version = weights_file(tmp_path, seed=3)
            await publish(nc, path)
            await asyncio.sleep(0.5)  # several sweeps: a live holder keeps its version
            assert [v.version for v in (await versions(nc)).versions] == [V0, new_version]

            holder.kill()
            await holder.wait()
            await asyncio.sleep(0.5)  # its pin is dropped; unneeded, the version waits out the grace
            assert [v.version for v in (await versions(nc)).versions] == [V0, new_version]

            async def old_gone() -> bool | None:
                listed = await versions(nc)
                return True if [v.version for v in listed.versions] == [new_version] else None

            await poll(old_gone, timeout_s=10)
            assert old.segment not in shm_names(shm_prefix)
    finally:
        if holder.returncode is None:
            holder.kill()
            await holder.wait()


async def test_bad_input_gets_error_replies_and_the_server_keeps_serving(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    async with running("weight_server", nats_server.url, shm_prefix, tmp_path) as server:
        garbage = tmp_path / "garbage.pt"
        garbage.write_bytes(b"\x00not a torch file" * 100)
        other_preset, _, _ = weights_file(tmp_path, seed=1, preset="small")
        dead = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await dead.wait()

        raw = {
            "malformed": (NAMES.weights_pin("e0"), b"{not json"),
            "empty": (NAMES.weights_handles, b""),
            "wrong types": (
                NAMES.weights_pin("e0"),
                encode_json({"type": "weights_pin", "holder": 5, "pid": "x"}),
            ),
            "wrong tag": (NAMES.weights_pin("e0"), encode_json({"type": "kv_flush", "engine_id": "e0"})),
            "bad holder": (
                NAMES.weights_pin("e0"),
                encode_json({"type": "weights_pin", "holder": "a b/c", "pid": os.getpid()}),
            ),
            "negative pid": (
                NAMES.weights_pin("e0"),
                encode_json({"type": "weights_pin", "holder": "h", "pid": -1}),
            ),
            "bad version": (
                NAMES.weights_handles,
                encode_json({"type": "weights_handles", "version": "a.b"}),
            ),
            "newer schema": (NAMES.weights_list, encode_json({"type": "weights_list", "v": 99})),
        }
        for name, (subject, payload) in raw.items():
            reply = await error_of(nc, subject, payload)
            assert reply.code == "bad-request", name

        typed = {
            "unknown version handles": (NAMES.weights_handles, WeightsHandlesRequest(version="sha256:0")),
            "unknown version pin": (
                NAMES.weights_pin("e0"),
                WeightsPin(version="nope", holder="h", pid=os.getpid()),
            ),
            "unknown version unpin": (NAMES.weights_unpin("e0"), WeightsUnpin(version="nope", holder="h")),
            "dead holder": (NAMES.weights_pin("e0"), WeightsPin(holder="h", pid=dead.pid)),
            "relative path": (NAMES.weights_publish, WeightsPublish(path="weights.pt")),
            "missing file": (NAMES.weights_publish, WeightsPublish(path=str(tmp_path / "none.pt"))),
            "not weights": (NAMES.weights_publish, WeightsPublish(path=str(garbage))),
            "other preset": (NAMES.weights_publish, WeightsPublish(path=str(other_preset))),
            "a directory": (NAMES.weights_publish, WeightsPublish(path=str(tmp_path))),
        }
        codes = {name: await error_code(nc, subject, message) for name, (subject, message) in typed.items()}
        assert codes == {
            "unknown version handles": "unknown-version",
            "unknown version pin": "unknown-version",
            "unknown version unpin": "unknown-version",
            "dead holder": "dead-holder",
            "relative path": "bad-weights",
            "missing file": "bad-weights",
            "not weights": "bad-weights",
            "other preset": "bad-weights",
            "a directory": "bad-weights",
        }

        alive = await call(nc, NAMES.weights_ping, ServerPing(), WeightServerAlive)
        assert (alive.pid, alive.versions) == (server.pid, [V0])
        assert server.process.returncode is None
        assert len(shm_names(f"{shm_prefix}.w.")) == 2  # the one version and the lock


async def test_sigterm_leaves_nothing_in_dev_shm(nats_server, nc, shm_prefix, tmp_path) -> None:
    server = await start("weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "small")
    await pin(nc, "worker-a", os.getpid())
    path, _, _ = weights_file(tmp_path, seed=5, preset="small")
    await publish(nc, path)
    assert len(shm_names(shm_prefix)) == 3  # two versions and the lock

    server.process.send_signal(signal.SIGTERM)
    code = await asyncio.wait_for(server.process.wait(), 30)

    assert code == 0, server.output()
    assert shm_names(shm_prefix) == []


async def test_sigkill_then_restart_removes_the_dead_instances_segments(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    first = await start("weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "small")
    old = await pin(nc, "worker-a", os.getpid())
    path, _, _ = weights_file(tmp_path, seed=5, preset="small")
    await publish(nc, path)
    first.process.kill()
    await first.process.wait()
    left = shm_names(shm_prefix)
    assert len(left) == 3  # a SIGKILL leaves the segments: the restart must clean them

    async with running("weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "small") as second:
        alive = await call(nc, NAMES.weights_ping, ServerPing(), WeightServerAlive)
        assert alive.pid == second.pid and alive.versions == [seed_version(0, "small")]
        now = shm_names(shm_prefix)
        assert not set(now) & (set(left) - {f"{shm_prefix}.w.lock"})
        assert len(now) == 2
        with pytest.raises(segments.MappingError):
            segments.map_weights(old)  # the dead instance's handle maps nothing of the new one
        assert "restarted" in (await WeightClient(nc).why_not_owned(old) or "")
    assert second.process.returncode == 0
    assert "not answering" in (await WeightClient(nc, timeout_s=0.5).why_not_owned(old) or "")
    assert shm_names(shm_prefix) == []


async def test_a_second_server_on_a_live_prefix_is_refused(nats_server, nc, shm_prefix, tmp_path) -> None:
    async with running("weight_server", nats_server.url, shm_prefix, tmp_path) as server:
        before = shm_names(shm_prefix)
        with pytest.raises(RuntimeError, match="exited with 1"):
            await start("weight_server", nats_server.url, shm_prefix, tmp_path)
        assert shm_names(shm_prefix) == before
        alive = await call(nc, NAMES.weights_ping, ServerPing(), WeightServerAlive)
        assert alive.pid == server.pid


@pytest.mark.parametrize("kind", ["weight_server", "kv_server"])
async def test_sigterm_without_a_reachable_nats_leaves_nothing(kind, shm_prefix, tmp_path) -> None:
    log = tmp_path / f"{kind}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"belayer_rl.services.{kind}",
            "--nats", f"nats://127.0.0.1:{free_port()}", "--shm-prefix", shm_prefix,
            stdout=out, stderr=out, cwd=REPO,
        )  # fmt: skip
    try:
        await poll(lambda: asyncio.sleep(0, shm_names(shm_prefix) or None), timeout_s=60)
        await asyncio.sleep(0.5)  # inside the connect retries by now
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0, log.read_text()
    assert shm_names(shm_prefix) == []


async def test_weights_published_over_the_bus_need_no_shared_disk(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    """A trainer's weights travel through the weights bucket: the version is the file's digest,
    the object is gone once loaded, and weights with a NaN are refused while the version before
    them stays the newest. An unknown object and a request naming both sources are clear errors."""
    async with running("weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "tiny") as server:
        await published_over_the_bus(nc, server, tmp_path)


async def published_over_the_bus(nc, server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    client = WeightClient(nc, subjects=NAMES)
    params = init_params(PRESETS["tiny"], 3)
    (tmp_path / "local").mkdir()
    # torch.save names the archive after the file, so the same name gives the same digest.
    expected = save_params(params, tmp_path / "local" / "weights.pt")

    handles = await client.publish_params(params)
    assert handles.version == expected
    alive = await client.ping()
    assert alive.newest == expected and alive.versions == [V0, expected]
    objects = await nc.jetstream().object_store(NAMES.weights_object_bucket)
    with pytest.raises(nats.js.errors.NotFoundError):  # what nats-py says of a bucket with no live object
        await objects.list(ignore_deletes=True)

    poisoned = dict(params, lm_head=params["lm_head"].clone())
    poisoned["lm_head"][0, 0] = float("nan")
    with pytest.raises(ServiceError) as refused:
        await client.publish_params(poisoned)
    assert refused.value.code == "bad-weights" and "non-finite" in str(refused.value)
    assert (await client.ping()).newest == expected

    unknown = await error_code(nc, NAMES.weights_publish, WeightsPublish(object_name="nothing-here"))
    assert unknown == "unknown-object"
    both = encode_json({"type": "weights_publish", "path": "/x", "object_name": "y"})
    assert (await error_of(nc, NAMES.weights_publish, both)).code == "bad-request"
    assert server.process.returncode is None


async def test_one_engine_holds_at_most_its_quota_of_pins_and_only_its_own(
    nats_server, nc, shm_prefix, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Finding 6 of the trust review: pins took holder and pid from the payload, so one engine could
    pin every version under made-up holders (pid 1 lives for ever) until /dev/shm filled, and unpin
    another engine's pins. Now a pin counts against the quota of the engine whose subject it came
    on (only that engine's credential publishes there), and holders are that engine's own."""
    async with running(
        "weight_server", nats_server.url, shm_prefix, tmp_path, "--preset", "tiny",
        "--max-pins-per-engine", "2",
    ):  # fmt: skip
        versions = [V0]
        for seed in (7, 8):
            path, _, version = weights_file(tmp_path, seed=seed)
            versions.append((await publish(nc, path)).version)
        for version in versions[:2]:  # e0's two pins (pid 1: init, alive for ever)
            await pin(nc, f"made-up-{version}", 1, version)
        forged = WeightsPin(version=versions[2], holder="made-up-3", pid=1)
        assert await error_code(nc, NAMES.weights_pin("e0"), forged) == "pin-quota"
        # Pinning again what it holds is no new pin; another engine's quota is its own.
        await pin(nc, f"made-up-{V0}", 1, V0)
        e1 = WeightsPin(version=versions[2], holder="e1-main", pid=os.getpid())
        assert (await call(nc, NAMES.weights_pin("e1"), e1, WeightHandles)).version == versions[2]
        # e0 cannot unpin e1's holder: the name is looked up among e0's own.
        theirs = WeightsUnpin(version=versions[2], holder="e1-main")
        assert (await call(nc, NAMES.weights_unpin("e0"), theirs, Ack)).detail == "not pinned"
        listed = {
            v.version: v.holders
            for v in (await call(nc, NAMES.weights_list, WeightsList(), WeightVersions)).versions
        }
        assert listed[versions[2]] == ["e1:e1-main"]
        # Once e0 lets one go, it may pin another.
        mine = WeightsUnpin(version=V0, holder=f"made-up-{V0}")
        assert (await call(nc, NAMES.weights_unpin("e0"), mine, Ack)).detail == "unpinned"
        assert (await call(nc, NAMES.weights_pin("e0"), forged, WeightHandles)).version == versions[2]
