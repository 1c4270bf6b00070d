"""The worker of kind "vllm": a vLLM engine (vllm_engine.py) behind the same worker, endpoints and
shadow protocol as the built-in engine (service.serve).

A vLLM worker maps nothing from the weight and KV servers: vLLM loads the model folder into memory
of its own, so an engine's main and its idle shadow each hold a copy of the weights and a KV cache
(`--vllm-kv-cache-gib`). Both have loaded the model and run one small request before they report
ready, so a promoted shadow's first request pays no warm-up.

New weights arrive as `model_published` events (`belayer model publish DIR`): main and shadow both
read the folder and hand it to their engine, which replaces its weights in place once no request of
the old version runs. A shadow standing by loads each version at once, so a promotion serves the
newest.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.services.worker.service import serve
from belayer_rl.shared.config import ConfigError, WorkerConfig
from belayer_rl.shared.protocol import ModelPublished, WorkerIdle
from belayer_rl.shared.runtime import Runtime

if TYPE_CHECKING:
    from belayer_rl.services.worker.vllm_engine import VllmEngine

log = logging.getLogger("belayer.worker.vllm")


def check_vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"--kind vllm: vLLM is not installed for {sys.executable}; install the `vllm` extra in "
            "a virtualenv of its own and run the engines from it (README: vLLM engines)"
        )


class Follower:
    """Takes each published version to the engine: straight in while the engine stands by (a
    shadow: nothing else touches it), through `offer` once a worker steps it."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self.standing_by = True
        self.lock = asyncio.Lock()  # a stand-by load finishes before the worker starts stepping

    async def on_published(self, published: ModelPublished) -> None:
        from belayer_rl.services.worker.model_folder import load_folder_weights

        if published.version in self.engine.weights or published.version in self.engine.replaced:
            return
        try:
            tensors = await asyncio.to_thread(load_folder_weights, Path(published.path))
        except (OSError, ValueError) as exc:
            log.error("weight version %s not loaded from %s: %s", published.version, published.path, exc)
            return
        async with self.lock:
            self.engine.offer(published.version, tensors)
            if self.standing_by:  # applied now: nothing runs, and nothing else steps the engine
                await asyncio.to_thread(self.engine.step)
        log.info("weight version %s offered to the engine (%s)", published.version, published.path)

    async def serving(self) -> None:
        async with self.lock:
            self.standing_by = False


async def setup(rt: Runtime, config: WorkerConfig) -> None:
    check_vllm_installed()
    from belayer_rl.services.worker.vllm_engine import VllmEngine, VllmEngineConfig

    assert config.model_path is not None  # WorkerConfig checks it for this kind
    nc = await rt.connect()
    engine_config = VllmEngineConfig(
        model_path=config.model_path,
        max_model_len=config.max_model_len,
        kv_cache_gib=config.vllm_kv_cache_gib,
    )
    engine = await asyncio.to_thread(VllmEngine, engine_config)
    await asyncio.to_thread(engine.warm_up)
    follower = Follower(engine)
    await rt.serve(*WORKER.endpoints(rt.subjects, config, model_published=follower.on_published))
    await serve(rt, config, nc, engine, WorkerIdle(), pins=None, before_serving=follower.serving)
