"""`python -m belayer_rl.services.weight_server`: the weight server of this host, until SIGTERM/SIGINT.

The wiring is in services/weight_server/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.weight_server.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import WeightServerConfig, parse_flags
from belayer_rl.shared.segments import PrefixBusy


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        WeightServerConfig,
        argv,
        prog="belayer-weight-server",
        description="Own this host's model weights in shared memory.",
    )
    runtime.run("weight-server", settings, setup, exits_on=(PrefixBusy,))


if __name__ == "__main__":
    main()
