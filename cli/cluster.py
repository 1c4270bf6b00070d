"""The embedded default: a local cluster of nats-server, the router and N rollout workers.

`belayer up` runs `python -m belayer_rl.cli.cluster` in the background; that process starts the
children and supervises them: a child that exits is restarted with exponential backoff and each
exit and restart is an event (`belayer.<cluster>.evt.process.<name>`); a worker's exit is also reported as
worker-failed, so the router resumes its requests without waiting for the heartbeat timeout.
What it runs is written to `<state-dir>/cluster.json`; `belayer down` sends it SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from nats.aio.client import Client as NATS

from belayer_rl.services import SERVICES
from belayer_rl.shared import bus, files, protocol
from belayer_rl.shared import config as flags
from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import Target
from belayer_rl.shared.config import (
    INSTANCE_ENV,
    ConfigError,
    ServiceConfig,
    nested,
    passed_on,
    positive,
    same_as,
    setting,
)
from belayer_rl.shared.declaration import Planned, Service, up_settings
from belayer_rl.shared.processes import (
    STOP_GRACE_S,
    Backoff,
    dies_with_parent,
    free_port,
    start_nats_server,
    stop_process,
)
from belayer_rl.shared.protocol import ProcessEvent, WorkerFailed
from belayer_rl.shared.roles import Credentials
from belayer_rl.shared.subjects import DEFAULT_CLUSTER, Subjects

log = logging.getLogger("belayer.cluster")

STOP_MARGIN_S = 5.0  # past a service's drain timeout: cancelling stragglers, closing, exiting
STABLE_AFTER_S = 10.0  # a child that ran this long gets its backoff reset


class ProcessRecord(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    state: str
    restarts: int = 0


class ClusterFile(msgspec.Struct, kw_only=True):
    """`<state-dir>/cluster.json`: what `belayer status` reads."""

    supervisor_pid: int
    nats_url: str
    processes: list[ProcessRecord]
    cluster_id: str = DEFAULT_CLUSTER
    creds_dir: str = ""  # where each role's credentials are; "" when the bus is open


# The services' settings `belayer up` takes as flags: each declaration names its own (up_settings).
UpSettings = up_settings(SERVICES)
UpSettings.__module__ = __name__  # made by make_dataclass: named here, so a ClusterConfig pickles


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """`belayer up`'s settings: the cluster's own, and under `services` those its services'
    declarations hand it (UpSettings), each default written once, in the service's config."""

    state_dir: Path = setting(help="the cluster's state: JetStream store, logs, cluster.json")
    engines: int = setting(2, "rollout workers (engines) to start")
    nats_url: str | None = setting(None, "an external NATS to use instead of starting one", flag="--nats")
    nats_port: int = setting(0, "port of the embedded nats-server (0: a free one)")
    # The cluster's own bus, which every service it starts shares (Supervisor.bus).
    cluster_id: str = same_as(ServiceConfig, "cluster_id")
    nats_ca: Path | None = same_as(ServiceConfig, "nats_ca")
    nats_cert: Path | None = same_as(ServiceConfig, "nats_cert")
    nats_key: Path | None = same_as(ServiceConfig, "nats_key")
    auth: bool = setting(True, "the embedded nats-server checks credentials and per-role permissions")
    nats_sync_always: bool = setting(
        True,
        "the embedded nats-server puts each JetStream write on disk before acknowledging it"
        " (off: nats-server's default, a sync every 2 minutes; acknowledged writes can be lost"
        " on a power cut)",
    )
    creds_dir: Path | None = setting(
        None, "each role's credentials (`belayer creds` writes them), for an external NATS with auth"
    )
    standby_routers: int = setting(
        0, "routers started beside the active one, each waiting to take its lease when it expires"
    )
    restart_backoff_s: float = setting(0.2, "first wait before a process that exited is restarted")
    max_restart_backoff_s: float = setting(5.0, "longest wait between restarts of a process")
    shadows: bool = setting(True, "workers under the shadow supervisor, with weight and KV servers")
    sandboxes: bool = setting(True, "start the checkpointer when a Docker engine answers")
    gateway: bool = setting(
        False, "start the HTTP gateway (on --gateway-port; its API key: <state>/creds/api-key-default)"
    )
    services: Any = nested(UpSettings)  # an UpSettings (a class made from the declarations)

    def __post_init__(self) -> None:
        if self.engines < 0:
            raise ConfigError(f"--engines must be >= 0, got {self.engines}")
        if self.standby_routers < 0:
            raise ConfigError(f"--standby-routers must be >= 0, got {self.standby_routers}")
        positive("--restart-backoff", self.restart_backoff_s)
        positive("--max-restart-backoff", self.max_restart_backoff_s)


