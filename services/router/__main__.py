"""`python -m belayer_rl.services.router`: the router, until SIGTERM/SIGINT.

The wiring is in services/router/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.router.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import RouterConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(RouterConfig, argv, prog="belayer-router", description="Run the Belayer router.")
    runtime.run("router", settings, setup)


if __name__ == "__main__":
    main()
