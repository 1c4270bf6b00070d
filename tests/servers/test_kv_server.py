"""The kv-server as a real process: arenas per engine, flush, release, bad input, SIGTERM and
SIGKILL + restart, and what each leaves in /dev/shm."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from belayer_rl.services.kv_server.client import KvClient
from belayer_rl.shared import segments
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


def arena_request(engine_id: str = "e0", preset: str = "small", num_blocks: int = 32, block_size: int = 16):
    return KvArenaRequest(engine_id=engine_id, preset=preset, num_blocks=num_blocks, block_size=block_size)


async def arena(nc, **fields) -> ArenaHandle:  # type: ignore[no-untyped-def]
    return await call(nc, NAMES.kv_arena, arena_request(**fields), ArenaHandle)


async def test_arena_is_created_once_flushed_for_real_and_released(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    async with running("kv_server", nats_server.url, shm_prefix, tmp_path) as server:
        first = await arena(nc)
        again = await arena(nc)
        assert again == first
        other = await arena(nc, engine_id="e1", preset="tiny", num_blocks=8)
        assert other.segment != first.segment

        mapped = segments.map_arena(first)
        assert tuple(mapped.shape) == arena_shape(PRESETS["small"], 32, 16)
        assert mapped.abs().sum().item() == 0.0  # created zeroed
        second_view = segments.map_arena(first)  # a shadow's mapping of the same arena
        mapped.fill_(1.5)
        assert torch.equal(second_view, mapped)  # shared, not copied

        flushed = await call(nc, NAMES.kv_flush, KvFlush(engine_id="e0"), Ack)
        assert flushed.detail == f"zeroed {mapped.numel() * 4} bytes"
        assert mapped.abs().sum().item() == 0.0
        assert second_view.abs().sum().item() == 0.0

        alive = await call(nc, NAMES.kv_ping, ServerPing(), KvServerAlive)
        assert (alive.pid, alive.engines) == (server.pid, ["e0", "e1"])

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
            "malformed": (NAMES.kv_arena, b"\xff\xfe"),
            "wrong types": (
                NAMES.kv_arena,
                encode_json({"type": "kv_arena", "engine_id": "e0", "preset": 1, "num_blocks": "many"}),
            ),
            "zero blocks": (
                NAMES.kv_arena,
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
            "bad engine id": (NAMES.kv_flush, encode_json({"type": "kv_flush", "engine_id": "../etc"})),
            "wrong tag": (NAMES.kv_flush, encode_json({"type": "weights_list"})),
            "not an object": (NAMES.kv_ping, encode_json([1, 2, 3])),
        }
        for name, (subject, payload) in raw.items():
            reply = await error_of(nc, subject, payload)
            assert reply.code == "bad-request", name

        typed = {
            "shape mismatch": (NAMES.kv_arena, arena_request(num_blocks=64)),
            "preset mismatch": (NAMES.kv_arena, arena_request(preset="tiny")),
            "unknown preset": (NAMES.kv_arena, arena_request(engine_id="e9", preset="huge")),
            "too large": (
                NAMES.kv_arena,
                arena_request(engine_id="e9", preset="base", num_blocks=1 << 16),
            ),
            "flush unknown": (NAMES.kv_flush, KvFlush(engine_id="nope")),
            "release unknown": (NAMES.kv_release, KvRelease(engine_id="nope")),
        }
        codes = {name: await error_code(nc, subject, message) for name, (subject, message) in typed.items()}
        assert codes == {
            "shape mismatch": "shape-mismatch",
            "preset mismatch": "shape-mismatch",
            "unknown preset": "unknown-preset",
            "too large": "too-large",
            "flush unknown": "unknown-engine",
            "release unknown": "unknown-engine",
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
