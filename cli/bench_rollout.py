"""`belayer bench rollout`: what the router and its token log cost, and what a failure costs.

Every figure is printed next to its baseline from the same run:
- failure-free throughput of N concurrent requests through the router vs the same requests sent
  straight to the worker (Dispatch to its subject, chunks to our inbox), alternated round by round;
- recovery after a worker SIGKILL: time from the kill to each interrupted request's next token and
  tokens regenerated, vs restarting the request from its prompt (time to regain the same position);
- recovery after a router SIGKILL, `--router-kills` times (10): the active router, the lease holder,
  is killed mid-decode; the supervisor reaps it and reports its exit, so the warm standby takes its
  lease at once (without that report, after the TTL) and adopts what the workers hold; p50/p95 of
  the time from the kill to each interrupted request's next new token and of the tokens generated
  again, vs restarting from the prompt;
- token-log cost: JetStream append time per token;
- the metrics' own cost: the router's CPU time per token with its metrics on (the default) and off
  (`--metrics-port -1`): pairs of rounds of one fixed workload on the same cluster, the router
  restarted with the other setting for each round; end-to-end tokens/s of the same rounds; and
  the counter updates alone, timed in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import timeit
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import uvloop
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster
from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus, protocol, registry, tokenizer
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import ConfigError, RouterConfig
from belayer_rl.shared.metrics import Metrics, RouterMetrics
from belayer_rl.shared.processes import cpu_seconds
from belayer_rl.shared.protocol import (
    Dispatch,
    LogChunk,
    SamplingParams,
    ServiceStats,
    StatsRequest,
    TokenChunk,
)

PROMPT = "An agent asks for a tool call and then waits for the sandbox to answer. "


def add_parser(kinds: argparse._SubParsersAction) -> None:
    rollout = kinds.add_parser("rollout", help="router overhead, recovery vs restart, token-log cost")
    rollout.add_argument("--presets", default="tiny,base", help="comma-separated model presets")
    rollout.add_argument("--requests", type=int, default=8, help="concurrent requests")
    rollout.add_argument("--max-tokens", type=int, default=96, help="tokens per request")
    rollout.add_argument("--rounds", type=int, default=5, help="rounds of each path, alternated")
    rollout.add_argument(
        "--chunk-tokens",
        type=int,
        default=RouterConfig.chunk_tokens,
        help="k of the token log (the router's default)",
    )
    rollout.add_argument(
        "--metrics-rounds", type=int, default=8, help="pairs of rounds with metrics on and off (0: skip)"
    )
    rollout.add_argument(
        "--metrics-batches", type=int, default=8, help="batches of --requests per metrics-cost round"
    )
    rollout.add_argument("--router-kills", type=int, default=10, help="router SIGKILLs per preset")
    rollout.add_argument(
        "--lease-ttl", type=float, default=RouterConfig.lease_ttl_s, help="the router lease's TTL (s)"
    )
    rollout.add_argument("--engine", choices=("builtin", "vllm"), default="builtin", help="the engine kind")
    rollout.add_argument(
        "--model-path", type=Path, help="--engine vllm: the model folder (it replaces --presets)"
    )
    rollout.add_argument("--engine-python", type=Path, help="--engine vllm: the Python of vLLM's virtualenv")
    rollout.add_argument("--json", action="store_true", help="print one JSON object")
    rollout.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(uvloop.run(bench(args)), args.json, print_table)


async def bench(args: argparse.Namespace) -> Report:
    report: Report = {"host_cpus": os.cpu_count(), "engine": args.engine, "presets": {}}
    if args.engine == "vllm" and args.model_path is None:
        raise ConfigError("--engine vllm needs --model-path")
    for n, preset in enumerate(["vllm"] if args.engine == "vllm" else args.presets.split(",")):
        # A warm standby router, as the production shape has it: a router kill is a failover.
        async with bench_cluster(args, preset, standby_routers=1) as (supervisor, client):
            report["presets"][preset] = {
                "overhead": await overhead(client, args),
                "worker_kill": summarise([await failover(client, supervisor, args, kill_router=False)]),
                "router_kill": {
                    "lease_ttl_s": args.lease_ttl,
                    **summarise(
                        [
                            await failover(client, supervisor, args, kill_router=True)
                            for _ in range(args.router_kills)
                        ]
                    ),
                },
                "token_log": await log_cost(client, args.chunk_tokens),
            }
        # The router's work per token does not depend on the model: measured once, on a cluster
        # of one router, which the rounds restart with metrics on and off.
        if n == 0 and args.metrics_rounds > 0:
            async with bench_cluster(args, preset, standby_routers=0) as (supervisor, client):
                report["metrics_cost"] = {"preset": preset, **await metrics_cost(client, supervisor, args)}
    return report


ROUTER_SILENCE_S = 60.0  # how long a round waits for an answering router before it gives up


@contextlib.asynccontextmanager
async def bench_cluster(
    args: argparse.Namespace, preset: str, *, standby_routers: int
) -> AsyncIterator[tuple[Supervisor, Client]]:
    """Two engines with workers started directly (no shadows): the router's own recovery."""
    engine: dict[str, object] = {}
    if args.engine == "vllm":
        engine = {"kind": "vllm", "model_path": args.model_path, "engine_python": args.engine_python}
        preset = "tiny"  # the built-in engine's preset: unused by vLLM workers
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as state:
        config = ClusterConfig(
            state_dir=Path(state),
            engines=2,
            shadows=False,
            sandboxes=False,
            standby_routers=standby_routers,
            services=UpSettings(
                preset=preset, chunk_tokens=args.chunk_tokens, lease_ttl_s=args.lease_ttl, **engine
            ),
        )
        async with local_cluster(config) as supervisor:
            client = await Client.connect(supervisor.target(), "bench")
            async with client:
                await client.wait_for_engines(2, 300)
                yield supervisor, client


