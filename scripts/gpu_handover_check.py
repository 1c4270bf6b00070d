"""One-run GPU check of the handover path (for a machine with CUDA; everything else runs on CPU).

    python scripts/gpu_handover_check.py [--preset small]

Starts a local cluster whose weight and KV servers hold weights and arena on the GPU and hand
them out as CUDA IPC handles, then checks in order, printing PASS/FAIL for each:
1. the main and the shadow map the same GPU weights (the weight server reports CUDA handles);
2. a generation through a SIGKILL of the main completes via the shadow (handover path "shadow")
   and equals the same request run without a failure;
3. the KV arena is on the GPU too, so the promoted shadow's device check (a small matmul checked
   exactly, services/worker/shadow.py) ran a CUDA kernel: a failed check takes the cold path.
Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

import torch

from belayer_rl.cli.bench_handover import engine_pids
from belayer_rl.cli.cluster import ClusterConfig, local_cluster
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import (
    Handover,
    KvServerAlive,
    ServerPing,
    TokenChunk,
    WeightHandles,
    WeightsHandlesRequest,
)

PROMPT = "GPU handover check: the shadow maps the weights through CUDA IPC and takes over."


async def check(preset: str) -> list[tuple[str, bool, str]]:
    results: list[tuple[str, bool, str]] = []
    with tempfile.TemporaryDirectory(prefix="belayer-gpu-") as state:
        config = ClusterConfig(state_dir=Path(state), engines=1, preset=preset, sandboxes=False)
        async with local_cluster(config) as supervisor:
            client = await Client.connect(supervisor.target(), "gpu-check")
            async with client:
                await client.wait_for_engines(1, 600)
                handles = await bus.request_struct(
                    client.nc, client.subjects.weights_handles, WeightsHandlesRequest(), WeightHandles, 10
                )
                results.append(("weights are CUDA IPC handles", handles.cuda is not None, handles.version))
                reference = await client.generate_all(PROMPT, max_tokens=96, seed=11, temperature=0.8)
                arena = await bus.request_struct(
                    client.nc, client.subjects.kv_ping, ServerPing(), KvServerAlive, 10
                )
                results.append(("the KV arena is on the GPU", arena.device == "cuda", arena.device))
                # Kill only once a shadow stands by: before that the cold path is the right answer.
                engines_file = Path(state) / "workers" / "engines.json"
                engines = await asyncio.wait_for(engine_pids(engines_file, set()), 120)
                handovers: list[Handover] = []

                async def on_handover(event: Handover) -> None:
                    handovers.append(event)

                await bus.listen(client.nc, client.subjects.event("handover", "*"), Handover, on_handover)
                tokens: list[int] = []
                async for item in client.generate(PROMPT, max_tokens=96, seed=11, temperature=0.8):
                    if not isinstance(item, TokenChunk):
                        break
                    tokens.extend(item.tokens)
                    if len(tokens) >= 24 and not handovers and engines["main"]:
                        os.kill(engines["main"], signal.SIGKILL)
                        engines["main"] = 0
                for _ in range(100):
                    if handovers:
                        break
                    await asyncio.sleep(0.1)
                event = handovers[0] if handovers else None
                results.append(
                    ("handover via the shadow", bool(event and event.path == "shadow"), str(event))
                )
                results.append(
                    ("token-exact after the handover", tokens == reference.tokens, f"{len(tokens)} tokens")
                )
                detail = f"phases {event.phases_ms}" if event else "no handover"
                results.append(
                    ("promoted with no cold reason", bool(event and not event.cold_reason), detail)
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: torch.cuda is not available on this machine")
        sys.exit(2)
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = asyncio.run(check(args.preset))
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}: {name} {detail}")
    sys.exit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
