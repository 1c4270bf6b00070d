"""One-run GPU check of the handover path (for a machine with CUDA; everything else runs on CPU).

    python scripts/gpu_handover_check.py [--preset small]

Starts a local cluster whose weight and KV servers hold weights and arena on the GPU and hand
them out as CUDA IPC handles, then checks in order, printing PASS/FAIL for each:
1. the main and the shadow map the same GPU weights (the weight server reports CUDA handles);
2. a generation through a SIGKILL of the main completes via the shadow (handover path "shadow")
   and equals the same request run without a failure;
3. the KV arena is on the GPU too, so the promoted shadow's device check (a small matmul checked
   exactly, services/worker/shadow.py) ran a CUDA kernel: a failed check takes the cold path.
Then, with no cluster, the engine itself on the GPU (weights and arena in CUDA memory):
4. a request alone and the same request among seven others give the same tokens;
5. a request resumed from half its tokens (the prefix as prefill) continues with the same tokens.
Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from belayer_rl.cli.bench_handover import engine_pids
from belayer_rl.cli.cluster import ClusterConfig, UpSettings, local_cluster
from belayer_rl.services.worker.engine import Engine, EngineConfig, SeqSpec
from belayer_rl.services.worker.kv_cache import allocate_arena
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    Handover,
    KvServerAlive,
    ServerPing,
    TokenChunk,
    WeightHandles,
    WeightsHandlesRequest,
)

PROMPT = "GPU handover check: the shadow maps the weights through CUDA IPC and takes over."


# Long enough (no early EOS) that the kill after 24 tokens lands mid-generation.
GENERATION: dict[str, Any] = {"max_tokens": 400, "min_tokens": 400, "seed": 11, "temperature": 0.8}


async def check(preset: str, state: Path) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    config = ClusterConfig(state_dir=state, engines=1, sandboxes=False, services=UpSettings(preset=preset))
    async with local_cluster(config) as supervisor:
        client = await Client.connect(supervisor.target(), "gpu-check")
        async with client:
            await client.wait_for_engines(1, 600)
            handles = await bus.request_struct(
                client.nc, client.subjects.weights_handles, WeightsHandlesRequest(), WeightHandles, 10
            )
            results.append(("weights are CUDA IPC handles", handles.cuda is not None, handles.version))
            arena = await bus.request_struct(
                client.nc, client.subjects.kv_ping, ServerPing(), KvServerAlive, 10
            )
            results.append(("the KV arena is on the GPU", arena.device == "cuda", arena.device))
            reference = await client.generate_all(PROMPT, **GENERATION)
            # Kill only once a shadow stands by: before that the cold path is the right answer.
            engines = await asyncio.wait_for(engine_pids(state / "workers" / "engines.json", set()), 120)
            handovers: list[Handover] = []

            async def on_handover(event: Handover) -> None:
                handovers.append(event)

            await bus.listen(client.nc, client.subjects.event("handover", "*"), Handover, on_handover)
            tokens: list[int] = []
            resumes = 0
            async for item in client.generate(PROMPT, **GENERATION):
                if not isinstance(item, TokenChunk):
                    resumes = item.resumes
                    break
                tokens.extend(item.tokens)
                if len(tokens) >= 24 and engines["main"]:
                    os.kill(engines["main"], signal.SIGKILL)
                    engines["main"] = 0
            for _ in range(100):
                if handovers:
                    break
                await asyncio.sleep(0.1)
            event = handovers[0] if handovers else None
            results.append(("handover via the shadow", bool(event and event.path == "shadow"), str(event)))
            results.append(("the request was resumed after the kill", resumes >= 1, f"{resumes} resumes"))
            results.append(
                (
                    "token-exact after the handover",
                    tokens == reference.tokens,
                    f"{len(tokens)} tokens, reference {len(reference.tokens)}",
                )
            )
            detail = f"phases {event.phases_ms}" if event else "no handover"
            results.append(("promoted with no cold reason", bool(event and not event.cold_reason), detail))
    return results


def engine_checks(preset: str) -> list[tuple[str, bool, str]]:
    """Batch invariance and exact resumption of the deterministic engine on the GPU."""
    model = PRESETS[preset]
    params = {name: t.cuda() for name, t in init_params(model, 0).items()}

    def engine() -> Engine:
        config = EngineConfig(preset=preset, max_step_tokens=64)
        arena = allocate_arena(model, config.num_blocks, config.block_size).cuda()
        return Engine(config, params, arena)

    def tokens_of(engine: Engine, key: str) -> list[int]:
        got: list[int] = []
        while engine.has_work():
            got += [t for event in engine.step() if event.key == key for t in event.new_tokens]
        return got

    prompt = list(PROMPT.encode())
    mine = SeqSpec("me", prompt, [], 120, seed=11, temperature=0.8, min_new_tokens=120)
    alone = engine()
    alone.submit(mine)
    reference = tokens_of(alone, "me")
    crowd = engine()
    for i in range(7):  # other lengths, so prefill chunks and decodes share steps with "me"
        crowd.submit(SeqSpec(i, prompt[: 10 + 9 * i], [], 60 + i, seed=i, temperature=0.8))
    crowd.step()
    crowd.submit(mine)
    batched = tokens_of(crowd, "me")
    resumed_engine = engine()
    resumed_engine.submit(replace(mine, prefix_tokens=reference[:60]))
    resumed = reference[:60] + tokens_of(resumed_engine, "me")
    return [
        ("engine on the GPU: alone == among seven others", batched == reference, f"{len(reference)} tokens"),
        (
            "engine on the GPU: resumed == uninterrupted",
            resumed == reference,
            f"from token 60 of {len(reference)}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    parser.add_argument(
        "--state-dir", type=Path, help="keep the cluster's state and logs here (default: a temporary folder)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: torch.cuda is not available on this machine")
        sys.exit(2)
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    if args.state_dir is not None:
        args.state_dir.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(check(args.preset, args.state_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="belayer-gpu-") as state:
            results = asyncio.run(check(args.preset, Path(state)))
    results += engine_checks(args.preset)
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}: {name} {detail}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
