"""`python -m belayer_rl.services.shadow_supervisor`: the shadow supervisor, until SIGTERM/SIGINT.

What it is, listens to and publishes is in declaration.py; its wiring in service.py.
"""

from __future__ import annotations

from belayer_rl.services.shadow_supervisor.declaration import SHADOW_SUPERVISOR
from belayer_rl.shared.declaration import main

if __name__ == "__main__":
    main(SHADOW_SUPERVISOR)
