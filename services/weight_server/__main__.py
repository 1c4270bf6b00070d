"""`python -m belayer_rl.services.weight_server`: the weight server of this host, until SIGTERM/SIGINT.

What it is, listens to and publishes is in declaration.py; its wiring in service.py.
"""

from __future__ import annotations

from belayer_rl.services.weight_server.declaration import WEIGHT_SERVER
from belayer_rl.shared.declaration import main

if __name__ == "__main__":
    main(WEIGHT_SERVER)
