"""`python -m belayer_rl.services.policy`: the checkpoint policy of one cluster, until SIGTERM/SIGINT.

The wiring is in services/policy/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.policy.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import PolicyConfig, parse_flags


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        PolicyConfig, argv, prog="belayer-policy", description="Run the checkpoint policy service."
    )
    runtime.run("policy", settings, setup)


if __name__ == "__main__":
    main()
