"""Workers' view of the servers: zero-copy mappings shared between processes (checked in
/proc/PID/smaps), read-only weights, and an engine on mapped state that matches one that owns
its weights and arena."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator

import pytest
import torch

from belayer_rl.services.kv_server.client import KvClient
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.services.worker.engine import Engine, EngineConfig, SeqSpec
from belayer_rl.shared import protocol, segments, tokenizer
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    ArenaHandle,
    WeightHandles,
    WeightsHandlesRequest,
    WeightsList,
    WeightVersions,
)
from belayer_rl.shared.subjects import Subjects
from tests.servers.helpers import REPO, call, running, smaps_of
from tests.servers.mapper import WATCH_PID_ENV

NAMES = Subjects()  # the default cluster's names

NUM_BLOCKS = 128


@contextlib.asynccontextmanager
async def mapper(
    url: str, mode: str, *extra: str, watch_pid: int = 0
) -> AsyncIterator[asyncio.subprocess.Process]:
    """A mapping process; with `watch_pid`, it asks for the arena as a shadow behind that main."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.servers.mapper", url, "e0", "small", str(NUM_BLOCKS), mode, *extra,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, WATCH_PID_ENV: str(watch_pid)},
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_two_processes_share_the_weights_and_arena_pages(nats_server, nc, shm_prefix, tmp_path) -> None:
    url = nats_server.url
    async with (
        running("weight_server", url, shm_prefix, tmp_path, "--preset", "small"),
        running("kv_server", url, shm_prefix, tmp_path),
        mapper(url, "hold", "0.25") as main,
    ):
        first = await asyncio.wait_for(main.stdout.readline(), 120)  # type: ignore[union-attr]
        async with mapper(url, "hold", watch_pid=main.pid) as shadow:  # the arena goes to its shadow only
            second = await asyncio.wait_for(shadow.stdout.readline(), 120)  # type: ignore[union-attr]
            await assert_shared(nc, {main.pid: first, shadow.pid: second})


async def assert_shared(nc, ready: dict[int, bytes]) -> None:  # type: ignore[no-untyped-def]
    """Each process (pid -> its ready line) maps the same weights read-only and the same arena
    read-write, every page shared and none copied."""
    weights = await call(nc, NAMES.weights_handles, WeightsHandlesRequest(), WeightHandles)
    lines = list(ready.values())
    arena = protocol.decode(protocol.decoder_for(ArenaHandle), lines[-1].split(maxsplit=4)[4])
    assert [line.split()[:3] for line in lines] == [
        [b"ready", weights.segment.encode(), arena.segment.encode()]
    ] * 2
    listed = await call(nc, NAMES.weights_list, WeightsList(), WeightVersions)
    assert listed.versions[0].holders == sorted(f"e0:mapper-{pid}" for pid in ready)

    weights_kb = weights.manifest.size // 1024
    arena_kb = arena.manifest.size // 1024
    assert weights_kb > 20_000 and arena_kb > 20_000  # MBs, so "far below" means something
    for pid in ready:
        w = smaps_of(pid, weights.segment)
        a = smaps_of(pid, arena.segment)
        print(pid, "weights", w, "arena", a)
        assert w["perms"] == "r--s"  # read-only, shared
        assert a["perms"] == "rw-s"  # read-write, shared
        for found, size_kb in ((w, weights_kb), (a, arena_kb)):
            assert found["Rss"] >= 0.9 * size_kb  # every page is really mapped...
            assert found["Shared_Clean"] + found["Shared_Dirty"] >= 0.9 * size_kb  # ...shared...
            assert found["Private_Dirty"] <= 0.01 * size_kb  # ...and not a private copy
            assert found["Anonymous"] == 0

    # The shadow sees what the main wrote into the arena; so does a third mapping.
    assert torch.all(segments.map_arena(arena) == 0.25)


