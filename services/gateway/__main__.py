"""`python -m belayer_rl.services.gateway`: the HTTP gateway of one cluster, until SIGTERM/SIGINT.

What it is, listens to and publishes is in declaration.py; its wiring in service.py.
"""

from __future__ import annotations

from belayer_rl.services.gateway.declaration import GATEWAY
from belayer_rl.shared.declaration import main

if __name__ == "__main__":
    main(GATEWAY)
