"""`python -m belayer_rl.services.trainer_group`: one worker of a trainer group, until SIGTERM/SIGINT or the fault
manager's SIGKILL.

What it is, listens to and publishes is in declaration.py; its wiring in service.py.
"""

from __future__ import annotations

from belayer_rl.services.trainer_group.declaration import TRAINER_GROUP
from belayer_rl.shared.declaration import main

if __name__ == "__main__":
    main(TRAINER_GROUP)
