"""`belayer demo generation`: a local cluster streams a generation through a worker killed mid-stream.

It starts nats-server, the router and two workers, streams a generation, SIGKILLs the worker that
serves it halfway through, and shows the stream carrying on from the next position on the other
engine. Then it runs the same request (same seed) without a failure and compares the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

import uvloop

from belayer_rl.cli.cluster import ClusterConfig, UpSettings, local_cluster
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import TokenChunk

PROMPT = "The belayer holds the rope while the climber"


def add_parser(kinds: argparse._SubParsersAction) -> None:
    demo = kinds.add_parser("generation", help="stream a generation through a worker failure")
    demo.add_argument("--model", default="tiny", help="model preset")
    demo.add_argument("--max-tokens", type=int, default=200)
    demo.add_argument(
        "--kill-at", type=int, default=60, help="kill the serving worker after this many tokens"
    )
    demo.add_argument("--seed", type=int, default=7)
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="belayer-demo-") as state:
        config = ClusterConfig(
            state_dir=Path(state), engines=2, sandboxes=False,
            services=UpSettings(preset=args.model, chunk_tokens=32),
        )  # fmt: skip
        return uvloop.run(demo(config, args))


def printable(tokens: list[int]) -> str:
    """Random weights emit arbitrary bytes: show the printable ones, a dot for the rest."""
    return "".join(chr(t) if 32 <= t < 127 else "·" for t in tokens)


def say(text: str) -> None:
    print(text, flush=True)


async def demo(config: ClusterConfig, args: argparse.Namespace) -> int:
    say(f"starting nats-server, the router and 2 workers ({args.model} model) ...")
    async with local_cluster(config) as supervisor:
        async with await Client.connect(supervisor.target(), "demo") as client:
            await client.wait_for_engines(2, 120)
            say("cluster up. streaming a generation; its worker is killed after "
                f"{args.kill_at} tokens:\n")  # fmt: skip
            tokens: list[int] = []
            killed_pid = 0
            async for item in client.generate(
                PROMPT, max_tokens=args.max_tokens, seed=args.seed, temperature=0.8
            ):
                if not isinstance(item, TokenChunk):
                    end = item
                    break
                tokens.extend(item.tokens)
                sys.stdout.write(printable(item.tokens))
                sys.stdout.flush()
                if not killed_pid and len(tokens) >= args.kill_at:
                    killed_pid = await kill_serving_worker(client, item.request_id)
                    say(f"\n\n>>> SIGKILL worker pid {killed_pid} at token {len(tokens)}; "
                        "the stream continues:\n")  # fmt: skip
            say(f"\n\nend: {end.finish_reason}, {end.num_tokens} tokens, resumes={end.resumes}")
            reference = await client.generate_all(
                PROMPT, max_tokens=args.max_tokens, seed=args.seed, temperature=0.8
            )
            exact = reference.tokens == tokens
            say(f"the same request without a failure gives {'the same' if exact else 'DIFFERENT'} "
                f"{len(reference.tokens)} tokens: token-exact={exact}")  # fmt: skip
            return 0 if exact and end.resumes >= 1 else 1


async def kill_serving_worker(client: Client, request_id: str) -> int:
    status = await client.status()
    engine_id = next(r.engine_id for r in status.requests if r.request_id == request_id)
    pid = next(e.pid for e in status.engines if e.engine_id == engine_id)
    os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(0)
    return pid
