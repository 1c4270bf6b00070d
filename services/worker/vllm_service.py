"""The worker of kind "vllm": a vLLM engine (vllm_engine.py) behind the same worker, endpoints and
shadow protocol as the built-in engine (service.serve).

A vLLM worker maps nothing from the weight and KV servers: vLLM loads the model folder into memory
of its own, so an engine's main and its idle shadow each hold a copy of the weights and a KV cache
(`--vllm-kv-cache-gib`). Both have loaded the model and run one small request before they report
ready, so a promoted shadow's first request pays no warm-up.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys

from belayer_rl.services.worker.service import serve
from belayer_rl.shared.config import ConfigError, WorkerConfig
from belayer_rl.shared.protocol import WorkerIdle
from belayer_rl.shared.runtime import Runtime


def check_vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"--engine vllm: vLLM is not installed for {sys.executable}; install the `vllm` extra in "
            "a virtualenv of its own and run belayer from it (README: vLLM engines)"
        )


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
    await serve(rt, config, nc, engine, WorkerIdle(), pins=None)
