"""The rollout side's faults in a training run (`belayer train --chaos worker@2:kill,...`), struck
from the CLI at the local cluster.

Each fault of the schedule (group_faults.py) waits for its step and its seeded delay, then for work
in flight on a target of its kind: a fault that hits nothing has not fired. It strikes once and
says what it interrupted:
- `worker`: SIGKILL or SIGSTOP of the main of an engine serving requests (a stopped main is
  continued after a few seconds, by when its shadow supervisor has seen the hang);
- `router`: SIGKILL or SIGSTOP of the router holding the lease while requests are in flight
  (a stopped one is continued once its lease has expired);
- `sandbox`: `docker kill` or `docker pause` of the container of a running trajectory of the run
  (a paused one is unpaused after a second or two);
- `checkpointer`: SIGKILL of the checkpointer while trajectories run (its supervisor restarts it);
- `nats`: the nats-server killed and started again while requests or trajectories are in flight.

What the processes are comes from `Targets`: the local cluster's state (`belayer up`'s
cluster.json) read by `LocalCluster`, or a test's cluster.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiodocker
import msgspec

from belayer_rl.cli.chaos.lab import DOCKER_CALL_S, after, resume, thaw, unpause
from belayer_rl.cli.up import read_cluster
from belayer_rl.services.checkpointer.sandbox import LABEL_SANDBOX
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.services.trainer.group_faults import Fault, Running
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client

POLL_S = 0.05  # how often a due fault looks for work in flight
STOPPED_S = (2.0, 4.0)  # a stopped worker is continued this long after (seeded): past the hang timeout
PAUSED_S = (1.0, 2.0)  # a paused container is unpaused this long after (seeded)


class Targets(Protocol):
    """Where a training run's rollout side lives."""

    client: Client  # one that may read the router's lease (an operator's, `admin`)
    docker: aiodocker.Docker | None  # None: no sandbox faults

    def pid_of(self, name: str) -> int:
        """The pid of a supervised process (`checkpointer`); 0 when it is not running."""
        ...

    async def restart_nats(self) -> None: ...


@dataclass
class LocalCluster:
    """The cluster `belayer up` started on this host, seen through its state folder."""

    client: Client
    docker: aiodocker.Docker | None
    state_dir: Path

    def pid_of(self, name: str) -> int:
        cluster = read_cluster(self.state_dir)
        if cluster is None:
            return 0
        return next((p.pid for p in cluster.processes if p.name == name and p.state != "stopped"), 0)

    async def restart_nats(self) -> None:
        """Kill the nats-server `belayer up` started; its supervisor starts it again."""
        pid = self.pid_of("nats-server")
        if pid <= 0:
            raise RuntimeError(f"no nats-server started by `belayer up` in {self.state_dir}")
        os.kill(pid, signal.SIGKILL)


