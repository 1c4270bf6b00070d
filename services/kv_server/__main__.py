"""`python -m belayer_rl.services.kv_server`: the kv-server of this host, until SIGTERM/SIGINT.

The wiring is in services/kv_server/service.py; this file names the service and its config.
"""

from __future__ import annotations

from belayer_rl.services.kv_server.service import setup
from belayer_rl.shared import runtime
from belayer_rl.shared.config import KvServerConfig, parse_flags
from belayer_rl.shared.segments import PrefixBusy


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        KvServerConfig,
        argv,
        prog="belayer-kv-server",
        description="Own this host's KV-cache arenas in shared memory.",
    )
    runtime.run("kv-server", settings, setup, exits_on=(PrefixBusy,))


if __name__ == "__main__":
    main()
