"""Typed configuration, validated once. Each process gets one frozen config; CLI flags map 1:1 to
fields, and a bad value is reported with the name of its flag."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

NATS_URL_ENV = "BELAYER_NATS_URL"
STATE_DIR_ENV = "BELAYER_STATE_DIR"
DEFAULT_STATE_DIR = Path(".belayer")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag."""


def _positive(flag: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{flag} must be > 0, got {value}")


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


def resolve_nats_url(flag: str | None, state_dir: Path | None = None) -> str:
    """--nats, else $BELAYER_NATS_URL, else the embedded server recorded by `belayer up`."""
    if flag:
        return flag
    if env := os.environ.get(NATS_URL_ENV):
        return env
    url_file = (state_dir or default_state_dir()) / "nats.url"
    if url_file.exists():
        return url_file.read_text().strip()
    raise ConfigError(
        f"no NATS server: pass --nats URL, set {NATS_URL_ENV}, or start one with `belayer up`"
        f" (looked for {url_file})"
    )


@dataclass(frozen=True)
class RouterConfig:
    nats_url: str
    chunk_tokens: int = 256  # k: the token log is appended at least every k tokens
    heartbeat_timeout_s: float = 1.0  # silence after which a worker is declared failed
    no_worker_deadline_s: float = 30.0  # how long a request waits for any healthy worker
    dispatch_timeout_s: float = 2.0
    max_dispatch_attempts: int = 1000  # bound on resumes of one request
    handover_grace_s: float = 0.0  # how long a failed engine's requests wait for its shadow
    client_timeout_s: float = 60.0  # a request nobody follows this long is cancelled

    def __post_init__(self) -> None:
        _positive("--chunk-tokens", self.chunk_tokens)
        _positive("--heartbeat-timeout", self.heartbeat_timeout_s)
        _positive("--no-worker-deadline", self.no_worker_deadline_s)
        _positive("--dispatch-timeout", self.dispatch_timeout_s)
        _positive("--max-dispatch-attempts", self.max_dispatch_attempts)
        _positive("--client-timeout", self.client_timeout_s)


@dataclass(frozen=True)
class WorkerConfig:
    nats_url: str
    engine_id: str
    preset: str = "tiny"
    weights_seed: int = 0
    weights_path: Path | None = None
    num_blocks: int = 512
    max_step_tokens: int = 128
    heartbeat_interval_s: float = 0.2
    # Under a shadow supervisor: "main" serves, "shadow" pre-initialises and waits for a handover.
    role: Literal["standalone", "main", "shadow"] = "standalone"
    heartbeat_file: Path | None = None  # mtime refreshed by the scheduling loop
    shared_memory: bool = False  # map weights and KV arena from the weight and KV servers
    watch_pid: int = 0  # shadow: the main it stands behind
    watch_file: Path | None = None  # shadow: the main's heartbeat file
    hang_timeout_s: float = 2.0  # shadow: main's heartbeat file older than this is a hang

    def __post_init__(self) -> None:
        _positive("--num-blocks", self.num_blocks)
        _positive("--max-step-tokens", self.max_step_tokens)
        _positive("--heartbeat-interval", self.heartbeat_interval_s)
        if self.weights_path is not None and not self.weights_path.is_file():
            raise ConfigError(f"--weights {self.weights_path} is not a file")
        if self.role == "shadow" and (self.watch_pid <= 0 or self.watch_file is None):
            raise ConfigError("--role shadow needs --watch-pid and --watch-file")
        _positive("--hang-timeout", self.hang_timeout_s)


@dataclass(frozen=True)
class ClusterConfig:
    state_dir: Path
    engines: int = 2
    preset: str = "tiny"
    weights_seed: int = 0
    nats_url: str | None = None  # None: start the embedded nats-server
    nats_port: int = 0  # 0: pick a free port
    chunk_tokens: int = 256
    heartbeat_timeout_s: float = 1.0
    no_worker_deadline_s: float = 30.0
    client_timeout_s: float = 60.0  # the router cancels a request nobody has followed this long
    restart_backoff_s: float = 0.2
    max_restart_backoff_s: float = 5.0
    shadows: bool = True  # workers under the shadow supervisor, with weight and KV servers
    hang_timeout_s: float = 2.0  # shadow: a main's stale heartbeat file means a hang
    failure_window_s: float = 60.0  # two failures of one engine inside it: quarantine
    sandboxes: bool = True  # start the checkpointer when a Docker engine answers

    def __post_init__(self) -> None:
        if self.engines < 0:
            raise ConfigError(f"--engines must be >= 0, got {self.engines}")
        _positive("--chunk-tokens", self.chunk_tokens)
        _positive("--heartbeat-timeout", self.heartbeat_timeout_s)
        _positive("--no-worker-deadline", self.no_worker_deadline_s)
        _positive("--restart-backoff", self.restart_backoff_s)
        _positive("--client-timeout", self.client_timeout_s)


@dataclass(frozen=True)
class ShadowSupervisorConfig:
    nats_url: str
    engines: tuple[str, ...]
    state_dir: Path  # heartbeat files and worker logs
    preset: str = "tiny"
    weights_seed: int = 0
    num_blocks: int = 512
    hang_timeout_s: float = 2.0  # a main's heartbeat file older than this is a hang
    failure_window_s: float = 60.0  # a second failure of one engine inside it: quarantine
    death_timeout_s: float = 2.0  # how long a SIGKILLed main may take to be reaped
    start_timeout_s: float = 120.0  # a worker's start-up (cold path included)

    def __post_init__(self) -> None:
        if not self.engines:
            raise ConfigError("--engines must name at least one engine")
        _positive("--hang-timeout", self.hang_timeout_s)
        _positive("--failure-window", self.failure_window_s)
        _positive("--death-timeout", self.death_timeout_s)
        _positive("--start-timeout", self.start_timeout_s)