# ---------------------------------------------------------------- failure-free overhead


async def overhead(client: Client, args: argparse.Namespace) -> Report:
    status = await client.wait_for_engines(2, 60)
    engine = status.engines[0]
    kv = await client.nc.jetstream().key_value(client.subjects.engine_registry_bucket)
    entry, _ = await registry.read(kv, engine.engine_id)
    assert entry is not None
    routed, direct = [], []
    await through_router(client, args, args.requests)  # warm-up of both paths
    await straight_to_worker(client, entry.engine_id, entry.epoch, args, args.requests)
    for _ in range(args.rounds):
        routed.append(await through_router(client, args, args.requests))
        direct.append(await straight_to_worker(client, entry.engine_id, entry.epoch, args, args.requests))
    r, d = statistics.median(routed), statistics.median(direct)
    return {
        "router_tokens_per_s": round(r, 1),
        "router_spread": [round(min(routed), 1), round(max(routed), 1)],
        "direct_tokens_per_s": round(d, 1),
        "direct_spread": [round(min(direct), 1), round(max(direct), 1)],
        "overhead_pct": round(100 * (d - r) / d, 2),
        "rounds": args.rounds,
    }


async def through_router(client: Client, args: argparse.Namespace, n: int) -> float:
    """Tokens/s of n concurrent requests through the router."""
    t0 = time.perf_counter()
    tokens = await routed_batch(client, args, n)
    return tokens / (time.perf_counter() - t0)


async def routed_batch(client: Client, args: argparse.Namespace, n: int) -> int:
    """The tokens of n concurrent requests through the router (seeds 0..n-1, so every batch is the same)."""
    results = await asyncio.gather(
        *(client.generate_all(PROMPT, max_tokens=args.max_tokens, seed=i, temperature=0.8) for i in range(n))
    )
    return sum(len(r.tokens) for r in results)