# ---------------------------------------------------------------- supervised children


@dataclass
class Child:
    name: str
    argv: list[str]
    engine_id: str | None = None
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    state: str = "starting"
    instance: str = ""  # a token for this start of the process: $BELAYER_INSTANCE in its environment
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    stop_grace_s: float = STOP_GRACE_S  # SIGTERM to SIGKILL

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def service_child(planned: Planned, module: str) -> Child:
    """A service process started from its config; stopping it waits out its drain timeout."""
    config = planned.config
    argv = [str(planned.python or sys.executable), "-m", module, *flags.to_argv(config)]
    engine = planned.engine or None
    return Child(planned.name, argv, engine_id=engine, stop_grace_s=config.drain_timeout_s + STOP_MARGIN_S)


class UpDeployment:
    """The cluster a Supervisor runs, as the declarations' `up` reads it (shared/declaration.Deployment)."""

    def __init__(self, supervisor: Supervisor) -> None:
        c = supervisor.config
        self.supervisor = supervisor
        self.state_dir, self.shadows, self.standby_routers = c.state_dir, c.shadows, c.standby_routers
        self.engines = tuple(f"e{i}" for i in range(c.engines))
        self.sandboxes = supervisor.sandboxes()
        self.gateway = c.gateway
        self.shm_prefix, self.creds_dir = supervisor.shm_prefix, supervisor.creds_dir
        self.engine_kind = c.services.kind

    def settings(self, cls: type[ServiceConfig], role: str) -> dict[str, Any]:
        return passed_on(self.supervisor.config.services, cls) | self.supervisor.bus(role)


