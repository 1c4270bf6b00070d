"""`python -m belayer_rl.services.shadow_supervisor`: the shadow supervisor, until SIGTERM/SIGINT.

The wiring is in services/shadow_supervisor/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.shadow_supervisor.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import ShadowSupervisorConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        ShadowSupervisorConfig,
        argv,
        prog="belayer-shadow-supervisor",
        description="Run each engine's main worker and its idle shadow; hand over on a failure.",
    )
    runtime.run("shadow-supervisor", settings, setup)


if __name__ == "__main__":
    main()