async def straight_to_worker(
    client: Client, engine_id: str, epoch: int, args: argparse.Namespace, n: int
) -> float:
    """Tokens/s of the same requests dispatched straight to the workers: no router, no log.
    The router spreads requests over both engines, so this path splits them round robin."""
    status = await client.status()
    engines = [(e.engine_id, e.epoch) for e in status.engines if e.alive] or [(engine_id, epoch)]
    incarnation = status.incarnation
    mine = {uuid.uuid4().hex for _ in range(n)}
    done = asyncio.Event()
    tokens = 0
    finished = 0
    decoder = protocol.decoder_for(protocol.WorkerStream)

    async def on_message(msg: Msg) -> None:
        nonlocal tokens, finished
        frame = protocol.decode(decoder, msg.data)
        for seq in frame.seqs:
            if seq.request_id not in mine:
                continue
            tokens += len(seq.tokens)
            if seq.finish_reason is not None:
                finished += 1
        if finished == n:
            done.set()

    # Workers publish on their engine's stream whatever a dispatch names (the router sees these
    # chunks too, and drops them: requests it does not know).
    sub = await client.nc.subscribe(client.subjects.worker_stream_all, cb=on_message)
    t0 = time.perf_counter()
    for i, request_id in enumerate(sorted(mine)):
        target, target_epoch = engines[i % len(engines)]
        dispatch = Dispatch(
            request_id=request_id,
            attempt=1,
            epoch=target_epoch,
            engine_id=target,
            prompt_tokens=tokenizer.encode(PROMPT),
            max_tokens=args.max_tokens,
            sampling=SamplingParams(seed=i, temperature=0.8),
            reply_to=client.subjects.worker_stream(target),
            incarnation=incarnation,  # the router's: workers refuse an older one
        )
        await bus.request(client.nc, client.subjects.worker_dispatch(target), dispatch, 5.0)
    await done.wait()
    elapsed = time.perf_counter() - t0
    await sub.unsubscribe()
    return tokens / elapsed


# ---------------------------------------------------------------- recovery


@dataclass
class Stream:
    request_id: str
    positions: list[tuple[float, int]]  # (arrival time, tokens so far)
    tokens: list[int]


async def follow(
    client: Client,
    seed: int,
    max_tokens: int,
    streams: dict[int, Stream],
    progress: asyncio.Event | None = None,
) -> None:
    # EOS held back: random weights end some requests early, before the failover point.
    stream_items = client.generate(
        PROMPT, max_tokens=max_tokens, min_tokens=max_tokens, seed=seed, temperature=0.8
    )
    async for item in stream_items:
        if isinstance(item, TokenChunk):
            stream = streams.setdefault(seed, Stream(item.request_id, [], []))
            stream.tokens.extend(item.tokens)
            stream.positions.append((time.perf_counter(), len(stream.tokens)))
            if progress is not None:
                progress.set()


STANDBY_WARM_S = 5.0  # a restarted router has connected and stands by after this long


@dataclass
class Failover:
    interrupted: int  # requests in flight on what was killed
    to_next_token_s: list[float]  # per interrupted request: kill -> the first token it had not had
    regenerated: list[int]  # per resumed request: tokens the client had that were computed again
    restart_s: float  # baseline: the same requests restarted from the prompt, to the same position
    restart_tokens: int  # what that baseline computes again


