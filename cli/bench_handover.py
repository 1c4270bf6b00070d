"""`belayer bench handover`: a shadow taking over a killed main vs a cold restart, per preset.

For each preset, one engine under the shadow supervisor:
- N SIGKILLs of the main: detection latency (kill to the failure noticed) and time to ready (kill
  to the replacement registered under its new epoch), p50 and p95; time to the first resumed token
  of a request with a fixed prompt length;
- the same recovery by cold restart in the same run: a new worker process (imports, model build,
  weights loaded from a file, arena allocated, registered), timed from spawn to registration;
- the failure-free cost of the shadow: its CPU time and memory while idle, and tokens/s with the
  shadow running vs frozen (SIGSTOP), alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from belayer_rl.cli.bench_report import Report, emit, percentiles
from belayer_rl.cli.bench_rollout import PROMPT, through_router
from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster, service_child
from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import ConfigError, WorkerConfig
from belayer_rl.shared.declaration import Planned
from belayer_rl.shared.params import init_params, save_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.processes import cpu_seconds
from belayer_rl.shared.protocol import (
    Handover,
    ModelPublished,
    RequestResumed,
    TokenChunk,
    WorkerRegistration,
)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    handover = kinds.add_parser("handover", help="shadow handover vs cold restart, per preset")
    handover.add_argument("--presets", default="tiny,small,medium,base", help="comma-separated presets")
    handover.add_argument("--kills", type=int, default=20, help="main kills per preset")
    handover.add_argument("--cold-starts", type=int, default=3, help="cold restarts per preset")
    handover.add_argument(
        "--prompt-tokens", type=int, default=256, help="prompt length of the resumed request"
    )
    handover.add_argument("--requests", type=int, default=8, help="concurrent requests for tokens/s")
    handover.add_argument("--max-tokens", type=int, default=48, help="tokens per request for tokens/s")
    handover.add_argument("--rounds", type=int, default=3, help="alternated rounds with/without shadow")
    handover.add_argument("--engine", choices=("builtin", "vllm"), default="builtin", help="the engine kind")
    handover.add_argument(
        "--model-path", type=Path, help="--engine vllm: the model folder (it replaces --presets)"
    )
    handover.add_argument("--engine-python", type=Path, help="--engine vllm: the Python of vLLM's virtualenv")
    handover.add_argument("--weight-updates", type=int, default=5, help="--engine vllm: versions published")
    handover.add_argument("--json", action="store_true", help="print one JSON object")
    handover.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(uvloop.run(bench(args)), args.json, print_table)


async def bench(args: argparse.Namespace) -> Report:
    report: Report = {"host_cpus": os.cpu_count(), "engine": args.engine, "presets": {}}
    vllm = args.engine == "vllm"
    if vllm and args.model_path is None:
        raise ConfigError("--engine vllm needs --model-path")
    for preset in ["vllm"] if vllm else args.presets.split(","):
        engine = (
            {"kind": "vllm", "model_path": args.model_path, "engine_python": args.engine_python}
            if vllm
            else {}
        )
        with tempfile.TemporaryDirectory(prefix="belayer-bench-") as state:
            config = ClusterConfig(
                state_dir=Path(state), engines=1, sandboxes=False,
                services=UpSettings(preset="tiny" if vllm else preset, failure_window_s=0.001, **engine),
            )  # fmt: skip
            async with local_cluster(config) as supervisor:
                async with await Client.connect(supervisor.target(), "bench") as client:
                    await client.wait_for_engines(1, 600)
                    engines_file = Path(state) / "workers" / "engines.json"
                    killed: set[int] = set()
                    figures = {
                        "handover": await kills(client, engines_file, args.kills, killed),
                        "first_resumed_token": await resumed_token(
                            client, engines_file, args.prompt_tokens, killed
                        ),
                        "cold_restart": await cold_restarts(client, supervisor, preset, args),
                        "shadow_cost": await shadow_cost(client, engines_file, args, killed),
                    }
                    if vllm:
                        figures["weight_update"] = await weight_updates(client, args.weight_updates)
        hand, cold = figures["handover"]["time_to_ready"], figures["cold_restart"]["time_to_ready"]
        figures["ratio_cold_vs_handover_p50"] = round(cold["p50_ms"] / hand["p50_ms"], 1)
        if vllm:
            update = figures["weight_update"]["publish_to_first_token"]
            figures["ratio_cold_vs_weight_update_p50"] = round(cold["p50_ms"] / update["p50_ms"], 1)
        report["presets"][preset] = figures
    return report


async def engine_pids(engines_file: Path, not_pids: set[int]) -> dict[str, int]:
    """The engine's main and shadow once a shadow stands by that is not one of `not_pids`."""
    while True:
        entry = (await asyncio.to_thread(read_engines, engines_file)).get("e0")
        if entry and entry["shadow"] and entry["shadow"] not in not_pids and entry["main"] not in not_pids:
            return entry
        await asyncio.sleep(0.02)


