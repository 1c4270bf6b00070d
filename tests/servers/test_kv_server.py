"""The kv-server as a real process: arenas per engine, flush, release, bad input, SIGTERM and
SIGKILL + restart, and what each leaves in /dev/shm."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import pytest
import torch

from belayer_rl.services.kv_server.client import KvClient
from belayer_rl.shared import bus, registry, segments
from belayer_rl.shared.presets import PRESETS, arena_shape
from belayer_rl.shared.protocol import (
    Ack,
    ArenaHandle,
    KvArenaRequest,
    KvFlush,
    KvRelease,
    KvServerAlive,
    ServerPing,
)
from belayer_rl.shared.subjects import Subjects
from tests.servers.helpers import call, encode_json, error_code, error_of, running, shm_names, start

NAMES = Subjects()  # the default cluster's names


def arena_request(
    engine_id: str = "e0", preset: str = "small", num_blocks: int = 32, block_size: int = 16,
    pid: int = 0, watch_pid: int = 0,
) -> KvArenaRequest:  # fmt: skip
    """For this test process (pid 0), which maps the arenas it asks for, or for `pid`."""
    return KvArenaRequest(
        engine_id=engine_id, preset=preset, num_blocks=num_blocks, block_size=block_size,
        pid=pid or os.getpid(), watch_pid=watch_pid,
    )  # fmt: skip


async def arena(nc, **fields) -> ArenaHandle:  # type: ignore[no-untyped-def]
    request = arena_request(**fields)
    return await call(nc, NAMES.kv_arena(request.engine_id), request, ArenaHandle)


async def test_arena_is_created_once_flushed_for_real_and_released(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    async with running("kv_server", nats_server.url, shm_prefix, tmp_path) as server:
        first = await arena(nc)
        again = await arena(nc)
        assert again == first
        holder = sleeper()  # e1's worker
        other = await arena(nc, engine_id="e1", preset="tiny", num_blocks=8, pid=holder.pid)
        assert other.segment != first.segment

        mapped = segments.map_arena(first)
        assert tuple(mapped.shape) == arena_shape(PRESETS["small"], 32, 16)
        assert mapped.abs().sum().item() == 0.0  # created zeroed
        second_view = segments.map_arena(first)  # a shadow's mapping of the same arena
        mapped.fill_(1.5)
        assert torch.equal(second_view, mapped)  # shared, not copied

        await bus.declare_jetstream(nc.jetstream(), NAMES)  # the registry: e0 has no entry, epoch 0
        flushed = await call(nc, NAMES.kv_flush("e0"), KvFlush(engine_id="e0", epoch=0), Ack)
        assert flushed.detail == f"zeroed {mapped.numel() * 4} bytes"
        assert mapped.abs().sum().item() == 0.0
        assert second_view.abs().sum().item() == 0.0

        alive = await call(nc, NAMES.kv_ping, ServerPing(), KvServerAlive)
        assert (alive.pid, alive.engines) == (server.pid, ["e0", "e1"])

        assert await error_code(nc, NAMES.kv_release, KvRelease(engine_id="e1")) == "holder-alive"
        dead(holder)
        released = await call(nc, NAMES.kv_release, KvRelease(engine_id="e1"), Ack)
        assert released.detail == "released"
        assert other.segment not in shm_names(shm_prefix)
        with pytest.raises(segments.MappingError):
            segments.map_arena(other)
        renewed = await arena(nc, engine_id="e1", preset="tiny", num_blocks=8)
        assert renewed.segment != other.segment  # same engine and shape, yet a new arena
        with pytest.raises(segments.MappingError):
            segments.map_arena(other)
        client = KvClient(nc)
        assert "was released" in (await client.why_not_owned(other) or "")
        assert await client.why_not_owned(renewed) is None
        assert await client.why_not_owned(first) is None


async def test_bad_input_gets_error_replies_and_the_server_keeps_serving(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    async with running("kv_server", nats_server.url, shm_prefix, tmp_path, "--max-arena-mb", "64") as server:
        await arena(nc)
        raw = {
            "malformed": (NAMES.kv_arena("e0"), b"\xff\xfe"),
            "wrong types": (
                NAMES.kv_arena("e0"),
                encode_json({"type": "kv_arena", "engine_id": "e0", "preset": 1, "num_blocks": "many"}),
            ),
            "zero blocks": (
                NAMES.kv_arena("e0"),
                encode_json(
                    {
                        "type": "kv_arena",
                        "engine_id": "e0",
                        "preset": "tiny",
                        "num_blocks": 0,
                        "block_size": 16,
                    }
                ),
            ),
            "bad engine id": (
                NAMES.kv_flush("e0"),
                encode_json({"type": "kv_flush", "engine_id": "../etc", "epoch": 0}),
            ),
            "no epoch": (NAMES.kv_flush("e0"), encode_json({"type": "kv_flush", "engine_id": "e0"})),
            "no pid": (
                NAMES.kv_arena("e0"),
                encode_json(
                    {
                        "type": "kv_arena",
                        "engine_id": "e0",
                        "preset": "small",
                        "num_blocks": 32,
                        "block_size": 16,
                    }
                ),
            ),
            "wrong tag": (NAMES.kv_flush("e0"), encode_json({"type": "weights_list"})),
            "not an object": (NAMES.kv_ping, encode_json([1, 2, 3])),
        }
        for name, (subject, payload) in raw.items():
            reply = await error_of(nc, subject, payload)
            assert reply.code == "bad-request", name

        typed = {
            "shape mismatch": (NAMES.kv_arena("e0"), arena_request(num_blocks=64)),
            "preset mismatch": (NAMES.kv_arena("e0"), arena_request(preset="tiny")),
            "unknown preset": (NAMES.kv_arena("e9"), arena_request(engine_id="e9", preset="huge")),
            "too large": (
                NAMES.kv_arena("e9"),
                arena_request(engine_id="e9", preset="base", num_blocks=1 << 16),
            ),
            "flush unknown": (NAMES.kv_flush("nope"), KvFlush(engine_id="nope", epoch=0)),
            "dead asker": (NAMES.kv_arena("e0"), arena_request(pid=(1 << 22) + 1)),
            "release unknown": (NAMES.kv_release, KvRelease(engine_id="nope")),
            # The engine is the subject's: e1's subject (only e1's credential publishes there)
            # cannot get e0's arena (a CUDA IPC handle on a GPU) by naming e0 in the payload.
            "another engine's": (NAMES.kv_arena("e1"), arena_request(engine_id="e0")),
            "another engine's flush": (NAMES.kv_flush("e1"), KvFlush(engine_id="e0", epoch=0)),
        }
        codes = {name: await error_code(nc, subject, message) for name, (subject, message) in typed.items()}
        assert codes == {
            "shape mismatch": "shape-mismatch",
            "preset mismatch": "shape-mismatch",
            "unknown preset": "unknown-preset",
            "too large": "too-large",
            "flush unknown": "unknown-engine",
            "dead asker": "dead-holder",
            "release unknown": "unknown-engine",
            "another engine's": "bad-request",
            "another engine's flush": "bad-request",
        }
        alive = await call(nc, NAMES.kv_ping, ServerPing(), KvServerAlive)
        assert (alive.pid, alive.engines) == (server.pid, ["e0"])
        assert server.process.returncode is None


async def test_sigterm_leaves_nothing_in_dev_shm(nats_server, nc, shm_prefix, tmp_path) -> None:
    server = await start("kv_server", nats_server.url, shm_prefix, tmp_path)
    for engine in ("e0", "e1", "e2"):
        await arena(nc, engine_id=engine)
    assert len(shm_names(shm_prefix)) == 4  # three arenas and the lock

    server.process.send_signal(signal.SIGTERM)
    code = await asyncio.wait_for(server.process.wait(), 30)

    assert code == 0, server.output()
    assert shm_names(shm_prefix) == []


async def test_sigkill_then_restart_removes_the_dead_instances_segments(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    first = await start("kv_server", nats_server.url, shm_prefix, tmp_path)
    old = await arena(nc)
    mapped = segments.map_arena(old)
    first.process.kill()
    await first.process.wait()
    left = shm_names(shm_prefix)
    assert len(left) == 2

    async with running("kv_server", nats_server.url, shm_prefix, tmp_path) as second:
        assert shm_names(shm_prefix) == [f"{shm_prefix}.kv.lock"]
        alive = await call(nc, NAMES.kv_ping, ServerPing(), KvServerAlive)
        assert (alive.pid, alive.engines) == (second.pid, [])
        assert alive.instance != old.manifest.instance
        new = await arena(nc)
        assert new.segment != old.segment
        with pytest.raises(segments.MappingError):
            segments.map_arena(old)
        mapped.fill_(2.0)  # the orphaned mapping is still memory, but no longer the engine's arena
        assert segments.map_arena(new).abs().sum().item() == 0.0
        assert "restarted" in (await KvClient(nc).why_not_owned(old) or "")
    assert second.process.returncode == 0
    assert "not answering" in (await KvClient(nc, timeout_s=0.5).why_not_owned(new) or "")
    assert shm_names(shm_prefix) == []


def sleeper() -> subprocess.Popen[bytes]:
    """A process to stand for a worker: the KV server tracks holders by their pid."""
    return subprocess.Popen(["sleep", "600"])


def dead(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


async def test_a_live_holder_keeps_the_arena_from_everyone_else(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    """One writer, whatever dies: a main's arena goes to its shadow and to nobody else while the
    main lives, stopped or not; a flush must name the current epoch and find its worker dead; a
    new main after dead holders gets the arena zeroed. Mutation check: without the holder check
    the second main is handed the arena that the stopped one still maps."""
    main, shadow, intruder = sleeper(), sleeper(), sleeper()
    try:
        async with running("kv_server", nats_server.url, shm_prefix, tmp_path):
            kv = await bus.declare_jetstream(nc.jetstream(), NAMES)
            handle = await call(nc, NAMES.kv_arena("e0"), arena_request(pid=main.pid), ArenaHandle)
            installed = await registry.install_worker(kv, "e0", main.pid)
            mapped = segments.map_arena(handle)
            mapped.fill_(1.5)  # what the main computed
            behind = await call(
                nc, NAMES.kv_arena("e0"), arena_request(pid=shadow.pid, watch_pid=main.pid), ArenaHandle
            )
            assert behind == handle
            main.send_signal(signal.SIGSTOP)  # stopped is alive
            refused = {
                "second main": arena_request(pid=intruder.pid),
                "shadow of another": arena_request(pid=intruder.pid, watch_pid=shadow.pid),
            }
            codes = {name: await error_code(nc, NAMES.kv_arena("e0"), ask) for name, ask in refused.items()}
            assert codes == {"second main": "holder-alive", "shadow of another": "holder-alive"}
            late = KvFlush(engine_id="e0", epoch=installed.epoch - 1)
            assert await error_code(nc, NAMES.kv_flush("e0"), late) == "stale-epoch"
            live = KvFlush(engine_id="e0", epoch=installed.epoch)
            assert await error_code(nc, NAMES.kv_flush("e0"), live) == "holder-alive"
            assert mapped.min().item() == 1.5  # nothing zeroed the serving main's arena

            dead(main)  # a confirmed death: the handover's flush goes through, then the shadow serves
            assert (await call(nc, NAMES.kv_flush("e0"), live, Ack)).detail.startswith("zeroed")
            assert mapped.abs().sum().item() == 0.0
            mapped.fill_(2.5)  # what the promoted shadow computed
            dead(shadow)
            again = await call(nc, NAMES.kv_arena("e0"), arena_request(pid=intruder.pid), ArenaHandle)
            assert again == handle and mapped.abs().sum().item() == 0.0  # zeroed before it was handed on
    finally:
        for process in (main, shadow, intruder):
            dead(process)