class Supervisor:
    """Starts, watches and restarts the router and workers. Used by `belayer up` and the tests."""

    def __init__(self, config: ClusterConfig, nats_url: str, nc: NATS, creds_dir: Path | None) -> None:
        self.config = config
        self.subjects = Subjects(config.cluster_id)
        self.nats_url = nats_url
        self.creds_dir = creds_dir  # None: the bus is open
        self.nc = nc
        self.children: dict[str, Child] = {}
        self.others: list[ProcessRecord] = []  # processes it does not supervise (nats-server)
        self.stopping = False
        (config.state_dir / "logs").mkdir(parents=True, exist_ok=True)

    def access(self, role: str) -> Access:
        """How a process of `role` connects (`admin` for tests and benchmarks)."""
        return role_access(self.config, self.creds_dir, role)

    def target(self, role: str = "admin") -> Target:
        """This cluster, as a process of `role` sees it (tests and benchmarks: `admin`)."""
        return Target(self.nats_url, self.subjects, self.access(role))

    def creds(self, role: str) -> Path | None:
        return role_creds(self.creds_dir, role)

    def bus(self, role: str) -> dict[str, Any]:
        """The bus settings of a service of `role`: this cluster's NATS, names and TLS, its own credential."""
        c = self.config
        return {
            "nats_url": self.nats_url,
            "cluster_id": c.cluster_id,
            "nats_creds": self.creds(role),
            "nats_ca": c.nats_ca,
            "nats_cert": c.nats_cert,
            "nats_key": c.nats_key,
        }

    def plan(self, services: Sequence[Service] = SERVICES) -> list[Child]:
        """Every declared service's processes (each declaration's `up`), in the declarations' order."""
        deployment = UpDeployment(self)
        return [
            service_child(planned, declared.module)
            for declared in services
            if declared.up is not None
            for planned in declared.up(deployment)
        ]

    @property
    def shm_prefix(self) -> str:
        """Shared-memory segment names of this cluster's servers start with it (one per state dir)."""
        return f"bl{hashlib.sha256(str(self.config.state_dir).encode()).hexdigest()[:10]}"

    def sandboxes(self) -> bool:
        """Whether sandboxes are wanted and a Docker engine answers (else: no checkpointer)."""
        if not self.config.sandboxes:
            return False
        from belayer_rl.services.checkpointer.probe import docker_unreachable

        unreachable = docker_unreachable(self.config.services.docker_url)
        if unreachable is not None:
            log.warning("no checkpointer, so no sandboxes: %s", unreachable)
        return unreachable is None

    async def start(self) -> None:
        c = self.config
        for child in self.plan():
            self.children[child.name] = child
            await self.spawn(child)
            backoff = Backoff(c.restart_backoff_s, c.max_restart_backoff_s, STABLE_AFTER_S)
            child.task = asyncio.create_task(self.watch(child, backoff), name=f"watch-{child.name}")

    async def spawn(self, child: Child) -> None:
        log_path = self.config.state_dir / "logs" / f"{child.name}.log"
        child.instance = secrets.token_hex(16)
        with log_path.open("ab") as out:
            child.process = await asyncio.create_subprocess_exec(
                *child.argv,
                stdout=out,
                stderr=out,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=dies_with_parent(),
                env={**os.environ, INSTANCE_ENV: child.instance},
            )
        child.started_at = time.monotonic()
        child.state = "running"
        await self.announce(ProcessEvent(name=child.name, pid=child.pid, state="started"))

    async def watch(self, child: Child, backoff: Backoff) -> None:
        """Wait for the child to exit; report it and restart it with backoff, until stop()."""
        while True:
            assert child.process is not None
            code = await child.process.wait()
            if self.stopping:
                child.state = "stopped"
                return
            child.state = "exited"
            await self.announce(ProcessEvent(name=child.name, pid=child.pid, state="exited", exit_code=code))
            if child.engine_id is not None:
                failed = WorkerFailed(
                    engine_id=child.engine_id,
                    epoch=0,
                    pid=child.pid,
                    reason="exit",
                    detail=f"exit code {code}",
                )
                await self.publish(self.subjects.event("worker_failed", child.engine_id), failed)
            backoff_s = backoff.after_exit(time.monotonic() - child.started_at)
            child.state = "restarting"
            await self.announce(
                ProcessEvent(name=child.name, pid=child.pid, state="restarting", backoff_s=backoff_s)
            )
            await asyncio.sleep(backoff_s)
            if self.stopping:
                return
            child.restarts += 1
            await self.spawn(child)

    async def stop(self) -> None:
        """SIGTERM workers, then standby routers (which must not take over the lease), then the
        router (so it can flush the log); SIGKILL past the grace."""
        self.stopping = True
        ordered = sorted(
            self.children.values(),
            key=lambda c: (c.engine_id is None, not c.name.startswith("router-standby-")),
        )
        for child in ordered:
            if child.process is not None:
                await stop_process(child.process, child.stop_grace_s)
            child.state = "stopped"
        for child in self.children.values():
            if child.task is not None:
                child.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await child.task

    async def announce(self, event: ProcessEvent) -> None:
        log.info("%s pid %d %s", event.name, event.pid, event.state)
        child = self.children.get(event.name)
        if child is not None:
            event = msgspec.structs.replace(event, instance=child.instance)
        await self.publish(self.subjects.event("process", event.name), event)
        self.write_state()

    async def publish(self, subject: str, message: protocol.Message) -> None:
        try:
            await bus.publish(self.nc, subject, message)
        except Exception as exc:  # the bus may be restarting; the state file still tells
            log.warning("event not published: %s", exc)

    def records(self) -> list[ProcessRecord]:
        return [
            ProcessRecord(name=c.name, pid=c.pid, state=c.state, restarts=c.restarts)
            for c in self.children.values()
        ]

    def write_state(self) -> None:
        state = ClusterFile(
            supervisor_pid=os.getpid(),
            nats_url=self.nats_url,
            processes=self.others + self.records(),
            cluster_id=self.config.cluster_id,
            creds_dir=str(self.creds_dir or ""),
        )
        files.write_whole(self.config.state_dir / "cluster.json", msgspec.json.encode(state))


# ---------------------------------------------------------------- the `belayer up` daemon


