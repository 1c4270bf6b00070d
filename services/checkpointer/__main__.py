"""`python -m belayer_rl.services.checkpointer`: the checkpointer of one Docker host, until SIGTERM/SIGINT.

The wiring is in services/checkpointer/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.checkpointer.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import CheckpointerConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        CheckpointerConfig,
        argv,
        prog="belayer-checkpointer",
        description="Run the checkpointer of one Docker host.",
    )
    host = settings.host_id
    runtime.run(f"checkpointer-{host}", settings, setup, stats_key=f"checkpointer.{host}")


if __name__ == "__main__":
    main()
