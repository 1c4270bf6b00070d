"""The seeded faults of a chaos campaign: the kinds and times fixed by the seed, the targets whatever
is in flight when a fault fires. Each fault is a `chaos_fault` event."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import aiodocker
import nats.errors

from belayer_rl.cli.chaos.config import ChaosConfig
from belayer_rl.cli.chaos.lab import DOCKER_CALL_S, Lab, after, resume, thaw, unpause
from belayer_rl.cli.chaos.oracle import start_ticks
from belayer_rl.cli.chaos.workload import Trajectories
from belayer_rl.cli.cluster import (
    Supervisor,
)
from belayer_rl.services.checkpointer.sandbox import LABEL_SANDBOX
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import (
    ChaosFault,
)
from belayer_rl.shared.subjects import Subjects

KILLED_SERVICES = ("kv-server", "weight-server", "shadow-supervisor", "checkpointer", "policy")
TARGET_TRIES, TARGET_RETRY_S = 20, 0.25  # a fault whose target is away waits for it this long
PROGRESS_EVERY = 25  # faults between progress lines


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float
    hits: int  # requests or trajectories in flight on the target when it struck


@dataclass
class Injector:
    config: ChaosConfig
    cluster: Supervisor
    lab: Lab
    client: Client
    subjects: Subjects
    trajectories: Trajectories
    started_at: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    seen_pids: dict[int, int | None] = field(default_factory=dict)  # pid -> its start_ticks
    resumptions: list[asyncio.Task[None]] = field(default_factory=list)  # the SIGCONTs and unpauses due

    async def run(self) -> None:
        """Inject the schedule; whatever ends it, every SIGCONT, unpause and ballast removal due
        is still made before it returns."""
        try:
            await self.inject()
        finally:
            await asyncio.gather(*self.resumptions)

    async def inject(self) -> None:
        # The schedule (kinds and times) comes from the seed alone; the targets, drawn from
        # another stream, depend on what is in flight.
        schedule, targets = random.Random(self.config.seed), random.Random(self.config.seed + 1)
        kinds = list(self.config.kinds)
        capped = {"nats-restart": self.config.nats_restarts, "dockerd-restart": self.config.dockerd_restarts}
        while len(self.faults) < self.config.faults and kinds:
            await asyncio.sleep(schedule.expovariate(1.0 / self.config.interval_s))
            kind = schedule.choice(kinds)
            if kind in capped and self.count(kind) >= capped[kind]:
                kinds.remove(kind)
                continue
            fault = None
            for _ in range(TARGET_TRIES):  # the target may be restarting (a router after its kill)
                try:
                    fault = await self.strike(kind, targets)
                except (ServiceError, aiodocker.DockerError, nats.errors.Error, TimeoutError, OSError) as exc:
                    # (the bus restarting, a process gone: ProcessLookupError is an OSError)
                    print(f"chaos: no target for {kind} yet ({type(exc).__name__}: {exc})", file=sys.stderr)
                if fault is not None:
                    break
                await asyncio.sleep(TARGET_RETRY_S)
            if fault is None:
                continue
            self.faults.append(fault)
            if len(self.faults) % PROGRESS_EVERY == 0:
                elapsed = time.monotonic() - self.started_at
                print(f"chaos: {len(self.faults)} faults in {elapsed:.0f}s", file=sys.stderr)
            with contextlib.suppress(Exception):  # the bus may be the fault
                event = ChaosFault(kind=fault.kind, target=fault.target, hits=fault.hits, at_s=fault.at_s)
                await bus.publish(self.client.nc, self.subjects.event("chaos_fault", kind), event)

    def count(self, kind: str) -> int:
        return sum(1 for f in self.faults if f.kind == kind)

    def later(self, delay_s: float, action) -> None:
        self.resumptions.append(after(delay_s, action))

    def signal(self, pid: int, sig: signal.Signals) -> None:
        self.seen_pids.setdefault(pid, start_ticks(pid))
        os.kill(pid, sig)

    async def strike(self, kind: str, rng: random.Random) -> Fault | None:
        at = time.monotonic() - self.started_at
        if kind in ("worker-kill", "worker-stop"):
            status = await self.client.status()
            engines = [e for e in status.engines if e.alive and e.pid > 0]
            if not engines:
                return None
            engine = rng.choice(engines)
            hits = sum(1 for r in status.requests if r.engine_id == engine.engine_id)
            if kind == "worker-kill":
                self.signal(engine.pid, signal.SIGKILL)
            else:
                self.signal(engine.pid, signal.SIGSTOP)
                self.later(rng.uniform(0.3, 1.5), lambda pid=engine.pid: resume(pid))
            return Fault(kind, f"{engine.engine_id} pid {engine.pid}", at, hits)
        if kind in ("router-kill", "router-stop"):
            holder = await lease_holder(self.client.nc.jetstream(), self.subjects)
            if holder is None or holder.released:
                return None
            status = await self.client.status()
            hits = sum(1 for r in status.requests if r.engine_id)
            if kind == "router-kill":
                self.signal(holder.pid, signal.SIGKILL)
            else:
                self.signal(holder.pid, signal.SIGSTOP)
                self.later(holder.ttl_s + rng.uniform(0.5, 1.5), lambda pid=holder.pid: resume(pid))
            return Fault(kind, f"router incarnation {holder.incarnation} pid {holder.pid}", at, hits)
        if kind == "service-kill":
            name = rng.choice([n for n in KILLED_SERVICES if n in self.cluster.children])
            pid = self.cluster.children[name].pid
            if pid <= 0:
                return None
            if name in ("checkpointer", "policy"):
                hits = len(self.trajectories.running)
            else:  # the weight and KV servers, and the shadow supervisor, serve every request
                hits = await self.requests_in_flight()
            self.signal(pid, signal.SIGKILL)
            return Fault(kind, f"{name} pid {pid}", at, hits)
        if kind == "nats-restart":
            hits = len(self.trajectories.running) + await self.requests_in_flight()
            await self.lab.nats.restart(rng.uniform(0.2, 1.0))
            return Fault(kind, f"nats-server :{self.lab.nats.port}", at, hits)
        if kind == "store-full":
            assert self.lab.store is not None
            hits = len(self.trajectories.running)
            self.resumptions.append(asyncio.create_task(self.lab.store.full_for(rng.uniform(1.0, 3.0))))
            return Fault(kind, str(self.lab.store.path), at, hits)
        if kind == "dockerd-restart":
            assert self.lab.dockerd is not None
            hits = len(self.trajectories.running)
            if hits == 0:  # a restart between trajectories tests nothing: wait for one, as below
                return None
            await self.lab.dockerd.restart()
            return Fault(kind, self.lab.dockerd.url, at, hits)
        # container-kill, container-pause: a running trajectory's sandbox
        running = sorted(self.trajectories.running)
        if not running:
            return None
        trajectory = rng.choice(running)
        containers = await self.lab.docker.containers.list(
            filters={"label": [f"{LABEL_SANDBOX}={trajectory}"]}
        )
        if not containers:
            return None
        container = containers[0]
        try:
            async with asyncio.timeout(DOCKER_CALL_S):  # see `unpause`: the daemon may be stuck on it
                if kind == "container-kill":
                    await container.kill()
                else:
                    await container.pause()
        except TimeoutError:
            thaw(container.id)
            return None
        if kind == "container-pause":
            self.later(rng.uniform(0.3, 2.0), lambda c=container, t=trajectory: unpause(c, t))
        return Fault(kind, f"{trajectory} container {container.id[:12]}", at, 1)

    async def requests_in_flight(self) -> int:
        """As the router sees them; 0 while no router answers."""
        try:
            return len((await self.client.status(patience_s=0.5)).requests)
        except ServiceError:
            return 0
