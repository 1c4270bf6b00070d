"""The rollout engines as the fault manager sees them: one more group it can rebuild.

The rollout side heals most of its own faults without the trainer: a shadow takes over a dead or
hung main, and the router resumes the interrupted requests token-exact. What it cannot heal
alone is a fault its supervisor never sees, such as a main and its shadow both stopped: the
trainer then sees no generation finish for `rollout_timeout_s`, or the router's errors. Its
rebuild (`rollout_max_rebuild_times` per workflow):

1. asks the shadow supervisor of every engine the router knows to restart it by the cold path
   (main and shadow killed and confirmed dead, a worker from scratch, a new shadow behind it); an
   engine that is quarantined stays out, and when none restarts the rebuild fails;
2. re-syncs the weight versions the step generates on: the trainer publishes them again, so a
   weight server that restarted and lost them has them back;
3. then the fault manager runs the rollout again. Its requests keep their ids, so those the router
   still holds are followed to their end rather than generated twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from belayer_rl.services.trainer.fault_manager import GroupFault
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import EngineRestart, EngineRestarted

log = logging.getLogger("belayer.trainer.rollout")

RESTART_TIMEOUT_S = 180.0  # a cold worker loads its weights and builds its arena from scratch
ROUTER_SEES_S = 30.0


class RolloutSide:
    name: Literal["rollout"] = "rollout"

    def __init__(self, client: Client, resync: Callable[[], Awaitable[None]]) -> None:
        self.client = client
        self.resync = resync  # publishes again the versions the step in hand generates on
        self.rebuilds = 0
        self.restarted: list[EngineRestarted] = []  # the latest rebuild's restarts

    async def stop(self) -> None:
        """Nothing: the supervisors kill the old workers as part of the restart (in `start`)."""

    async def start(self) -> None:
        started = time.monotonic()
        try:
            status = await self.client.status()
        except bus.ServiceError as exc:
            raise GroupFault("start", -1, f"the router did not answer: {exc}") from exc
        self.restarted = []
        refused: list[str] = []
        for engine in status.engines:
            ask = EngineRestart(reason="the trainer's rollout rebuild")
            subject = self.client.subjects.engine_restart(engine.engine_id)
            try:
                done = await bus.request_struct(
                    self.client.nc, subject, ask, EngineRestarted, RESTART_TIMEOUT_S
                )
            except bus.ServiceError as exc:
                refused.append(f"{engine.engine_id}: {exc}")
                continue
            self.restarted.append(done)
            log.info("engine %s restarted (pid %d -> %d, epoch %d) in %.2f s",
                     done.engine_id, done.old_pid, done.new_pid, done.epoch, done.took_s)  # fmt: skip
        if not self.restarted:
            raise GroupFault("start", -1, "no engine restarted: " + ("; ".join(refused) or "no engines"))
        if refused:
            log.warning("engines not restarted: %s", "; ".join(refused))
        try:  # the router sees the new epochs from the registry
            await self.client.wait_for_engines(len(self.restarted), ROUTER_SEES_S)
        except TimeoutError as exc:
            raise GroupFault("start", -1, f"after the restart: {exc}") from exc
        try:
            await self.resync()
        except (bus.ServiceError, RuntimeError) as exc:  # the weight server down, say
            raise GroupFault("start", -1, f"re-syncing the weights: {exc}") from exc
        log.info("rollout side rebuilt in %.2f s", time.monotonic() - started)
