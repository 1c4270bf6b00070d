"""The policy service as it runs: its own process, a real nats-server with credentials, the rollout
side's credential (cli) asking and reporting, the checkpointer's publishing checkpoint costs.

It learns λ from env steps, T from LLM responses and c from checkpoint_ready events, and its
answers change with them; every answer is also a policy_decision event; a checkpoint timeout
makes its host answer busy for the cooldown, and only that host; bad input gets bad-request and
the service keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, local_cluster
from belayer_rl.services.policy.client import PolicyClient
from belayer_rl.shared import bus, protocol
from belayer_rl.shared import config as flags
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import PolicyConfig
from belayer_rl.shared.processes import stop_process
from belayer_rl.shared.protocol import (
    CheckpointReady,
    CheckpointTimeout,
    EnvStep,
    LlmResponse,
    PolicyDecide,
    PolicyDecision,
)
from tests.support import poll

COOLDOWN_S = 1.5


@contextlib.asynccontextmanager
async def policy_service(tmp_path: Path) -> AsyncIterator[Supervisor]:
    config = ClusterConfig(state_dir=tmp_path / "state", engines=0, shadows=False, sandboxes=False)
    async with local_cluster(config) as supervisor:
        policy = PolicyConfig(**supervisor.bus("policy"), cooldown_s=COOLDOWN_S, metrics_port=-1)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "belayer_rl.services.policy", *flags.to_argv(policy)
        )
        try:
            yield supervisor
        finally:
            await stop_process(process)


def ask(host: str = "h1", **fields: object) -> PolicyDecide:
    values: dict[str, object] = {
        "trajectory": "t1",
        "host_id": host,
        "step": 5,
        "step_duration_s": 1.0,
        "exposure_s": 30.0,
        "env_work_s": 5.0,
        "elapsed_s": 0.0,
    }
    values.update(fields)
    return PolicyDecide(**values)  # type: ignore[arg-type]


async def test_learns_answers_publishes_and_cools_down(tmp_path: Path) -> None:
    async with policy_service(tmp_path) as supervisor:
        rollout = await supervisor.target("cli").connect("rollout-side")
        checkpointer = await supervisor.target("checkpointer").connect("checkpointer")
        policy = PolicyClient(rollout, subjects=supervisor.subjects, timeout_s=5.0)
        decisions: list[PolicyDecision] = []
        await bus.listen(
            rollout, supervisor.subjects.event("policy_decision", "*"), PolicyDecision, _append(decisions)
        )

        async def serving() -> PolicyDecision | None:
            with contextlib.suppress(ServiceError):
                return await policy.decide(ask())
            return None

        first = await poll(serving, timeout_s=60, every_s=0.2)
        # The prior alone (1 failure in 600 s) against the initial cost of 1 s, no response samples.
        assert first.rate_per_s == pytest.approx(1 / 600)
        assert first.samples == 0 and first.cost_s == 1.0 and first.expected_visible_cost_s == 1.0
        assert not first.checkpoint and "no sample beyond x" in first.reason

        for i in range(20):
            await policy.report_step(
                EnvStep(trajectory="t1", host_id="h1", step=i, duration_s=1.0, failed=True)
            )
        for seconds in (5.0, 6.0, 7.0):
            await policy.report_response(LlmResponse(trajectory="t1", seconds=seconds, tokens=100))
        for _ in range(3):
            ready = CheckpointReady(
                trajectory="t1",
                sandbox="s1",
                host_id="h1",
                checkpoint_id="c",
                incarnation=0,
                k=3,
                context_digest="sha256:" + "0" * 64,
                bytes_written=1,
                freeze_s=0.1,
                total_s=0.5,
            )
            await bus.publish(checkpointer, supervisor.subjects.event("checkpoint_ready", "t1"), ready)
        await rollout.flush()
        await checkpointer.flush()

        # The service reads its events in its own time: wait until it has counted every one of them
        # (the prior's failure and the 20 reported, over its 600 s and their 20 s), not merely past a
        # threshold, so a half-read stream of steps is never taken for the answer.
        def counted(answer: PolicyDecision) -> bool:
            return (
                answer.samples == 3 and answer.cost_s == 0.5 and answer.rate_per_s == pytest.approx(21 / 620)
            )

        answers: list[PolicyDecision] = []

        async def learnt() -> PolicyDecision | None:
            answers.append(await policy.decide(ask()))
            return answers[-1] if counted(answers[-1]) else None

        try:
            informed = await poll(learnt, timeout_s=30, every_s=0.1)
        except TimeoutError:
            pytest.fail(f"the service never counted every event; its last answer: {answers[-1]}")
        # Every response outlasts a 0.5-s checkpoint started at x = 0: nothing of it is visible.
        assert informed.expected_visible_cost_s == 0.0 and informed.checkpoint, informed.reason
        # C: the 30 s of work the driver reports, and the response running since x = 0, expected to
        # take the mean of 5, 6 and 7 s.
        assert informed.exposure_s == 36.0 and informed.benefit_s == pytest.approx(informed.p * 36.0)

        # A timeout on h1: h1 is busy for the cooldown, h2 is not, and h1 serves again after it.
        await policy.report_timeout(CheckpointTimeout(trajectory="t1", host_id="h1", k=5, waited_s=30.0))
        await rollout.flush()

        async def busy() -> PolicyDecision | None:
            answer = await policy.decide(ask("h1"))
            return answer if answer.busy_s > 0 else None

        refused = await poll(busy, timeout_s=10, every_s=0.05)
        assert (
            not refused.checkpoint and 0 < refused.busy_s <= COOLDOWN_S and refused.reason.startswith("busy")
        )
        assert (await policy.decide(ask("h2"))).checkpoint
        await asyncio.sleep(COOLDOWN_S)
        assert (await policy.decide(ask("h1"))).checkpoint

        # Bad input: a clear error, and the service goes on answering.
        for raw in (
            b"{",
            b'{"type": "policy_decide", "trajectory": 5}',
            b"[" * 100_000,
        ):
            reply = await rollout.request(supervisor.subjects.policy_decide, raw, timeout=5)
            error = msgspec.json.decode(reply.data, type=protocol.ErrorReply)
            assert error.code == "bad-request", error
        await rollout.publish(
            supervisor.subjects.event("env_step", "t1"), b'{"type": "env_step", "duration_s": -1}'
        )
        with pytest.raises(ServiceError) as refused_policy:
            await policy.decide(ask(policy="every-0"))
        assert refused_policy.value.code == "bad-request"
        assert (await policy.decide(ask(policy="never"))).reason == "policy never"

        # Every answer was published, with its inputs.
        async def all_published() -> list[PolicyDecision] | None:
            return decisions if len(decisions) >= 6 else None

        await poll(all_published, timeout_s=10)
        assert any(d.checkpoint and d.samples == 3 and d.exposure_s == 36.0 for d in decisions)
        await rollout.close()
        await checkpointer.close()


def _append(into: list[PolicyDecision]):  # type: ignore[no-untyped-def]
    async def handler(message: PolicyDecision) -> None:
        into.append(message)

    return handler