async def failover(
    client: Client, supervisor: Supervisor, args: argparse.Namespace, *, kill_router: bool
) -> Failover:
    """SIGKILL the worker serving the first request (or the active router) mid-decode; time the
    recovery."""
    await client.wait_for_engines(2, 120)
    # Every router up for a while: a router killed by the last round is back as the standby.
    while any(  # noqa: ASYNC110 - the supervisor restarts children on its own
        c.state != "running" or time.monotonic() - c.started_at < STANDBY_WARM_S
        for name, c in supervisor.children.items()
        if name.startswith("router")
    ):
        await asyncio.sleep(0.2)
    max_tokens = args.max_tokens * 4
    streams: dict[int, Stream] = {}
    seeds = range(1000, 1000 + args.requests)
    progress = asyncio.Event()
    running = [asyncio.create_task(follow(client, s, max_tokens, streams, progress)) for s in seeds]
    # Fail over once requests are well into their decode (random weights may end some early).
    patience = time.monotonic() + ROUTER_SILENCE_S
    while True:
        progress.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(progress.wait(), 1.0)
        if all(task.done() for task in running):
            raise RuntimeError("every request ended before the failover point; raise --max-tokens")
        try:
            status = await client.status()
        except bus.ServiceError as exc:  # a stalled host can cost a router its lease: ask the next one
            if exc.code not in ("timeout", "not-leader", "no-responders") or time.monotonic() > patience:
                raise
            print(f"bench: the router did not answer ({exc}); asking again", file=sys.stderr)
            continue
        busy = [r for r in status.requests if r.engine_id and r.num_tokens >= args.max_tokens]
        if busy:
            break
    if kill_router:
        holder = await lease_holder(client.nc.jetstream(), client.subjects)
        assert holder is not None and holder.incarnation == status.incarnation, (holder, status.incarnation)
        victim_pid = holder.pid
        in_flight = {r.request_id for r in status.requests}
    else:
        engine_id = busy[0].engine_id
        victim_pid = next(e.pid for e in status.engines if e.engine_id == engine_id)
        in_flight = {r.request_id for r in status.requests if r.engine_id == engine_id}
    interrupted = {s for s, stream in streams.items() if stream.request_id in in_flight}
    had = {s: len(streams[s].tokens) for s in interrupted}
    resumed_from: dict[str, int] = {}  # request id -> position its first resume started from
    seed_of = {streams[s].request_id: s for s in interrupted}

    async def on_resumed(event: protocol.RequestResumed) -> None:
        if event.request_id in resumed_from:
            return
        resumed_from[event.request_id] = event.from_position
        # What the client holds when its request is carried on is what it had: after a router
        # kill the dead router's last chunks may still have been on their way, and no new router
        # relays anything before it announced its requests.
        if (s := seed_of.get(event.request_id)) is not None:
            had[s] = len(streams[s].tokens)

    subs = [
        await bus.listen(
            client.nc, client.subjects.event("request_resumed", "*"), protocol.RequestResumed, on_resumed
        )
    ]
    killed_at = time.perf_counter()
    os.kill(victim_pid, signal.SIGKILL)
    await asyncio.gather(*running)
    for sub in subs:
        await sub.unsubscribe()
    regenerated = [
        max(0, had[s] - resumed_from[streams[s].request_id])
        for s in interrupted
        if streams[s].request_id in resumed_from
    ]
    # Time from the kill to the first token the client had not had (a request that ended with
    # what it had by then has no next token).
    to_next_token = []
    for s in interrupted:
        after = [t for t, n in streams[s].positions if n > had[s] and t > killed_at]
        if after:
            to_next_token.append(after[0] - killed_at)
    # Baseline: the same interrupted requests restarted from the prompt; time to regain position.
    restart_streams: dict[int, Stream] = {}
    t0 = time.perf_counter()
    await asyncio.gather(*(follow(client, s, max(had[s], 1), restart_streams) for s in interrupted))
    return Failover(len(interrupted), to_next_token, regenerated, time.perf_counter() - t0, sum(had.values()))


def summarise(failovers: list[Failover]) -> Report:
    to_next = [t for f in failovers for t in f.to_next_token_s]
    regenerated = [n for f in failovers for n in f.regenerated]
    restart = statistics.median(f.restart_s for f in failovers)
    return {
        "kills": len(failovers),
        "interrupted_requests": sum(f.interrupted for f in failovers),
        "time_to_next_token_s": summary(to_next),
        "resumed_requests": len(regenerated),
        "tokens_regenerated": summary([float(n) for n in regenerated]),
        "tokens_regenerated_max": max(regenerated, default=None),
        "tokens_regenerated_total": sum(regenerated),
        "restart_from_prompt_s": round(restart, 3),
        "restart_tokens_regenerated": round(statistics.median(f.restart_tokens for f in failovers)),
        "speedup_vs_restart": round(restart / statistics.median(to_next), 1) if to_next else None,
    }


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 4),
        "max": round(ordered[-1], 4),
        "n": len(ordered),
    }


# ---------------------------------------------------------------- token-log cost


async def log_cost(client: Client, k: int, chunks: int = 200) -> dict[str, float]:
    js = client.nc.jetstream()
    request_id = f"bench-{uuid.uuid4().hex[:12]}"
    tokens = list(range(k))
    t0 = time.perf_counter()
    after = 0  # each append follows the last, as the router's do
    for i in range(chunks):
        chunk = LogChunk(request_id=request_id, index=i, position=i * k, tokens=tokens, attempt=1)
        after = await token_log.append(js, client.subjects, chunk, after, incarnation=0)
    elapsed = time.perf_counter() - t0  # (the log denies purges: these records age out with the rest)
    return {
        "append_ms_per_chunk": round(1000 * elapsed / chunks, 3),
        "append_us_per_token": round(1e6 * elapsed / (chunks * k), 3),
        "chunk_tokens": k,
    }


