"""A typed client of one checkpointer (one Docker host): what the rollout driver, the CLI, the
bench and the tests call. Each call is one request on `belayer.<cluster>.sandbox.<host>.<verb>.<client>`; failures
arrive as ServiceError with the checkpointer's code ("env-failure", "wrong-step", ...)."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from belayer_rl.shared import bus
from belayer_rl.shared.protocol import (
    Ack,
    CheckpointResult,
    ExecResult,
    RestoreResult,
    SandboxCheckpoint,
    SandboxCreate,
    SandboxDestroy,
    SandboxExec,
    SandboxInfo,
    SandboxList,
    SandboxListing,
    SandboxRestore,
    SandboxSpec,
    TrajectoryEnd,
)
from belayer_rl.shared.subjects import Subjects

RPC_SLACK_S = 10.0  # on top of the operation's own timeout


def container_name(host_id: str, sandbox: str) -> str:
    """The Docker container of a sandbox on a host: what an operator, or a fault injector, looks for."""
    return f"belayer-{host_id}-{sandbox}"


class SandboxClient:
    def __init__(
        self, nc: NATS, host_id: str, *, subjects: Subjects = Subjects(), client: str = "cli"
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.host_id = host_id
        self.client = client  # who it is (Access.client): the sandboxes it makes are its own

    def _subject(self, verb: str) -> str:
        return self.subjects.sandbox_rpc(self.host_id, verb, self.client)

    async def create(self, spec: SandboxSpec, sandbox: str = "", timeout_s: float = 60.0) -> SandboxInfo:
        return await bus.request_struct(
            self.nc,
            self._subject("create"),
            SandboxCreate(spec=spec, sandbox=sandbox),
            SandboxInfo,
            timeout_s,
        )

    async def exec(
        self, sandbox: str, command: str, timeout_s: float = 60.0, expect_step: int | None = None
    ) -> ExecResult:
        request = SandboxExec(sandbox=sandbox, command=command, timeout_s=timeout_s, expect_step=expect_step)
        return await bus.request_struct(
            self.nc, self._subject("exec"), request, ExecResult, timeout_s + RPC_SLACK_S + 10.0
        )

    async def checkpoint(
        self,
        sandbox: str,
        trajectory: str,
        k: int,
        context_tokens: list[int] | None = None,
        context_ref: str = "",
        timeout_s: float = 120.0,
    ) -> CheckpointResult:
        request = SandboxCheckpoint(
            sandbox=sandbox,
            trajectory=trajectory,
            k=k,
            context_tokens=context_tokens or [],
            context_ref=context_ref,
            timeout_s=timeout_s,
        )
        return await bus.request_struct(
            self.nc, self._subject("checkpoint"), request, CheckpointResult, timeout_s + RPC_SLACK_S
        )

    async def restore(self, trajectory: str, timeout_s: float = 300.0) -> RestoreResult:
        request = SandboxRestore(trajectory=trajectory, timeout_s=timeout_s)
        return await bus.request_struct(
            self.nc, self._subject("restore"), request, RestoreResult, timeout_s + RPC_SLACK_S
        )

    async def destroy(self, sandbox: str, timeout_s: float = 60.0) -> Ack:
        return await bus.request(
            self.nc, self._subject("destroy"), SandboxDestroy(sandbox=sandbox), timeout_s
        )

    async def list(self, timeout_s: float = 10.0) -> SandboxListing:
        return await bus.request_struct(
            self.nc, self._subject("list"), SandboxList(), SandboxListing, timeout_s
        )

    async def end(self, trajectory: str, timeout_s: float = 60.0) -> Ack:
        return await bus.request(
            self.nc, self._subject("end"), TrajectoryEnd(trajectory=trajectory), timeout_s
        )