@dataclass
class RolloutChaos:
    """The rollout-side faults of one schedule, against `targets`, while `trainer` runs `run`."""

    trainer: Running
    run: str  # the run's id: its trajectories' ids start with `{run}-s{step}-`
    targets: Targets
    seed: int
    log: list[str] = field(default_factory=list)  # one line per fault: what it interrupted, or why not
    report: Callable[[str], None] = lambda line: None  # told of each line as it is logged
    later: list[asyncio.Task[None]] = field(default_factory=list)  # the continues and unpauses due

    async def inject(self, faults: list[Fault]) -> None:
        rng = random.Random(self.seed)  # the targets' draws, after the schedule's own
        try:
            for fault in (f for f in faults if f.rollout):
                while self.trainer.step < fault.step:  # noqa: ASYNC110 (the trainer has no event for it)
                    await asyncio.sleep(0.01)
                await asyncio.sleep(fault.delay_s)
                self.log.append(await self.strike(fault, rng))
                self.report(self.log[-1])
        finally:
            await asyncio.gather(*self.later, return_exceptions=True)

    async def strike(self, fault: Fault, rng: random.Random) -> str:
        strike = {"worker": self.worker, "router": self.router, "sandbox": self.sandbox,
                  "checkpointer": self.checkpointer, "nats": self.nats}[fault.group]  # fmt: skip
        away = ""  # why the latest look found no target
        while self.trainer.step == fault.step:
            try:
                hit = await strike(fault, rng)
            except (bus.ServiceError, aiodocker.DockerError, ProcessLookupError, TimeoutError) as exc:
                hit, away = None, f"; {type(exc).__name__}: {exc}"  # away (an earlier fault's): look again
            if hit:
                return f"{fault}: {hit}"
            await asyncio.sleep(POLL_S)
        return f"{fault}: not fired (nothing of step {fault.step} in flight{away})"

    async def worker(self, fault: Fault, rng: random.Random) -> str | None:
        status = await self.targets.client.status(patience_s=0.5)
        busy = sorted({r.engine_id for r in status.requests if r.engine_id})
        engines = [e for e in status.engines if e.alive and e.pid > 0 and e.engine_id in busy]
        if not engines:
            return None
        engine = rng.choice(engines)
        hits = sum(1 for r in status.requests if r.engine_id == engine.engine_id)
        self.signal(engine.pid, fault.action, rng.uniform(*STOPPED_S))
        return f"{engine.engine_id} main pid {engine.pid}, {hits} requests in flight"

    async def router(self, fault: Fault, rng: random.Random) -> str | None:
        holder = await lease_holder(self.targets.client.nc.jetstream(), self.targets.client.subjects)
        if holder is None or holder.released:
            return None
        hits = sum(1 for r in (await self.targets.client.status(patience_s=0.5)).requests if r.engine_id)
        if not hits:
            return None
        self.signal(holder.pid, fault.action, holder.ttl_s + rng.uniform(0.5, 1.5))
        return f"router incarnation {holder.incarnation} pid {holder.pid}, {hits} requests in flight"

    async def sandbox(self, fault: Fault, rng: random.Random) -> str | None:
        running = await self.running_sandboxes(fault.step)
        if not running:
            return None
        trajectory, container = rng.choice(running)
        if fault.action == "kill":
            await container.kill()
        else:
            try:
                async with asyncio.timeout(DOCKER_CALL_S):  # see lab.unpause: the daemon may be stuck on it
                    await container.pause()
            except TimeoutError:
                thaw(container.id)
                return None
            self.later.append(after(rng.uniform(*PAUSED_S), lambda: unpause(container, trajectory)))
        return f"trajectory {trajectory}'s container {container.id[:12]}"

    async def checkpointer(self, fault: Fault, rng: random.Random) -> str | None:
        running = await self.running_sandboxes(fault.step)
        pid = self.targets.pid_of("checkpointer")
        if not running or pid <= 0:
            return None
        self.signal(pid, "kill", 0.0)
        return f"checkpointer pid {pid}, {len(running)} trajectories in flight"

    async def nats(self, fault: Fault, rng: random.Random) -> str | None:
        running = await self.running_sandboxes(fault.step) if self.targets.docker is not None else []
        requests = len((await self.targets.client.status(patience_s=0.5)).requests)
        if not running and not requests:
            return None
        await self.targets.restart_nats()
        return f"nats-server, {requests} requests and {len(running)} trajectories in flight"

    async def running_sandboxes(self, step: int) -> list[tuple[str, aiodocker.containers.DockerContainer]]:
        """The running containers of this step's trajectories, by trajectory id."""
        if self.targets.docker is None:
            raise RuntimeError("sandbox and checkpointer faults need Docker sandboxes (--sandbox docker)")
        prefix = f"{self.run}-s{step}-"
        listed = await self.targets.docker.containers.list(filters={"label": [LABEL_SANDBOX]})
        found = []
        for container in listed:
            trajectory = msgspec.convert(container["Labels"], dict[str, str])[LABEL_SANDBOX]
            if trajectory.startswith(prefix):
                found.append((trajectory, container))
        return sorted(found, key=lambda pair: pair[0])

    def signal(self, pid: int, action: str, resume_after_s: float) -> None:
        os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        if action == "stop":
            self.later.append(after(resume_after_s, lambda: resume(pid)))