# ---------------------------------------------------------------- the metrics' own cost


async def metrics_cost(client: Client, supervisor: Supervisor, args: argparse.Namespace) -> Report:
    """The router's CPU time per token with metrics on and off, in pairs of rounds.

    Each round restarts the router with one setting (the supervisor restarts a child with its
    argv) and runs the same fixed workload on it (`measured_round`). The two rounds of a pair run
    back to back, in alternating order, so drift and order cancel in their ratio. CPU time moves
    less than tokens/s with what else shares the 2 cores, but it still moves (how many messages
    one loop turn takes, caches), so every figure comes with its spread over the pairs. Beside it,
    the same counter updates timed in-process (`update_cost`): the part of the difference that
    is the metrics' own code, without the noise."""
    child = supervisor.children["router"]
    argv = {"on": list(child.argv), "off": [*child.argv, "--metrics-port", "-1"]}
    updates = update_cost()  # first, while the cluster idles
    pairs: list[dict[str, Round]] = []
    try:
        for i in range(args.metrics_rounds):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")  # neither side always goes first
            pairs.append(
                {setting: await measured_round(client, supervisor, args, argv[setting]) for setting in order}
            )
    finally:
        await restart_router(client, supervisor, argv["on"])  # as the cluster started it
    sides = ("on", "off")
    return {
        "router_cpu_us_per_token": {s: spread([p[s].cpu_us_per_token for p in pairs], 2) for s in sides},
        "cpu_ratio_on_off": spread([p["on"].cpu_us_per_token / p["off"].cpu_us_per_token for p in pairs], 4),
        "tokens_per_s": {s: spread([p[s].tokens_per_s for p in pairs], 1) for s in sides},
        "end_to_end_overhead_pct": spread(
            [100 * (1 - p["on"].tokens_per_s / p["off"].tokens_per_s) for p in pairs], 2
        ),
        "metric_updates_us_per_chunk": updates,
        "pairs": args.metrics_rounds,
        "tokens_per_round": pairs[0]["on"].tokens,
    }


@dataclass
class Round:
    tokens: int
    cpu_us_per_token: float  # the router's CPU time (every thread) over the tokens
    tokens_per_s: float  # end to end, as the client saw them


async def measured_round(
    client: Client, supervisor: Supervisor, args: argparse.Namespace, argv: list[str]
) -> Round:
    """Restart the router with `argv`, run one unmeasured batch, then `--metrics-batches` batches
    of `--requests` requests, reading the router's CPU time before and after. With metrics on,
    the round ends with one scrape, as Prometheus would, whose token count must be the client's.
    The token log is deleted first (every request in it has ended; it denies purges, not its own
    deletion) and the new router declares it again, so each starts from the same empty state: one
    rebuilt from a log that grows round by round would hold ever more requests, and its garbage
    collector would take ever longer."""
    await client.nc.jetstream().delete_stream(client.subjects.token_log_stream)
    pid = await restart_router(client, supervisor, argv)
    await routed_batch(client, args, args.requests)  # warm-up on the new router
    port = (await router_stats(client)).metrics_port  # 0: metrics off
    counted = await asyncio.to_thread(generated_tokens, port) if port else 0.0
    before, t0 = cpu_seconds(pid), time.perf_counter()
    tokens = 0
    for _ in range(args.metrics_batches):
        tokens += await routed_batch(client, args, args.requests)
    if port:
        counted = await asyncio.to_thread(generated_tokens, port) - counted
        if counted != tokens:
            raise RuntimeError(f"the router counted {counted} tokens generated, the client {tokens}")
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - before
    return Round(tokens, 1e6 * cpu / tokens, tokens / elapsed)


