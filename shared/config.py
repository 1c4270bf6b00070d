"""Typed configuration, validated once.

Each process gets one frozen, keyword-only dataclass. Its fields are the single source of the
process's command line: `setting()` gives a field its default and help text, `add_flags` turns the
fields into argparse flags, `from_args` builds the config back from them, and `to_argv` renders a
config as the argv that starts the process (what `belayer up` and the shadow supervisor pass on).
A default is written once, in the field. A bad value is reported with the name of its flag.

Flag names follow the field: underscores become dashes and a trailing `_s` (seconds) is dropped,
so `heartbeat_timeout_s` is `--heartbeat-timeout`; `setting(flag=...)` names one otherwise. A bool
that defaults to False is a switch (`--shared-memory`); one that defaults to True is turned off
with `--no-<name>`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from belayer_rl.shared.access import Access
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import POLICY_PATTERN
from belayer_rl.shared.subjects import CLUSTER_ID_PATTERN, DEFAULT_CLUSTER, Subjects, cluster_id_ok

NATS_URL_ENV = "BELAYER_NATS_URL"
NATS_CREDS_ENV = "BELAYER_NATS_CREDS"
CLUSTER_ID_ENV = "BELAYER_CLUSTER_ID"
STATE_DIR_ENV = "BELAYER_STATE_DIR"
CHECKPOINT_KEY_ENV = "BELAYER_CHECKPOINT_KEY"
INSTANCE_ENV = "BELAYER_INSTANCE"  # set by `belayer up` for each start of each process it supervises
DEFAULT_STATE_DIR = Path(".belayer")

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the flag."""


def positive(flag: str, value: float) -> None:
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


# ---------------------------------------------------------------- fields -> flags -> argv


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str = "",
    choices: tuple[str, ...] = (),
    env: str = "",
) -> Any:
    """A config field: its default, its help text, and optionally its flag's name, its choices and
    the environment variable that stands in for an absent flag."""
    metadata = {"help": help, "flag": flag, "choices": choices, "env": env}
    return dataclasses.field(default=default, metadata=metadata)


def same_as(owner: type, name: str, *, flag: str = "", choices: tuple[str, ...] = ()) -> Any:
    """A field that repeats another config's field (a cluster passes it on to a service): the
    default and help come from there, so they are written once."""
    source = {f.name: f for f in dataclasses.fields(owner)}[name]
    metadata = dict(source.metadata) | {"same_as": name}
    if flag:
        metadata["flag"] = flag
    if choices:
        metadata["choices"] = choices
    return dataclasses.field(default=source.default, metadata=metadata)


