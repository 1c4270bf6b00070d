"""The chaos campaign's settings (`belayer chaos` flags) and the kinds of fault it injects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from belayer_rl.shared import config as flags
from belayer_rl.shared.config import positive, setting

FAULT_KINDS = (
    "worker-kill",
    "worker-stop",
    "router-kill",
    "router-stop",
    "service-kill",
    "nats-restart",
    "container-kill",
    "container-pause",
    "store-full",
    "dockerd-restart",
)


@dataclass(frozen=True)
class ChaosConfig:
    state_dir: Path | None = setting(
        None,
        "the campaign cluster's state (default: a temporary folder, removed after)",
        flag="--campaign-dir",
    )
    faults: int = setting(200, "faults to inject")
    seed: int = setting(0, "fixes the kinds of the faults and when they come")
    interval_s: float = setting(1.0, "mean seconds between faults")
    kinds: tuple[str, ...] = setting(FAULT_KINDS, "fault kinds, comma-separated", flag="--kinds")
    engines: int = setting(2, "rollout workers")
    generators: int = setting(4, "generations kept running at once")
    trajectories: int = setting(2, "sandbox trajectories kept running at once")
    steps: int = setting(6, "actions per trajectory")
    max_tokens: int = setting(300, "tokens per generation")
    nats_restarts: int = setting(5, "most nats-server restarts in the campaign")
    dockerd_restarts: int = setting(5, "most restarts of the campaign's own dockerd")
    min_completion: float = setting(0.95, "share of generations and of trajectories that must complete")
    engine: str = setting("builtin", "the engines' kind: builtin, or vllm (with --model-path)")
    model_path: Path | None = setting(None, "vllm: the model folder the engines serve")
    engine_python: Path | None = setting(None, "vllm: the Python of vLLM's virtualenv")
    debug_accept_stale: bool = setting(
        False, "DEBUG: the router accepts stale attempts; the oracle must then report violations"
    )
    json: bool = setting(False, "print the summary as one JSON object")

    def __post_init__(self) -> None:
        positive("--interval", self.interval_s)
        flags.check_model_path(self.engine, self.model_path)
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
        if unknown or not self.kinds:
            raise flags.ConfigError(f"--kinds: unknown {unknown}; choose from {', '.join(FAULT_KINDS)}")