async def test_a_write_to_mapped_weights_kills_the_writer_and_changes_nothing(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    url = nats_server.url
    async with (
        running("weight_server", url, shm_prefix, tmp_path, "--preset", "small"),
        running("kv_server", url, shm_prefix, tmp_path),
        mapper(url, "write-weights") as writer,
    ):
        out, _ = await asyncio.wait_for(writer.communicate(), 120)
        weights = await call(nc, NAMES.weights_handles, WeightsHandlesRequest(), WeightHandles)
        mapped = segments.map_weights(weights)

    assert writer.returncode == -signal.SIGSEGV
    assert out.split() == [b"mapped"]
    assert torch.equal(mapped["tok_emb"], init_params(PRESETS["small"], 0)["tok_emb"])


def generate(engine: Engine, prompts: list[str]) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.submit(
            SeqSpec(
                key=f"r{i}",
                prompt_tokens=tokenizer.encode(prompt),
                prefix_tokens=[],
                max_new_tokens=24,
                seed=100 + i,
                temperature=0.8,
            )
        )
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for event in engine.step():
            out[str(event.key)].extend(event.new_tokens)
    return out


async def test_an_engine_on_mapped_weights_and_arena_matches_one_that_owns_them(
    nats_server, nc, shm_prefix, tmp_path
) -> None:
    url = nats_server.url
    config = EngineConfig(preset="tiny", weights_seed=0, num_blocks=64, block_size=16)
    prompts = ["the quick brown fox", "zero-copy weights", "a"]
    async with (
        running("weight_server", url, shm_prefix, tmp_path, "--preset", "tiny"),
        running("kv_server", url, shm_prefix, tmp_path),
    ):
        weights = await WeightClient(nc).pin("e0", "engine-e0", os.getpid())
        arena = await KvClient(nc).arena("e0", "tiny", num_blocks=64, block_size=16, pid=os.getpid())
        mapped = Engine(
            config, segments.map_weights(weights), segments.map_arena(arena), weight_version=weights.version
        )
        on_mapped = generate(mapped, prompts)
        mutated = generate(mapped, ["the quick brown fix", *prompts[1:]])
        written = segments.map_arena(arena)
        assert written.abs().sum().item() > 0  # the K/V really went into the shared arena

    owned = generate(Engine(config), prompts)
    assert mapped.weight_version == "seed:0:tiny"
    assert on_mapped == owned
    assert sum(len(tokens) for tokens in owned.values()) >= 24  # not all ended at once
    assert mutated["r0"] != on_mapped["r0"]  # the output depends on the context it was given


def test_a_handle_that_does_not_describe_its_segment_is_refused(tmp_path, shm_prefix) -> None:
    params = init_params(PRESETS["tiny"], 0)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in params.items()]
    manifest = segments.plan("weights", "seed:0:tiny", "abc", specs)
    segment = segments.Segment(f"{shm_prefix}.w.abc.1", manifest)
    try:
        good = WeightHandles(version="seed:0:tiny", segment=segment.name, manifest=manifest)
        assert set(segments.map_weights(good)) == set(params)
        lies = {
            "other key": WeightHandles(version="seed:1:tiny", segment=segment.name, manifest=manifest),
            "other instance": WeightHandles(
                version="seed:0:tiny",
                segment=segment.name,
                manifest=segments.plan("weights", "seed:0:tiny", "abd", specs),
            ),
            "other shapes": WeightHandles(
                version="seed:0:tiny",
                segment=segment.name,
                manifest=segments.plan("weights", "seed:0:tiny", "abc", specs[1:]),
            ),
            "no such segment": WeightHandles(
                version="seed:0:tiny", segment=f"{shm_prefix}.w.x", manifest=manifest
            ),
            "path outside": WeightHandles(version="seed:0:tiny", segment="../etc/passwd", manifest=manifest),
        }
        for name, handles in lies.items():
            with pytest.raises(segments.MappingError):
                segments.map_weights(handles)
            print("refused:", name)
    finally:
        segment.close()
        segment.unlink()
