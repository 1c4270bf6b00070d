"""`python -m belayer_rl.services.worker`: one rollout worker, until SIGTERM/SIGINT.

The wiring is in services/worker/service.py; this file names the service and its config.
"""

from __future__ import annotations

import os

from belayer_rl.services.worker.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import WorkerConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(WorkerConfig, argv, prog="belayer-worker", description="Run one rollout worker.")
    # Named by engine and pid: an engine's main and its shadow run side by side. The stats subject
    # carries the engine as a token of its own: the engine's credential answers only its own.
    name = f"worker-{settings.engine_id}-{os.getpid()}"
    stats_key = f"worker.{settings.engine_id}.{os.getpid()}"
    runtime.run(name, settings, setup, signals_during_setup=False, stats_key=stats_key)


if __name__ == "__main__":
    main()
