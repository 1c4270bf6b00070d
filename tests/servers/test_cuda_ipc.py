"""The GPU path of both servers: weights and arena held on the device and handed out as CUDA IPC
handles, opened by this test process (another process than the servers). Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from belayer_rl.shared import bus, segments
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS, arena_shape
from belayer_rl.shared.protocol import (
    Ack,
    ArenaHandle,
    KvArenaRequest,
    KvFlush,
    KvServerAlive,
    ServerPing,
    WeightHandles,
    WeightServerAlive,
    WeightsHandlesRequest,
)
from belayer_rl.shared.subjects import Subjects
from tests.servers.helpers import call, running

NAMES = Subjects()  # the default cluster's names

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def test_weights_and_arena_travel_as_cuda_ipc_handles(nats_server, nc, shm_prefix, tmp_path) -> None:
    url = nats_server.url
    async with (
        running("weight_server", url, shm_prefix, tmp_path, "--preset", "small", "--device", "cuda"),
        running("kv_server", url, shm_prefix, tmp_path, "--device", "cuda"),
    ):
        assert (await call(nc, NAMES.weights_ping, ServerPing(), WeightServerAlive)).device == "cuda"
        assert (await call(nc, NAMES.kv_ping, ServerPing(), KvServerAlive)).device == "cuda"
        weights = await call(nc, NAMES.weights_handles, WeightsHandlesRequest(), WeightHandles)
        request = KvArenaRequest(
            engine_id="e0", preset="small", num_blocks=64, block_size=16, pid=os.getpid()
        )
        arena_handle = await call(nc, NAMES.kv_arena("e0"), request, ArenaHandle)
        assert weights.cuda is not None and arena_handle.cuda is not None

        params = segments.map_weights(weights)
        reference = init_params(PRESETS["small"], 0)
        assert all(params[name].is_cuda for name in reference)
        assert all(torch.equal(params[name].cpu(), reference[name]) for name in reference)

        arena = segments.map_arena(arena_handle)
        assert arena.is_cuda and tuple(arena.shape) == arena_shape(PRESETS["small"], 64, 16)
        arena.fill_(0.5)
        torch.cuda.synchronize()
        again = segments.map_arena(arena_handle)
        assert torch.all(again == 0.5)

        await bus.declare_jetstream(nc.jetstream(), NAMES)  # the registry: no entry for e0, epoch 0
        await call(nc, NAMES.kv_flush("e0"), KvFlush(engine_id="e0", epoch=0), Ack)
        assert arena.abs().sum().item() == 0.0  # the server zeroed the same device memory
