"""What the checkpointer keeps of one sandbox: its record, written to `<state>/sandboxes/<id>.json`
and, as the base a restore from the image starts with, to `<state>/checkpoints/<trajectory>/trajectory.json`.

Below both the checkpointer and its procedures (checkpoint.py, restore.py): they read and update a
record, the checkpointer owns where it is written and when. Knows nothing about Docker or NATS.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from belayer_rl.shared.protocol import SandboxSpec


class SandboxRecord(msgspec.Struct, kw_only=True):
    """What survives a restart of the checkpointer. Mutable: the sandbox's FIFO serialises every
    change, and a phase that fails halfway must leave what it did so far (a new container) known."""

    sandbox: str
    spec: SandboxSpec
    container_id: str
    image_id: str
    step: int = 0
    state: Literal["running", "failed", "destroyed"] = "running"
    trajectory: str = ""
    incarnation: int = -1  # -1: not yet bound to a trajectory
    oom_seen: int = 0
    # Written before an action starts and cleared once it is counted: a restart that finds it set
    # cannot know whether the action ran, so the sandbox is failed rather than given it twice.
    acting: bool = False
    failure: str = ""  # why it is "failed", for the errors that refuse it
    # The client that made it (the last token of its create's subject): only that client may act
    # on it or its trajectory. "" for one made before sandboxes had owners: anyone's.
    owner: str = ""
