"""The worker of kind "vllm": a vLLM engine (vllm_engine.py) behind the same worker, endpoints and
shadow protocol as the built-in engine (service.serve).

A vLLM worker maps nothing from the weight and KV servers: vLLM loads the model folder into memory
of its own, so an engine's main and its idle shadow each hold a copy of the weights and a KV cache
(`--vllm-kv-cache-gib`). Both have loaded the model and run one small request before they report
ready, so a promoted shadow's first request pays no warm-up.

New weights arrive as `model_published` events (`belayer model publish DIR`): main and shadow both
check the folder against the served model's tensors, read it and stage it in their engine, which
replaces its weights in place once no request of the old version runs. A shadow standing by stages
each version too: promoted, it finishes the requests of the version it took over, then loads the
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
    from belayer_rl.services.worker.worker import Worker

log = logging.getLogger("belayer.worker.vllm")


def check_vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"--kind vllm: vLLM is not installed for {sys.executable}; install the `vllm` extra in "
            "a virtualenv of its own and run the engines from it (README: vLLM engines)"
        )


class Follower:
    """Takes each published version to the engine. While the engine stands by (a shadow: nothing
    else touches it) the version is staged at once; the loaded one stays, so that a request of it
    resumed here after a promotion still runs on its own weights. Once a worker steps the engine,
    through `offer`, and the worker is woken to stage it."""

    def __init__(self, engine: VllmEngine, serving_folder: Path) -> None:
        self.engine = engine
        self.serving_folder = serving_folder  # a folder of the loaded model: the shapes to match
        self.worker: Worker | None = None
        self.lock = asyncio.Lock()  # a stand-by stage finishes before the worker starts stepping

    async def on_published(self, published: ModelPublished) -> None:
        from belayer_rl.shared.model_folder import (
            ModelFolderError,
            check_same_model,
            load_folder_weights,
        )

        if published.version in self.engine.replaced:
            log.warning("weight version %s was replaced here already: not loaded again", published.version)
            return
        if published.version in self.engine.weights:
            return
        folder = Path(published.path)
        try:
            await asyncio.to_thread(check_same_model, self.serving_folder, folder)
            tensors = await asyncio.to_thread(load_folder_weights, folder)
        except (OSError, ModelFolderError) as exc:
            log.error("weight version %s not loaded from %s: %s", published.version, folder, exc)
            return
        async with self.lock:
            if self.worker is None:
                self.engine.stage(published.version, tensors)
            else:
                self.engine.offer(published.version, tensors)
                await self.worker.wake_up()
        log.info("weight version %s staged (%s)", published.version, folder)

    async def serving(self, worker: Worker) -> None:
        async with self.lock:
            self.worker = worker


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
    follower = Follower(engine, config.model_path)
    await rt.serve(*WORKER.endpoints(rt.subjects, config, model_published=follower.on_published))
    await serve(rt, config, nc, engine, WorkerIdle(), pins=None, on_worker=follower.serving)
