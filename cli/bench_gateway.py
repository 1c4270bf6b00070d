"""`belayer bench gateway`: what the HTTP gateway costs against the NATS client straight to the router.

One cluster (two engines, workers started directly, the gateway on a free port). Rounds alternate
between the two paths, each round `--requests` concurrent streamed generations of `--max-tokens`
tokens (EOS held back, so every round generates the same count), the same seeds on both paths:
- tokens/s end to end, per round, and its median, gateway against direct, as a ratio;
- time to first token (p50, p95 over every request of the path's rounds), gateway against direct;
- the gateway process's CPU time per token relayed (its rounds only), next to the router's CPU per
  token in the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import uvloop

from belayer_rl.cli.bench_report import Report, emit, percentiles
from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster
from belayer_rl.shared.access import api_key_path
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import cpu_seconds, free_port
from belayer_rl.shared.protocol import TokenChunk

PROMPT = "The agent reads the tool's answer and writes the next call. "


def add_parser(kinds: argparse._SubParsersAction) -> None:
    gateway = kinds.add_parser("gateway", help="the HTTP gateway against the NATS client, same cluster")
    gateway.add_argument("--preset", default="tiny", help="model preset")
    gateway.add_argument("--requests", type=int, default=8, help="concurrent requests per round")
    gateway.add_argument("--max-tokens", type=int, default=200, help="tokens per request")
    gateway.add_argument("--rounds", type=int, default=5, help="rounds of each path, alternated")
    gateway.add_argument("--json", action="store_true", help="print one JSON object")
    gateway.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(uvloop.run(bench(args)), args.json, print_table)


@dataclass
class Round:
    tokens: int
    seconds: float
    first_token_s: list[float]  # per request
    gateway_cpu_s: float
    router_cpu_s: float


async def bench(args: argparse.Namespace) -> Report:
    async with bench_cluster(args) as (supervisor, client, url, key):
        gateway_pid, router_pid = supervisor.children["gateway"].pid, supervisor.children["router"].pid
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            await via_gateway(http, url, args, 0)  # warm-up of both paths
            await direct(client, args, 0)
            rounds: dict[str, list[Round]] = {"gateway": [], "direct": []}
            for i in range(1, args.rounds + 1):
                for path in ("gateway", "direct") if i % 2 else ("direct", "gateway"):
                    cpu = cpu_seconds(gateway_pid), cpu_seconds(router_pid)
                    t0 = time.perf_counter()
                    if path == "gateway":
                        tokens, firsts = await via_gateway(http, url, args, i)
                    else:
                        tokens, firsts = await direct(client, args, i)
                    took = time.perf_counter() - t0
                    used = cpu_seconds(gateway_pid) - cpu[0], cpu_seconds(router_pid) - cpu[1]
                    rounds[path].append(Round(tokens, took, firsts, *used))
    return report(rounds, args)


@contextlib.asynccontextmanager
async def bench_cluster(args: argparse.Namespace) -> AsyncIterator[tuple[Supervisor, Client, str, str]]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as state:
        config = ClusterConfig(
            state_dir=Path(state),
            engines=2,
            shadows=False,
            sandboxes=False,
            gateway=True,
            services=UpSettings(preset=args.preset, http_port=port, max_concurrent=max(64, args.requests)),
        )
        async with local_cluster(config) as supervisor:
            client = await Client.connect(supervisor.target(), "bench")
            async with client:
                await client.wait_for_engines(2, 300)
                folder = supervisor.creds_dir or Path(state) / "creds"
                url = f"http://127.0.0.1:{port}"
                await gateway_ready(url)
                yield supervisor, client, url, api_key_path(folder, "default").read_text().strip()


async def gateway_ready(url: str) -> None:
    async with asyncio.timeout(60), aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{url}/health") as answer:
                    if answer.status == 200:
                        return
            await asyncio.sleep(0.1)


async def via_gateway(http: aiohttp.ClientSession, url: str, args: argparse.Namespace, round_: int
                      ) -> tuple[int, list[float]]:  # fmt: skip
    async def one(i: int) -> tuple[int, float]:
        body = {"model": "belayer", "prompt": PROMPT, "max_tokens": args.max_tokens, "min_tokens": args.max_tokens,
                "seed": round_ * 1000 + i, "temperature": 0.8, "stream": True, "return_token_ids": True,
                "logprobs": 0}  # fmt: skip
        t0, first, tokens = time.perf_counter(), 0.0, 0
        async with http.post(f"{url}/v1/completions", json=body) as answer:
            answer.raise_for_status()
            async for line in answer.content:
                if not line.startswith(b"data: {"):
                    continue
                event = msgspec.json.decode(line[6:])
                new = len(event["choices"][0].get("token_ids", []))
                if new and not tokens:
                    first = time.perf_counter() - t0
                tokens += new
        return tokens, first

    results = await asyncio.gather(*(one(i) for i in range(args.requests)))
    return sum(t for t, _ in results), [f for _, f in results]


async def direct(client: Client, args: argparse.Namespace, round_: int) -> tuple[int, list[float]]:
    async def one(i: int) -> tuple[int, float]:
        t0, first, tokens = time.perf_counter(), 0.0, 0
        async for item in client.generate(PROMPT, max_tokens=args.max_tokens, min_tokens=args.max_tokens,
                                          seed=round_ * 1000 + i, temperature=0.8):  # fmt: skip
            if isinstance(item, TokenChunk):
                if not tokens:
                    first = time.perf_counter() - t0
                tokens += len(item.tokens)
        return tokens, first

    results = await asyncio.gather(*(one(i) for i in range(args.requests)))
    return sum(t for t, _ in results), [f for _, f in results]


def report(rounds: dict[str, list[Round]], args: argparse.Namespace) -> Report:
    out: Report = {"preset": args.preset, "requests": args.requests, "max_tokens": args.max_tokens,
                   "rounds": args.rounds}  # fmt: skip
    for path, done in rounds.items():
        rates = [r.tokens / r.seconds for r in done]
        first = percentiles([f for r in done for f in r.first_token_s])
        tokens = sum(r.tokens for r in done)
        out[path] = {
            "tokens": tokens,
            "tokens_per_s": round(statistics.median(rates), 1),
            "tokens_per_s_spread": [round(min(rates), 1), round(max(rates), 1)],
            "first_token_p50_ms": first["p50_ms"],
            "first_token_p95_ms": first["p95_ms"],
            "router_cpu_us_per_token": round(1e6 * sum(r.router_cpu_s for r in done) / tokens, 1),
        }
    gateway = rounds["gateway"]
    out["gateway"]["gateway_cpu_us_per_token"] = round(
        1e6 * sum(r.gateway_cpu_s for r in gateway) / out["gateway"]["tokens"], 1
    )
    out["tokens_per_s_ratio"] = round(out["gateway"]["tokens_per_s"] / out["direct"]["tokens_per_s"], 3)
    out["first_token_p50_ratio"] = round(
        out["gateway"]["first_token_p50_ms"] / max(out["direct"]["first_token_p50_ms"], 1e-3), 2
    )
    return out


def print_table(r: Report) -> None:
    print(
        f"preset {r['preset']}: {r['rounds']} rounds per path of {r['requests']} streams x {r['max_tokens']} tokens"
    )
    for path in ("gateway", "direct"):
        p = r[path]
        print(f"  {path:<8} {p['tokens_per_s']:>8} tokens/s (spread {p['tokens_per_s_spread']}); first token"
              f" p50 {p['first_token_p50_ms']} ms, p95 {p['first_token_p95_ms']} ms;"
              f" router CPU {p['router_cpu_us_per_token']} us/token")  # fmt: skip
    print(
        f"  gateway / direct: tokens/s {r['tokens_per_s_ratio']}, first token p50 {r['first_token_p50_ratio']}"
    )
    print(f"  the gateway's CPU: {r['gateway']['gateway_cpu_us_per_token']} us per token relayed")
