"""`python -m belayer_rl.services.trainer_group`: one worker of a trainer group, until SIGTERM/SIGINT
or the fault manager's SIGKILL. The wiring is in services/trainer_group/service.py."""

from __future__ import annotations

from belayer_rl.services.trainer_group.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import TrainerGroupConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        TrainerGroupConfig, argv, prog="belayer-trainer-group", description="Run one trainer group worker."
    )
    group, rank = settings.group, settings.rank
    runtime.run(f"trainer-{group}-{rank}", settings, setup, stats_key=f"trainer.{group}.{rank}")


if __name__ == "__main__":
    main()