def nested(cls: type) -> Any:
    """A field holding another config, whose flags are this config's flags too (each under its own
    name): add_flags, from_args and to_argv go into it."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls})


def _nested_fields(cls: type) -> list[tuple[str, type]]:
    return [(f.name, f.metadata["nested"]) for f in dataclasses.fields(cls) if "nested" in f.metadata]


def passed_on(config: Any, cls: type) -> dict[str, Any]:
    """The fields of `config` made by same_as() that `cls` has too, by their name there: what a
    cluster's config hands to one of its services' configs."""
    wanted = {f.name for f in dataclasses.fields(cls)}
    return {
        f.metadata["same_as"]: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.metadata.get("same_as") in wanted
    }


def flag_name(field: dataclasses.Field[Any]) -> str:
    if field.metadata.get("flag"):
        return str(field.metadata["flag"])
    return "--" + field.name.removesuffix("_s").replace("_", "-")


def _dest(field: dataclasses.Field[Any]) -> str:
    return flag_name(field).removeprefix("--").replace("-", "_")


def _cli_fields(cls: type, skip: tuple[str, ...]) -> list[tuple[dataclasses.Field[Any], Any]]:
    """The command-line fields of `cls`, each with its resolved type (the annotations are strings
    under `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return [
        (field, hints[field.name])
        for field in dataclasses.fields(cls)
        if field.name not in skip and "help" in field.metadata  # made by setting() or same_as()
    ]


def _base_type(annotation: Any) -> Any:
    """The type inside `X | None`, or the annotation itself."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_flags(parser: argparse._ActionsContainer, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the config class `cls` (fields in `skip` left out), its nested configs' included."""
    for _, inner in _nested_fields(cls):
        add_flags(parser, inner, skip=skip)
    for field, annotation in _cli_fields(cls, skip):
        kind = _base_type(annotation)
        required = field.default is dataclasses.MISSING
        help_text = field.metadata["help"]
        name = flag_name(field)
        if kind is bool:
            # With an environment variable, an absent flag parses to None (see from_args).
            absent = None if field.metadata.get("env") else field.default
            if field.metadata.get("env"):
                help_text = f"{help_text}; ${field.metadata['env']} (true or false) when absent"
            if field.default is True:
                parser.add_argument(
                    "--no-" + name.removeprefix("--"),
                    dest=_dest(field),
                    action="store_false",
                    default=absent,
                    help=f"turn off (on by default): {help_text}",
                )
            else:
                parser.add_argument(
                    name, dest=_dest(field), action="store_true", default=absent, help=help_text
                )
            continue
        options: dict[str, Any] = {"dest": _dest(field), "help": help_text, "required": required}
        if typing.get_origin(kind) is Literal:
            options["choices"] = typing.get_args(kind)
        elif field.metadata["choices"]:
            options["choices"] = field.metadata["choices"]
        if typing.get_origin(kind) is tuple:
            options["type"] = lambda text: tuple(part for part in text.split(",") if part)
            options["help"] = f"{help_text} (comma-separated)"
        elif kind in (int, float, Path):
            options["type"] = kind
        if field.metadata.get("env"):
            options["help"] = f"{options['help']}; ${field.metadata['env']} when absent"
        if not required:
            # A field with an environment variable parses to None when its flag is absent, so that
            # an explicit flag wins over the variable even when it names the default.
            options["default"] = None if field.metadata.get("env") else field.default
            if field.default not in (None, "", ()):
                options["help"] = f"{options['help']} (default: {_render(field.default)})"
        parser.add_argument(name, **options)


def from_args(cls: type[C], args: argparse.Namespace, *, skip: tuple[str, ...] = (), **values: Any) -> C:
    """The config built from parsed flags (plus `values` for fields set by code). A field named
    `nats_url` that no flag set is resolved as every command resolves it (resolve_nats_url)."""
    for field, annotation in _cli_fields(cls, skip):
        value = getattr(args, _dest(field))
        if value is None and field.metadata.get("env"):  # the flag was absent: the variable, or the default
            from_env = os.environ.get(field.metadata["env"], "")
            kind = _base_type(annotation)
            if not from_env:
                value = field.default
            elif kind is bool:
                value = env_flag(field.metadata["env"], from_env)
            else:
                value = kind(from_env) if kind in (int, float, Path) else from_env
        values.setdefault(field.name, value)
    for name, inner in _nested_fields(cls):
        if name not in values:
            values[name] = from_args(inner, args, skip=skip)
    if values.get("nats_url") == "":  # a service config: the bus is found as every command finds it
        values["nats_url"] = resolve_nats_url(None)
    return cls(**values)


def env_flag(variable: str, text: str) -> bool:
    """A yes-or-no environment variable; anything but true/false (1/0, yes/no, on/off) is an error."""
    answer = {
        "true": True,
        "1": True,
        "yes": True,
        "on": True,
        "false": False,
        "0": False,
        "no": False,
        "off": False,
    }
    if text.lower() not in answer:
        raise ConfigError(f"${variable} must be true or false, not {text!r}")
    return answer[text.lower()]


def to_argv(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that recreate `config`'s command-line fields; a field at its default is left out."""
    argv: list[str] = []
    for field, annotation in _cli_fields(type(config), skip):
        value = getattr(config, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        kind = _base_type(annotation)
        if kind is bool:
            argv.append(flag_name(field) if value else "--no-" + flag_name(field).removeprefix("--"))
        elif value is not None:
            argv += [flag_name(field), _render(value)]
    for name, _ in _nested_fields(type(config)):
        argv += to_argv(getattr(config, name), skip=skip)
    return argv


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(part) for part in value)
    return str(value)


def parse_flags(cls: type[C], argv: list[str] | None, *, prog: str, description: str) -> C:
    """Parse a service's command line into its config; a bad value exits with the flag's name."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(parser, cls)
    args = parser.parse_args(argv)
    try:
        return from_args(cls, args)
    except ConfigError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- the services' configs


SHM_PREFIX_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # a server's --shm-prefix: its /dev/shm names start with it


def shm_prefix_ok(prefix: str) -> bool:
    return re.fullmatch(SHM_PREFIX_PATTERN, prefix) is not None


def cuda_available() -> bool:
    import torch  # here, not at the top: a command that only reads configs need not load torch

    return torch.cuda.is_available()


def placement(device: Literal["auto", "cpu", "cuda"]) -> Literal["cpu", "cuda"]:
    """Where a server keeps its memory; "auto" is decided by the server process itself, so a
    parent that only builds its argv (the local cluster) never loads torch or touches CUDA."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    return device


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """What every service's config has: where the bus is and how long a drain may take."""

    nats_url: str = setting("", "NATS URL (default: $BELAYER_NATS_URL or the local cluster)", flag="--nats")
    cluster_id: str = setting(
        DEFAULT_CLUSTER, "the Belayer cluster: prefixes every subject, stream and bucket", env=CLUSTER_ID_ENV
    )
    nats_creds: Path | None = setting(
        None, "NATS credentials: an nkey seed file, or a .creds file with a user JWT", env=NATS_CREDS_ENV
    )
    nats_ca: Path | None = setting(None, "CA certificate that the NATS server's TLS certificate chains to")
    nats_cert: Path | None = setting(None, "client certificate for NATS TLS (with --nats-key)")
    nats_key: Path | None = setting(None, "private key of the client certificate")
    metrics_port: int = setting(0, "port of the Prometheus metrics (0: a free one; -1: no metrics)")
    metrics_host: str = setting("127.0.0.1", "address the metrics listen on")
    drain_timeout_s: float = setting(5.0, "seconds a first SIGTERM may take to finish in-flight work")

    def __post_init__(self) -> None:
        positive("--drain-timeout", self.drain_timeout_s)
        if not cluster_id_ok(self.cluster_id):
            raise ConfigError(f"--cluster-id must match {CLUSTER_ID_PATTERN}, got {self.cluster_id!r}")
        if (self.nats_cert is None) != (self.nats_key is None):
            raise ConfigError("--nats-cert and --nats-key go together")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ConfigError(f"--metrics-port must be -1, 0 or a port, got {self.metrics_port}")

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.cluster_id)

    def bus_settings(self) -> dict[str, Any]:
        """The fields a process passes on to the services it starts: same bus, same cluster, same
        TLS. (Credentials are per role, so a parent that starts another role replaces them.)"""
        names = ("nats_url", "cluster_id", "nats_creds", "nats_ca", "nats_cert", "nats_key", "metrics_host")
        return {name: getattr(self, name) for name in names}

    @property
    def access(self) -> Access:
        """How this service proves who it is to NATS."""
        return Access(creds=self.nats_creds, ca=self.nats_ca, cert=self.nats_cert, key=self.nats_key)


@dataclass(frozen=True, kw_only=True)
class RouterConfig(ServiceConfig):
    chunk_tokens: int = setting(256, "k: the token log is appended at least every k tokens")
    heartbeat_timeout_s: float = setting(1.0, "seconds of worker silence before it is declared failed")
    no_worker_deadline_s: float = setting(30.0, "seconds a request waits for any healthy engine")
    dispatch_timeout_s: float = setting(2.0, "seconds to wait for a worker's ack of a dispatch")
    max_dispatch_attempts: int = setting(1000, "bound on the attempts (resumes) of one request")
    handover_grace_s: float = setting(0.0, "seconds a failed engine's requests wait for its shadow")
    client_timeout_s: float = setting(
        60.0, "seconds without a following client before a request is cancelled"
    )
    replicas: int = setting(1, "copies of each stream and bucket this service declares (3 on a NATS cluster)")
    log_max_mb: int = setting(1024, "the token log's bound; past nine tenths of it new requests are refused")
    log_client_share: float = setting(
        0.25,
        "the most of the token log's room the requests of one client (credential) may hold; past it"
        " only that client's new requests are refused",
    )
    ended_keep_s: float = setting(
        600.0,
        "seconds an ended request stays attachable; then its records leave the token log",
    )
    progress_deadline_s: float = setting(
        30.0, "seconds an attempt may go without a new token before it is resumed (a lost end, say)"
    )
    lease_ttl_s: float = setting(
        2.0,
        "seconds a router's lease outlives its last renewal; a standby router takes over after it"
        " (at once when the holder's supervisor reports its exit)",
    )
    instance: str = setting(
        "", "the token its supervisor gave this start of the router (belayer up sets it)", env=INSTANCE_ENV
    )
    debug_accept_stale: bool = setting(
        False,
        "DEBUG, never in use: accept worker messages from stale attempts (the chaos oracle's mutation check)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("--replicas", self.replicas)
        positive("--log-max-mb", self.log_max_mb)
        positive("--ended-keep", self.ended_keep_s)
        if not 0 < self.log_client_share <= 1:
            raise ConfigError(f"--log-client-share must be in (0, 1], got {self.log_client_share}")
        positive("--chunk-tokens", self.chunk_tokens)
        positive("--lease-ttl", self.lease_ttl_s)
        positive("--progress-deadline", self.progress_deadline_s)
        positive("--heartbeat-timeout", self.heartbeat_timeout_s)
        positive("--no-worker-deadline", self.no_worker_deadline_s)
        positive("--dispatch-timeout", self.dispatch_timeout_s)
        positive("--max-dispatch-attempts", self.max_dispatch_attempts)
        positive("--client-timeout", self.client_timeout_s)
        if self.handover_grace_s < 0:
            raise ConfigError(f"--handover-grace must be >= 0, got {self.handover_grace_s}")


def check_model_path(kind: str, model_path: Path | None) -> None:
    """A vLLM engine serves a model folder; the built-in engine takes none."""
    if kind == "vllm" and model_path is None:
        raise ConfigError("--engine vllm needs --model-path (a Hugging Face model folder)")
    if kind != "vllm" and model_path is not None:
        raise ConfigError(f"--model-path is for --engine vllm; the {kind} engine takes --model and --weights")
    if model_path is not None and not (model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {model_path} is not a model folder: it has no config.json")


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(ServiceConfig):
    engine_id: str = setting(help="engine this worker serves")
    # Which program serves the engine: one of the worker declaration's kinds (main() checks).
    kind: str = setting(
        "builtin", "the engine behind this worker: builtin (Belayer's own torch engine) or vllm"
    )
    preset: str = setting("tiny", "model size preset")
    model_path: Path | None = setting(None, "vllm: a Hugging Face model folder (belayer model make-tiny)")
    max_model_len: int = setting(1024, "vllm: the longest prompt plus generation, in tokens")
    vllm_kv_cache_gib: int = setting(1, "vllm: its KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE)")
    # Read by whoever starts the worker (belayer up, the shadow supervisor): vLLM and the trainer's
    # packages often cannot share one environment (verl and vLLM pin different transformers).
    engine_python: Path | None = setting(
        None, "the Python that runs the engine's workers (default: this one), e.g. a vLLM virtualenv's"
    )
    weights_seed: int = setting(0, "seed of the random weights")
    weights_path: Path | None = setting(None, "weights file (overrides --weights-seed)", flag="--weights")
    num_blocks: int = setting(512, "KV arena size in blocks")
    max_step_tokens: int = setting(128, "prefill chunk budget per step")
    heartbeat_interval_s: float = setting(0.2, "seconds between heartbeats")
    # Under a shadow supervisor: "main" serves, "shadow" pre-initialises and waits for a handover.
    role: Literal["standalone", "main", "shadow"] = setting("standalone", "standalone, or main/shadow")
    heartbeat_file: Path | None = setting(None, "file whose mtime the scheduling loop refreshes")
    shared_memory: bool = setting(False, "map weights and KV arena from the weight and KV servers")
    follow_versions: bool = setting(
        False, "without shared memory: still map the weight server's versions when it answers"
    )
    watch_pid: int = setting(0, "shadow: pid of the main it stands behind")
    watch_file: Path | None = setting(None, "shadow: the main's heartbeat file")
    hang_timeout_s: float = setting(2.0, "shadow: a main's heartbeat file older than this is a hang")

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("--num-blocks", self.num_blocks)
        positive("--max-step-tokens", self.max_step_tokens)
        positive("--heartbeat-interval", self.heartbeat_interval_s)
        if self.weights_path is not None and not self.weights_path.is_file():
            raise ConfigError(f"--weights {self.weights_path} is not a file")
        check_model_path(self.kind, self.model_path)
        positive("--max-model-len", self.max_model_len)
        positive("--vllm-kv-cache-gib", self.vllm_kv_cache_gib)
        if self.role == "shadow" and (self.watch_pid <= 0 or self.watch_file is None):
            raise ConfigError("--role shadow needs --watch-pid and --watch-file")
        positive("--hang-timeout", self.hang_timeout_s)


@dataclass(frozen=True, kw_only=True)
class ShadowSupervisorConfig(ServiceConfig):
    engines: tuple[str, ...] = setting(help="engine ids")
    state_dir: Path = setting(help="heartbeat files and worker logs")
    kind: str = same_as(WorkerConfig, "kind")
    preset: str = same_as(WorkerConfig, "preset")
    model_path: Path | None = same_as(WorkerConfig, "model_path")
    engine_python: Path | None = same_as(WorkerConfig, "engine_python")
    max_model_len: int = same_as(WorkerConfig, "max_model_len")
    vllm_kv_cache_gib: int = same_as(WorkerConfig, "vllm_kv_cache_gib")
    weights_seed: int = same_as(WorkerConfig, "weights_seed")
    num_blocks: int = same_as(WorkerConfig, "num_blocks")
    hang_timeout_s: float = same_as(WorkerConfig, "hang_timeout_s")
    engine_creds: Path | None = setting(
        None,
        "folder of engine-<id>.creds: each engine's workers connect with their own (needed with --nats-creds)",
    )
    failure_window_s: float = setting(
        60.0, "a worker failing this soon after it took over failed right after its handover (s)"
    )
    quarantine_after: int = setting(
        3,
        "failures in a row, each right after the worker took over, that quarantine an engine;"
        " never the last healthy one (0: never)",
    )
    death_timeout_s: float = setting(2.0, "how long a SIGKILLed main may take to be reaped (s)")
    start_timeout_s: float = setting(120.0, "how long a worker's start-up may take, cold path included (s)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.engines:
            raise ConfigError("--engines must name at least one engine")
        check_model_path(self.kind, self.model_path)
        if self.nats_creds is not None and self.engine_creds is None:
            # Its own credential would not let the workers publish their engine's chunks.
            raise ConfigError(
                "--nats-creds needs --engine-creds: each engine's workers connect with their own"
            )
        positive("--hang-timeout", self.hang_timeout_s)
        positive("--failure-window", self.failure_window_s)
        if self.quarantine_after < 0:
            raise ConfigError(f"--quarantine-after must be >= 0, got {self.quarantine_after}")
        positive("--death-timeout", self.death_timeout_s)
        positive("--start-timeout", self.start_timeout_s)


@dataclass(frozen=True, kw_only=True)
class SharedMemoryServerConfig(ServiceConfig):
    """What the weight and KV servers share: the prefix of their /dev/shm segments and the device."""

    shm_prefix: str = setting("belayer", "names of its /dev/shm segments start with <prefix>.")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "where its memory lives (auto: cuda if torch sees one)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not shm_prefix_ok(self.shm_prefix):
            raise ConfigError(f"--shm-prefix {self.shm_prefix!r} must match {SHM_PREFIX_PATTERN}")
        if self.device == "cuda" and not cuda_available():
            raise ConfigError("--device cuda: torch sees no CUDA device")


@dataclass(frozen=True, kw_only=True)
class WeightServerConfig(SharedMemoryServerConfig):
    preset: str = same_as(WorkerConfig, "preset")
    weights_seed: int = same_as(WorkerConfig, "weights_seed")
    weights_path: Path | None = same_as(WorkerConfig, "weights_path")
    sweep_interval_s: float = setting(1.0, "seconds between sweeps for the pins of dead holders")
    free_grace_s: float = setting(10.0, "seconds an unpinned version other than the newest is kept")
    # A main and its shadow, each holding the newest version, the one before it and a few that
    # requests named: a bound on what one engine (its credential) can keep from being freed.
    max_pins_per_engine: int = setting(16, "pins one engine's workers may hold at once, over all versions")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.preset not in PRESETS:  # the table of sizes, no torch
            raise ConfigError(f"--preset {self.preset!r} unknown; one of {list(PRESETS)}")
        if self.weights_path is not None and not self.weights_path.is_file():
            raise ConfigError(f"--weights {self.weights_path} is not a file")
        if not self.sweep_interval_s > 0:
            raise ConfigError(f"--sweep-interval must be > 0, got {self.sweep_interval_s}")
        if not self.free_grace_s >= 0:
            raise ConfigError(f"--free-grace must be >= 0, got {self.free_grace_s}")
        if self.max_pins_per_engine < 2:
            raise ConfigError(
                f"--max-pins-per-engine must be >= 2 (a main and its shadow), got {self.max_pins_per_engine}"
            )


@dataclass(frozen=True, kw_only=True)
class KvServerConfig(SharedMemoryServerConfig):
    max_arena_mb: int = setting(16 << 10, "the largest arena of one engine; bigger requests are refused")

    @property
    def max_arena_bytes(self) -> int:
        return self.max_arena_mb << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_arena_mb <= 0:
            raise ConfigError(f"--max-arena-mb must be > 0, got {self.max_arena_mb}")


# The phases of a full checkpoint, in order (services/checkpointer/checkpoint.py runs them); named
# here for --crash-at, the chaos flag that SIGKILLs the checkpointer when one is reached.
CHECKPOINT_PHASES = ("freeze", "archive", "dump", "unfreeze", "seal", "publish", "advance")


def hostname_id() -> str:
    """This machine's host name, made a valid host id."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return name[:64] or "host"


@dataclass(frozen=True, kw_only=True)
class CheckpointerConfig(ServiceConfig):
    drain_timeout_s: float = setting(30.0, "seconds a first SIGTERM gives running actions and checkpoints")
    host_id: str = setting("", "this Docker host's id (default: the host name)")
    state_dir: Path | None = setting(None, "records and checkpoints (default: <belayer state>/checkpointer)")
    docker_url: str | None = setting(
        None, "Docker Engine URL (default: $DOCKER_HOST or the local socket)", flag="--docker"
    )
    docker_timeout_s: float = setting(
        30.0, "a Docker call unanswered for this long fails (a dump or restore gets 600 s)"
    )
    disk_budget_gb: float = setting(
        50.0, "checkpoint store bound; oldest non-latest go first past it; 0: none"
    )
    dump_stall_s: float = setting(
        20.0, "a CRIU dump whose files stop growing for this long is killed, and its checkpoint fails"
    )
    max_layer_gb: float = setting(16.0, "a layer archive holding more is refused at restore")
    max_download_gb: float = setting(
        20.0, "a checkpoint fetched from the object store may be this big, at most"
    )
    checkpoint_key: Path | None = setting(
        None,
        "file holding the hex key that signs checkpoint manifests; checkpointers that restore each"
        " other's checkpoints need the same one (default: <state-dir>/checkpoint.key, made on first start)",
        env=CHECKPOINT_KEY_ENV,
    )
    crash_at: str = setting(
        "",
        "chaos: SIGKILL this process when a checkpoint reaches this phase",
        choices=("", *CHECKPOINT_PHASES),
    )
    debug_older_environment: bool = setting(
        False,
        "DEBUG, never in use: a restore gives the environment of the checkpoint before the one it"
        " restores, with that one's context (the training oracle's mutation check)",
    )
    object_store: bool = setting(False, "upload checkpoints to JetStream for restores on other hosts")
    replicas: int = same_as(RouterConfig, "replicas")
    allow_network: bool = setting(False, "let a sandbox ask for a network (`network: true`)")
    allow_root_user: bool = setting(
        False, "let a sandbox ask to run as root (`user: root` or uid 0)", env="BELAYER_ALLOW_ROOT_USER"
    )
    max_sandboxes: int = setting(64, "sandboxes this host runs at once, at most")
    sandbox_memory_mb: int = setting(0, "the most memory one sandbox may ask for (0: the host's memory)")
    sandbox_cpus: float = setting(0.0, "the most CPUs one sandbox may ask for (0: the host's CPUs)")
    sandbox_pids: int = setting(4096, "the most processes one sandbox may ask for (its `pids_limit`)")

    @property
    def state(self) -> Path:
        """`state_dir`, which the config resolves when it is built (its default included)."""
        if self.state_dir is None:
            raise RuntimeError("CheckpointerConfig.state_dir is resolved in __post_init__")
        return self.state_dir

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.host_id:
            object.__setattr__(self, "host_id", hostname_id())
        state_dir = self.state_dir if self.state_dir is not None else default_state_dir() / "checkpointer"
        object.__setattr__(self, "state_dir", Path(state_dir).resolve())
        positive("--docker-timeout", self.docker_timeout_s)
        positive("--dump-stall", self.dump_stall_s)
        if self.max_layer_gb <= 0 or self.max_download_gb <= 0:
            raise ConfigError("--max-layer-gb and --max-download-gb must be > 0")
        if not self.host_id.replace("-", "").replace("_", "").isalnum() or len(self.host_id) > 64:
            raise ConfigError(f"--host-id must be 1-64 of [A-Za-z0-9_-], got {self.host_id!r}")
        positive("--replicas", self.replicas)
        if self.disk_budget_gb < 0:
            raise ConfigError(f"--disk-budget-gb must be >= 0, got {self.disk_budget_gb}")
        positive("--max-sandboxes", self.max_sandboxes)
        positive("--sandbox-pids", self.sandbox_pids)
        if self.sandbox_memory_mb < 0 or self.sandbox_cpus < 0:
            raise ConfigError("--sandbox-memory-mb and --sandbox-cpus must be >= 0")
        if self.crash_at and self.crash_at not in CHECKPOINT_PHASES:
            raise ConfigError(
                f"--crash-at must be one of {', '.join(CHECKPOINT_PHASES)}, got {self.crash_at!r}"
            )


@dataclass(frozen=True, kw_only=True)
class PolicyConfig(ServiceConfig):
    """The policy service (services/policy); the numbers are services/policy/decision.py's."""

    policy: str = setting(
        "adaptive", "the policy of a request that names none: adaptive, never, always, every-N"
    )
    failure_rate: float | None = setting(
        None, "failures per second of environment time, replacing the online estimate (default: estimated)"
    )
    prior_failures: float = setting(1.0, "the failure-rate prior: as if this many failures were seen...")
    prior_seconds: float = setting(600.0, "...in this many seconds of environment time")
    response_times: Path | None = setting(None, "seed the LLM response times from this file of earlier runs")
    response_window: int = setting(512, "LLM response times kept (the oldest drop out)")
    min_samples: int = setting(3, "response times needed before the distribution is used")
    initial_cost_s: float = setting(1.0, "the checkpoint cost assumed before any checkpoint was measured")
    contention: float | None = setting(
        None, "K, LLM seconds lost per second a checkpoint runs, replacing the online estimate"
    )
    contention_prior: float = setting(0.0, "K assumed until the responses show a slowdown beside checkpoints")
    min_step: int = setting(3, "adaptive: no checkpoint before this step")
    min_env_work_s: float = setting(0.05, "adaptive: no checkpoint with less environment work since the last")
    cooldown_s: float = setting(
        20.0, "after a checkpoint timeout, the host's checkpoints are refused this long"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not re.fullmatch(POLICY_PATTERN, self.policy, flags=re.ASCII):
            raise ConfigError(
                f"--policy must be adaptive, never, always or every-N (1 <= N < 10^6), got {self.policy!r}"
            )
        if self.failure_rate is not None and not self.failure_rate >= 0:
            raise ConfigError(f"--failure-rate must be >= 0, got {self.failure_rate}")
        if self.contention is not None and not self.contention >= 0:
            raise ConfigError(f"--contention must be >= 0, got {self.contention}")
        positive("--prior-seconds", self.prior_seconds)
        if not self.prior_failures >= 0:
            raise ConfigError(f"--prior-failures must be >= 0, got {self.prior_failures}")
        for flag, value in (("--response-window", self.response_window), ("--min-samples", self.min_samples)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        for flag, number in (
            ("--initial-cost", self.initial_cost_s),
            ("--contention-prior", self.contention_prior),
            ("--min-env-work", self.min_env_work_s),
            ("--cooldown", self.cooldown_s),
        ):
            if not number >= 0:
                raise ConfigError(f"{flag} must be >= 0, got {number}")
        if self.response_times is not None and not Path(self.response_times).is_file():
            raise ConfigError(f"--response-times: no file {self.response_times}")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(ServiceConfig):
    """The HTTP gateway (services/gateway): OpenAI- and SGLang-shaped endpoints over the router."""

    http_host: str = setting("127.0.0.1", "address the HTTP API listens on")
    http_port: int = setting(8000, "port of the HTTP API (0: a free one, printed when it serves)")
    api_keys: Path | None = setting(
        None, "the API keys' digests, api-keys.json (`belayer creds` writes it); required"
    )
    model_name: str = setting("belayer", "the model's name in the API: a request naming another gets a 404")
    preset: str = same_as(WorkerConfig, "preset")  # its context bounds a prompt with its max_tokens
    max_concurrent: int = setting(64, "requests one API key may have running at once (past it: 429)")
    max_body_kb: int = setting(1024, "the largest request body taken, in KiB (past it: 413)")
    stream_patience_s: float = setting(
        30.0, "how long a request waits for a router that does not answer (a failover) before it fails"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_keys is None:
            raise ConfigError(
                "--api-keys names the file of API key digests (`belayer creds` writes api-keys.json)"
            )
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"--http-port must be a port or 0, got {self.http_port}")
        if self.preset not in PRESETS:
            raise ConfigError(f"--preset {self.preset!r} unknown; one of {list(PRESETS)}")
        for flag, value in (("--max-concurrent", self.max_concurrent), ("--max-body-kb", self.max_body_kb)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        positive("--stream-patience", self.stream_patience_s)


@dataclass(frozen=True, kw_only=True)
class TrainerGroupConfig(ServiceConfig):
    """One worker of a trainer group (services/trainer_group), started by the trainer's fault
    manager: rank `rank` of `world` in a gloo process group formed through `rendezvous`."""

    run: str = setting("train", "the training run (prefixes the group's subjects)")
    group: Literal["actor", "reference", "reward"] = setting("actor", "actor, reference or reward")
    rank: int = setting(0, "this worker's rank")
    world: int = setting(1, "ranks in the group")
    rendezvous: Path | None = setting(None, "a file the ranks form their gloo process group through")
    state_file: Path | None = setting(None, "the group's state (rank 0 writes it after every step)")
    preset: str = setting("tiny", "model size")
    seed: int = setting(0, "the run's seed: initial weights when there is no state file yet")
    lr: float = setting(3e-3, "AdamW learning rate")
    ppo_epochs: int = setting(2, "optimizer passes over each batch")
    eps_low: float = setting(0.2, "the clip's lower epsilon")
    eps_high: float = setting(0.28, "the clip's upper epsilon")
    kl_beta: float = setting(0.0, "weight of the k3 KL to the reference policy (the initial one)")
    workload: str = setting("reverse", "the reward group's workload")
    length: int = setting(2, "the reward group's workload option: digits per prompt")
    allowed: str = setting(
        "",
        "the token sets the policy's turns draw from: ids split by commas, sets by semicolons (empty: any)",
    )
    threads: int = setting(1, "torch threads (pinned, so that updates repeat bit for bit)")
    heartbeat_s: float = setting(0.5, "seconds between group_heartbeat events")
    init_timeout_s: float = setting(60.0, "seconds to wait for the other ranks to join")
    step_delay_s: float = setting(0.0, "tests: seconds each forward/backward pass is made to last")
    fault_points: str = setting(
        "",
        "chaos: GROUP:RANK:STEP:POINT:ACTION,... where a rank signals itself, once (services/trainer/group_faults.py)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", self.run):
            raise ConfigError(f"--run must match [A-Za-z0-9_-]{{1,40}}, got {self.run!r}")
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"--rank must be in [0, --world), got {self.rank} of {self.world}")
        if self.preset not in PRESETS:
            raise ConfigError(f"--preset {self.preset!r} unknown; one of {list(PRESETS)}")
        if self.world > 1 and self.rendezvous is None:
            raise ConfigError("--world > 1 needs --rendezvous")
        positive("--heartbeat", self.heartbeat_s)
        positive("--init-timeout", self.init_timeout_s)
        if self.threads < 1 or self.ppo_epochs < 1 or self.lr < 0:
            raise ConfigError("--threads and --ppo-epochs must be >= 1 and --lr >= 0")
        for entry in filter(None, self.fault_points.split(",")):
            if not re.fullmatch(r"(actor|reference|reward):\d+:\d+:[a-z-]+:(kill|stop)", entry):
                raise ConfigError(f"--fault-points: {entry!r} is not GROUP:RANK:STEP:POINT:kill|stop")

    @property
    def allowed_sets(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(t) for t in part.split(",")) for part in self.allowed.split(";") if part)

    @staticmethod
    def allowed_of(sets: tuple[tuple[int, ...], ...]) -> str:
        """`allowed` for these sets."""
        return ";".join(",".join(map(str, allowed)) for allowed in sets)