def read_engines(engines_file: Path) -> dict[str, dict[str, int]]:
    return json.loads(engines_file.read_text()) if engines_file.exists() else {}


class Watch:
    """Handover and registration events with their arrival times."""

    def __init__(self) -> None:
        self.handovers: dict[int, Handover] = {}  # by old pid
        self.registered: dict[int, float] = {}  # pid -> arrival time
        self.changed = asyncio.Event()

    async def start(self, client: Client) -> None:
        async def on_handover(event: Handover) -> None:
            self.handovers[event.old_pid] = event
            self.changed.set()

        async def on_registered(event: WorkerRegistration) -> None:
            self.registered.setdefault(event.pid, time.time())
            self.changed.set()

        await bus.listen(client.nc, client.subjects.event("handover", "*"), Handover, on_handover)
        await bus.listen(
            client.nc, client.subjects.event("worker_registered", "*"), WorkerRegistration, on_registered
        )

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 120)


async def kills(client: Client, engines_file: Path, n: int, killed: set[int]) -> Report:
    watch = Watch()
    await watch.start(client)
    detect, ready, paths = [], [], []
    for _ in range(n):
        pids = await engine_pids(engines_file, killed)
        await asyncio.sleep(0.3)  # let the new shadow settle, as it would between failures
        killed_at = time.time()
        os.kill(pids["main"], signal.SIGKILL)
        killed.add(pids["main"])

        def handed_over(p: dict[str, int] = pids) -> bool:
            return p["main"] in watch.handovers and p["shadow"] in watch.registered

        await watch.until(handed_over)
        event = watch.handovers[pids["main"]]
        detect.append(event.detected_at - killed_at)
        ready.append(watch.registered[pids["shadow"]] - killed_at)
        paths.append(event.path)
    return {
        "detection": percentiles(detect),
        "time_to_ready": percentiles(ready),
        "shadow_path": paths.count("shadow"),
        "phases_ms_last": event.phases_ms,
    }