def update_cost(calls: int = 200_000) -> dict[str, float]:
    """Microseconds the router's metrics take per accepted chunk (one token each in decode), timed
    in-process: the two counter updates `Router.accept` makes, on a live registry ("on") and on the
    NULL metrics that --metrics-port -1 gives ("off"). The best of 5 runs."""

    def per_chunk(metrics: RouterMetrics) -> float:
        def chunk() -> None:  # what Router.accept does for a chunk of one fresh token
            metrics.tokens_accepted.inc(1)
            metrics.tokens_generated.inc(1)

        return 1e6 * min(timeit.repeat(chunk, number=calls, repeat=5)) / calls

    on, off = RouterMetrics(Metrics(enabled=True)), RouterMetrics(Metrics(enabled=False))
    return {"on": round(per_chunk(on), 3), "off": round(per_chunk(off), 3)}


async def restart_router(client: Client, supervisor: Supervisor, argv: list[str]) -> int:
    """Stop the router (a drain) and let the supervisor start it again with `argv`; its pid once
    the new one answers and sees both engines."""
    child = supervisor.children["router"]
    old = child.pid
    child.argv = argv  # what the supervisor runs at the restart
    assert child.process is not None
    child.process.terminate()
    async with asyncio.timeout(120):
        while True:
            if child.pid != old and child.state == "running":
                with contextlib.suppress(bus.ServiceError):
                    if (await router_stats(client)).pid == child.pid:
                        await client.wait_for_engines(2, 60)
                        return child.pid
            await asyncio.sleep(0.1)


async def router_stats(client: Client) -> ServiceStats:
    subject = client.subjects.service_stats("router")
    return await bus.request_struct(client.nc, subject, StatsRequest(), ServiceStats, 2.0)


def generated_tokens(port: int) -> float:
    """belayer_router_tokens_generated_total, scraped from the router's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "belayer_router_tokens_generated_total"
    )


def spread(values: list[float], digits: int) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


# ---------------------------------------------------------------- output


def print_table(report: Report) -> None:
    for preset, figures in report["presets"].items():
        o, w, r, t = figures["overhead"], figures["worker_kill"], figures["router_kill"], figures["token_log"]
        print(f"\npreset {preset}")
        print(f"  tokens/s via router   {o['router_tokens_per_s']:>9}  spread {o['router_spread']}")
        print(f"  tokens/s direct       {o['direct_tokens_per_s']:>9}  spread {o['direct_spread']}")
        print(f"  router overhead       {o['overhead_pct']:>8}%  ({o['rounds']} alternated rounds each)")
        for name, f in (("worker kill", w), ("router kill", r)):
            print(
                f"  {name} x{f['kills']}: next new token {f['time_to_next_token_s']} s, regenerated per request"
                f" {f['tokens_regenerated']}; restart from prompt {f['restart_from_prompt_s']} s, regenerated"
                f" {f['restart_tokens_regenerated']}; ratio {f['speedup_vs_restart']}x"
            )
        print(
            f"  (router lease TTL {r['lease_ttl_s']} s, not waited out: the supervisor reports the exit;"
            " the target for the next new token is 1 s)"
        )
        print(
            f"  token log: {t['append_us_per_token']} us/token ({t['append_ms_per_chunk']} ms per {t['chunk_tokens']}-token chunk)"
        )
    if (m := report.get("metrics_cost")) is not None:
        cpu, rate, ratio = m["router_cpu_us_per_token"], m["tokens_per_s"], m["cpu_ratio_on_off"]
        e2e, calls = m["end_to_end_overhead_pct"], m["metric_updates_us_per_chunk"]
        print(
            f"\nmetrics cost (preset {m['preset']}, {m['pairs']} pairs of rounds of {m['tokens_per_round']} tokens)"
        )
        for setting in ("on", "off"):
            c, r = cpu[setting], rate[setting]
            print(
                f"  metrics {setting:<3}  router CPU {c['median']} us/token (min {c['min']}, max {c['max']});"
                f" {r['median']} tokens/s (min {r['min']}, max {r['max']})"
            )
        print(f"  router CPU on/off, paired: {ratio['median']} (min {ratio['min']}, max {ratio['max']})")
        print(f"  end-to-end overhead, paired: {e2e['median']}% (min {e2e['min']}%, max {e2e['max']}%)")
        print(f"  the counter updates alone: {calls['on']} us per chunk on, {calls['off']} off")
