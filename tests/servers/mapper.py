"""A process that maps what the weight and kv servers hand out, as a worker would; for tests.

    python -m tests.servers.mapper NATS_URL ENGINE_ID PRESET NUM_BLOCKS MODE [FILL]

It pins the newest weights as holder `mapper-<pid>` with its own pid and maps them, then:
- MODE `hold`: maps the engine's arena too (as a shadow behind pid $MAPPER_WATCH_PID when set),
  reads every page of both (and fills the arena with FILL when given), prints
  `ready <weights segment> <arena segment> <checksum> <arena handle as JSON>` and waits for stdin
  to close;
- MODE `write-weights`: prints `mapped`, then writes one weight through its tensor, which must
  kill it with SIGSEGV before it prints `wrote`.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys

from belayer_rl.services.kv_server.client import KvClient
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared import bus, protocol, segments
from belayer_rl.shared.protocol import ArenaHandle, WeightHandles

WATCH_PID_ENV = "MAPPER_WATCH_PID"


async def fetch(url: str, engine_id: str, preset: str, num_blocks: int) -> tuple[WeightHandles, ArenaHandle]:
    nc = await bus.connect(url, f"mapper-{os.getpid()}")
    try:
        weights = await WeightClient(nc).pin("e0", f"mapper-{os.getpid()}", os.getpid())
        watch_pid = int(os.environ.get(WATCH_PID_ENV, "0"))
        arena = await KvClient(nc).arena(
            engine_id, preset, num_blocks, block_size=16, pid=os.getpid(), watch_pid=watch_pid
        )
    finally:
        await nc.close()
    return weights, arena


def main() -> None:
    url, engine_id, preset, num_blocks, mode, *fill = sys.argv[1:]
    weights, arena_handle = asyncio.run(fetch(url, engine_id, preset, int(num_blocks)))
    params = segments.map_weights(weights)
    if mode == "write-weights":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash is the point; no core file
        print("mapped", flush=True)
        params["tok_emb"][0, 0] = 1.0
        print("wrote", flush=True)
        return
    arena = segments.map_arena(arena_handle)
    total = sum(float(t.sum()) for t in params.values())  # reads every page of the weights
    if fill:
        arena.fill_(float(fill[0]))
    total += float(arena.sum())
    handle = protocol.encode(arena_handle).decode()
    print(f"ready {weights.segment} {arena_handle.segment} {total} {handle}", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