async def resumed_token(
    client: Client, engines_file: Path, prompt_tokens: int, killed: set[int]
) -> dict[str, float]:
    """Kill the main mid-decode of a request with a prompt of `prompt_tokens`; time to its next
    token from the resumed attempt. Tokens the main published before it died can still arrive
    after the kill: only those after the router's `request_resumed` event count."""
    prompt = (PROMPT * (prompt_tokens // len(PROMPT) + 1))[:prompt_tokens]
    resumed_at: dict[str, float] = {}

    async def on_resumed(event: RequestResumed) -> None:
        resumed_at.setdefault(event.request_id, time.time())

    await bus.listen(client.nc, client.subjects.event("request_resumed", "*"), RequestResumed, on_resumed)
    for seed in range(100):  # random weights end some generations early: retry until one runs on
        pids = await engine_pids(engines_file, killed)
        await asyncio.sleep(0.3)
        arrivals: list[float] = []
        killed_at = 0.0
        request_id = ""
        async for item in client.generate(prompt, max_tokens=128, seed=seed, temperature=0.8):
            if not isinstance(item, TokenChunk):
                break
            request_id = item.request_id
            arrivals.append(time.time())
            if not killed_at and item.position + len(item.tokens) >= 4:
                killed_at = time.time()
                os.kill(pids["main"], signal.SIGKILL)
                killed.add(pids["main"])
        after = [t for t in arrivals if killed_at and t > resumed_at.get(request_id, math.inf)]
        if after:
            return {
                "prompt_tokens": prompt_tokens,
                "kill_to_next_token_ms": round(1000 * (after[0] - killed_at), 1),
            }
    raise RuntimeError("no generation ran past the kill")


async def cold_restarts(
    client: Client, supervisor: Supervisor, preset: str, args: argparse.Namespace
) -> Report:
    """A worker from scratch for a spare engine id: spawn to registration, weights from a file
    (a vLLM worker: its model folder, loaded and warmed up as a shadow would be).

    The cluster's credentials name only its own engines, so the spare one connects as `admin`."""
    n = args.cold_starts
    watch = Watch()
    await watch.start(client)
    times = []
    with tempfile.TemporaryDirectory(prefix="belayer-weights-") as folder:
        weights = Path(folder) / f"{preset}.pt"
        if args.engine == "builtin":
            await asyncio.to_thread(save_params, init_params(PRESETS[preset], 0), weights)
        for i in range(n):
            if args.engine == "vllm":
                config = WorkerConfig(
                    **supervisor.bus("admin"), engine_id=f"cold{i}", kind="vllm", model_path=args.model_path,
                    engine_python=args.engine_python,
                )  # fmt: skip
            else:
                config = WorkerConfig(
                    **supervisor.bus("admin"), engine_id=f"cold{i}", preset=preset, weights_path=weights
                )
            started = time.time()
            process = await asyncio.create_subprocess_exec(
                *service_child(Planned(f"cold{i}", config, python=config.engine_python), WORKER.module).argv,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )

            def registered(p: int = process.pid) -> bool:
                return p in watch.registered

            await watch.until(registered)
            times.append(watch.registered[process.pid] - started)
            process.terminate()
            await process.wait()
    return {"time_to_ready": percentiles(times)}


async def weight_updates(client: Client, n: int) -> Report:
    """vLLM: `n` new versions published (each a new folder of seeded weights), each timed from the
    publication to the first token of a request on it, the weights replaced in place (main and
    shadow load each from the folder). The time includes the worker's next heartbeat (0.2 s
    apart), which tells the router that the engine holds the version."""
    from belayer_rl.cli.model import make_tiny
    from belayer_rl.shared.model_folder import folder_version

    times = []
    with tempfile.TemporaryDirectory(prefix="belayer-versions-") as folder:
        for i in range(n):
            new = await asyncio.to_thread(make_tiny, Path(folder) / f"v{i}", 100 + i)
            version = folder_version(new)
            published_at = time.time()
            event = ModelPublished(version=version, path=str(new))
            await bus.publish(client.nc, client.subjects.event("model_published", version), event)
            while not [e for e in (await client.status()).engines if e.weight_version == version]:  # noqa: ASYNC110 - the router's state
                await asyncio.sleep(0.01)  # the worker reports the newest it holds in its heartbeat
            async for item in client.generate(PROMPT, max_tokens=4, weight_version=version):
                if isinstance(item, TokenChunk):
                    times.append(time.time() - published_at)
                    break
    return {"publish_to_first_token": percentiles(times)}


def memory_kb(pid: int) -> dict[str, int]:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    values = {
        line.split()[0][:-1]: int(line.split()[1]) for line in rollup[1:] if line.split()[0].endswith(":")
    }
    return {
        "rss_kb": values["Rss"],
        "pss_kb": values["Pss"],
        "private_kb": values["Private_Clean"] + values["Private_Dirty"],
    }


async def shadow_cost(
    client: Client, engines_file: Path, args: argparse.Namespace, killed: set[int]
) -> Report:
    pids = await engine_pids(engines_file, killed)
    await through_router(client, args, args.requests)  # warm-up
    shadow = pids["shadow"]
    cpu0, t0 = cpu_seconds(shadow), time.monotonic()
    await asyncio.sleep(5.0)
    idle_cpu_pct = 100 * (cpu_seconds(shadow) - cpu0) / (time.monotonic() - t0)
    with_shadow, frozen = [], []
    try:
        for _ in range(args.rounds):
            with_shadow.append(await through_router(client, args, args.requests))
            os.kill(shadow, signal.SIGSTOP)
            frozen.append(await through_router(client, args, args.requests))
            os.kill(shadow, signal.SIGCONT)
    finally:
        os.kill(shadow, signal.SIGCONT)
    w, f = statistics.median(with_shadow), statistics.median(frozen)
    return {
        "idle_cpu_pct": round(idle_cpu_pct, 2),
        "memory": memory_kb(shadow),
        "tokens_per_s_with_shadow": round(w, 1),
        "tokens_per_s_shadow_frozen": round(f, 1),
        "loss_pct": round(100 * (f - w) / f, 2),
    }


def print_table(report: Report) -> None:
    for preset, f in report["presets"].items():
        h, c, s = f["handover"], f["cold_restart"], f["shadow_cost"]
        print(f"\npreset {preset}")
        print(
            f"  detection           p50 {h['detection']['p50_ms']:>8} ms  p95 {h['detection']['p95_ms']:>8} ms"
        )
        print(
            f"  handover to ready   p50 {h['time_to_ready']['p50_ms']:>8} ms  p95 {h['time_to_ready']['p95_ms']:>8} ms  ({h['shadow_path']}/{h['time_to_ready']['n']} via shadow)"
        )
        print(
            f"  cold restart        p50 {c['time_to_ready']['p50_ms']:>8} ms  p95 {c['time_to_ready']['p95_ms']:>8} ms"
        )
        print(f"  ratio cold/handover {f['ratio_cold_vs_handover_p50']}x")
        print(
            f"  first resumed token {f['first_resumed_token']['kill_to_next_token_ms']} ms after the kill ({f['first_resumed_token']['prompt_tokens']}-token prompt)"
        )
        print(
            f"  idle shadow: {s['idle_cpu_pct']}% CPU, private {s['memory']['private_kb']} kB, rss {s['memory']['rss_kb']} kB; tokens/s {s['tokens_per_s_with_shadow']} with vs {s['tokens_per_s_shadow_frozen']} frozen ({s['loss_pct']}% loss)"
        )