def parse_args(argv: list[str] | None = None) -> ClusterConfig:
    parser = argparse.ArgumentParser(prog="belayer-cluster", description="The `belayer up` daemon.")
    flags.add_flags(parser, ClusterConfig)
    config = flags.from_args(ClusterConfig, parser.parse_args(argv))
    return dataclasses.replace(config, state_dir=config.state_dir.resolve())


@contextlib.asynccontextmanager
async def local_cluster(config: ClusterConfig) -> AsyncIterator[Supervisor]:
    """nats-server (unless config.nats_url names one), the router and the workers, until exit."""
    (config.state_dir / "logs").mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        nats_process = None
        creds_dir = config.creds_dir
        if config.nats_url is None:
            port = config.nats_port or free_port()
            server_config = None
            if config.auth:
                creds_dir = config.state_dir / "creds"
                server_config = write_credentials(config, creds_dir)
            embedded = EmbeddedNats(
                config.state_dir / "jetstream",
                port,
                config.state_dir / "logs" / "nats-server.log",
                server_config,
                config.nats_sync_always,
            )
            nats_process = await embedded.start()
            stack.push_async_callback(embedded.stop)
            nats_url = f"nats://127.0.0.1:{port}"
        else:
            nats_url = config.nats_url
        (config.state_dir / "nats.url").write_text(nats_url + "\n")
        stack.callback((config.state_dir / "nats.url").unlink, missing_ok=True)
        nc = await bus.connect(nats_url, "cluster", access=role_access(config, creds_dir, "cluster"))
        stack.push_async_callback(nc.close)
        supervisor = Supervisor(config, nats_url, nc, creds_dir)
        if nats_process is not None:
            record = ProcessRecord(name="nats-server", pid=nats_process.pid, state="running")
            supervisor.others = [record]
            watcher = asyncio.create_task(embedded.keep_running(record, supervisor.write_state))
            stack.push_async_callback(cancelled, watcher)
        await supervisor.start()
        try:
            yield supervisor
        finally:
            await supervisor.stop()
            for record in supervisor.others:
                record.state = "stopped"
            supervisor.write_state()


@dataclass
class EmbeddedNats:
    """The nats-server `belayer up` starts, started again on the same port and store if it dies
    (the services' clients reconnect; JetStream recovers its store)."""

    store: Path
    port: int
    log_file: Path
    server_config: Path | None
    sync_always: bool
    process: asyncio.subprocess.Process | None = None
    stopping: bool = False

    async def start(self) -> asyncio.subprocess.Process:
        self.process = await start_nats_server(
            self.store, self.port, self.log_file, self.server_config, sync_always=self.sync_always
        )
        return self.process

    async def keep_running(self, record: ProcessRecord, changed: Callable[[], None]) -> None:
        while not self.stopping:
            assert self.process is not None
            code = await self.process.wait()
            if self.stopping:
                return
            log.warning("nats-server pid %d exited with %s: starting it again", record.pid, code)
            record.state, record.restarts = "restarting", record.restarts + 1
            changed()
            while not self.stopping:
                try:
                    record.pid = (await self.start()).pid
                    break
                except RuntimeError as exc:  # its port not yet free, say
                    log.warning("nats-server did not start again: %s", exc)
                    await asyncio.sleep(1.0)
            record.state = "running"
            changed()

    async def stop(self) -> None:
        self.stopping = True
        if self.process is not None:
            await stop_process(self.process)


async def cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def role_creds(creds_dir: Path | None, role: str) -> Path | None:
    """A role's credential file; None when the bus is open."""
    return creds_dir / f"{role}.creds" if creds_dir is not None else None


def role_access(config: ClusterConfig, creds_dir: Path | None, role: str) -> Access:
    return Access(
        creds=role_creds(creds_dir, role), ca=config.nats_ca, cert=config.nats_cert, key=config.nats_key
    )


def write_credentials(config: ClusterConfig, creds_dir: Path) -> Path:
    """Fresh credentials for every role and engine, and the embedded server's config that checks
    them; returns that config's path. Regenerated at each start: the old keys stop working."""
    engines = tuple(f"e{i}" for i in range(config.engines))
    Credentials.generate(SERVICES, Subjects(config.cluster_id), engines).write(creds_dir)
    server_config = creds_dir / "nats.conf"
    server_config.write_text('include "auth.conf"\n')
    return server_config


async def run(config: ClusterConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with local_cluster(config):
        await stopping.wait()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
