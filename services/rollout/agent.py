"""The agent loop of one trajectory: LLM turns through the router, actions in the trajectory's
sandbox through its checkpointer, checkpoints decided by the policy service, and recovery from
environment failures. `Trajectory(...).run()` is the API a verl or slime rollout function calls
(examples/), and what `belayer rollout` runs for each trajectory of a batch (driver.py).

A step: the LLM generates a response to the context (prompt + responses + observations so far);
an action is chosen from it; the action runs in the sandbox; its observation is appended. While
the response is generated, the policy is asked (at once, then every --consult-every seconds)
whether to checkpoint the boundary the sandbox stands at: k actions completed, the context L_k
being exactly the prompt of the response in flight. So a checkpoint overlaps the response, and
only the part of it that outlasts the response is visible (measured as `exposed_checkpoint_s`).

An environment failure (the checkpointer's "env-failure": a dead container, an OOM kill, a daemon
error, a broken exec stream) is never an observation: nothing of it reaches the context. Recovery
restores the latest ready checkpoint (full_restore), cuts the context back to its L_k and goes on
from step k; the turn after k draws the same seed, so a deterministic environment and engine give
the same trajectory as a failure-free run. The response to L_k itself is not generated again: it
was generated from that exact context and saw nothing of the steps that failed after it, so the
recovery keeps it (KeptResponse) and redoes only the work after it. Without a checkpoint the
sandbox restarts from its base image and the trajectory from its prompt. Recoveries and
infrastructure retries are bounded; past a bound the trajectory ends as an infrastructure error
naming the cause, never as a normal finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.policy.client import PolicyClient
from belayer_rl.services.policy.decision import Policy, ResponseTimes, decide
from belayer_rl.services.policy.wire import decision_message, situation_of
from belayer_rl.services.rollout.local_sandbox import LocalSandboxes
from belayer_rl.services.rollout.workloads import (
    OBSERVATION_LIMIT,
    Choice,
    Task,
    check_score,
    choose_action,
    math_reward,
    observation,
    response_tokens,
    seen_output,
    turn_seed,
)
from belayer_rl.shared import bus, tokenizer
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.config import ConfigError, positive, setting
from belayer_rl.shared.protocol import (
    CheckpointResult,
    CheckpointTimeout,
    EnvStep,
    ExecResult,
    LlmResponse,
    PolicyDecide,
    PolicyDecision,
    PolicyFallback,
    SandboxSpec,
)
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.rollout")

ENV_FAILURES = ("env-failure", "destroyed", "no-sandbox")  # the sandbox is gone: recover it
# After the policy service failed to answer, the fallback decides at once for this long: waiting
# out its timeout at every consult would let most responses end before any decision came.
POLICY_RETRY_S = 5.0
Status = Literal["done", "infra-error"]


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """How each trajectory runs; `belayer rollout` takes these as flags (scripted and host_id excepted)."""

    host_id: str = setting(help="the checkpointer's host")
    image: str = setting("belayer-sandbox:test", "the sandbox image")
    policy: str = setting(
        "adaptive", "the checkpoint policy asked of the policy service: adaptive, never, always or every-N"
    )
    fallback_policy: str = setting("every-3", "the policy used when the policy service does not answer")
    consult_every_s: float = setting(1.0, "seconds between consults of the policy while a response runs")
    # The scripted agent (workloads.py) or the model's text: labelled wherever results appear.
    scripted: bool = setting(True, "the scripted agent acts (off: the model's text does)")
    temperature: float = setting(0.8, "the LLM's sampling temperature")
    max_recoveries: int = setting(50, "environment failures one trajectory survives")
    max_retries: int = setting(
        3, "retries of a request to the router or a checkpointer that fails on infrastructure"
    )
    action_timeout_s: float = setting(60.0, "seconds one sandbox action may take")
    create_timeout_s: float = setting(
        60.0, "seconds a sandbox's create may take (one whose checkpointer died with it is never answered)"
    )
    checkpoint_timeout_s: float = setting(60.0, "seconds one checkpoint may take")
    restore_timeout_s: float = setting(120.0, "seconds one restore may take")
    memory_mb: int = setting(256, "each sandbox's memory")

    def __post_init__(self) -> None:
        Policy.parse(self.policy)
        if Policy.parse(self.fallback_policy).kind == "adaptive":  # it needs the service's estimates
            raise ValueError("the fallback policy must be never, always or every-N, not adaptive")
        for flag, value in (
            ("--consult-every", self.consult_every_s),
            ("--action-timeout", self.action_timeout_s),
            ("--create-timeout", self.create_timeout_s),
            ("--checkpoint-timeout", self.checkpoint_timeout_s),
            ("--restore-timeout", self.restore_timeout_s),
            ("--memory-mb", self.memory_mb),
        ):
            positive(flag, value)
        if self.temperature < 0 or self.max_recoveries < 0 or self.max_retries < 0:
            raise ConfigError("--temperature, --max-recoveries and --max-retries must be >= 0")


TimelineKind = Literal["turn", "action", "checkpoint", "checkpoint-failed", "failure", "recovery", "kill"]


class TimelineEntry(msgspec.Struct, kw_only=True):
    """One line of a trajectory's timeline (JSON lines): what happened, from when to when."""

    kind: TimelineKind
    start_s: float  # seconds since the batch started
    end_s: float
    step: int
    detail: str = ""
    tokens: int = 0  # a turn's generated tokens


class TrajectoryResult(msgspec.Struct, kw_only=True):
    trajectory: str
    task: str
    status: Status
    reward: float
    error: str = ""  # an infrastructure error: its cause
    scripted: bool
    actions: list[str]
    observations: list[str]
    context_tokens: list[int]  # the prompt, then each step's response and observation
    prompt_len: int  # context_tokens[:prompt_len] is the prompt
    loss_mask: list[int]  # over context_tokens[prompt_len:]: 1 on the model's tokens, 0 on observations
    # Over context_tokens[prompt_len:]: each of the model's tokens' logprob as it was generated, 0.0
    # on observations; [] where the router kept none (a request older than logprobs).
    logprobs: list[float] = []
    # The token sets the turns drew from (Choice.allowed), each once, in order of first use; and
    # over context_tokens[prompt_len:], the 1-based set each token was drawn from (0: any token,
    # and every observation token).
    turn_sets: list[list[int]] = []
    token_sets: list[int] = []
    turns: int  # LLM responses generated, those redone after a failure included
    failures: int
    recoveries: int
    restores_from_base: int
    checkpoints: int
    checkpoint_s: float  # the whole time of every checkpoint, those that failed included
    exposed_checkpoint_s: float  # the part of it the trajectory waited for
    fallback_decisions: int  # decided by --fallback-policy: the policy service did not answer
    wall_s: float
    timeline: list[TimelineEntry] = []


class InfraError(Exception):
    """A bound was reached: the trajectory ends as an infrastructure error, with this cause."""


@dataclass
class StepRecord:
    """What step k (1-based) added: its action, its observation, and the work it took."""

    action: str
    observation: str
    llm_s: float
    env_s: float
    response_len: int = 0  # tokens of the response before the action (none before the setup action)
    observation_len: int = 0  # tokens of the observation after it (none when it is not seen)
    allowed: tuple[int, ...] = ()  # the token set the response was drawn from (): any
    exit_code: int = 0  # the action's, and what a check's verdict is read from
    timed_out: bool = False
    output: str = ""  # its stdout's tail (OBSERVATION_LIMIT)
    response_logprobs: list[float] = field(default_factory=list)  # of the response's tokens, as generated


@dataclass(frozen=True)
class Response:
    """A model's turn: its tokens and the logprob of each."""

    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class KeptResponse:
    """The response to a ready checkpoint's own context L_k, kept for a recovery to that checkpoint."""

    k: int
    context: list[int]  # L_k, the exact prompt it answered
    response: Response


@dataclass
class Services:
    """What a trajectory talks to: the router, the host's checkpointer, the policy service."""

    llm: Client
    sandboxes: SandboxClient | LocalSandboxes  # the host's checkpointer, or folders without Docker
    policy: PolicyClient
    nc: NATS
    subjects: Subjects

    @classmethod
    def on(
        cls, llm: Client, host_id: str, policy_timeout_s: float = 0.5, local: LocalSandboxes | None = None
    ) -> Services:
        """The cluster's services; with `local`, its folders stand in for the checkpointer."""
        nc, names = llm.nc, llm.subjects
        return cls(
            llm,
            local or SandboxClient(nc, host_id, subjects=names, client=llm.client),
            PolicyClient(nc, subjects=names, timeout_s=policy_timeout_s),
            nc,
            names,
        )


@dataclass
class Trajectory:
    """The running state of one trajectory; `steps[:k]` is its prefix after k actions."""

    trajectory_id: str
    task: Task
    seed: int
    settings: RolloutSettings
    services: Services
    clock: Callable[[], float]  # seconds since the batch started
    steps: list[StepRecord] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    ready_k: int = -1  # the step of the latest ready checkpoint (-1: none)
    checkpoint: asyncio.Task[CheckpointResult | None] | None = None
    checkpoint_k: int = -1  # the step the checkpoint in flight captures
    kept: KeptResponse | None = None  # the response to the ready checkpoint's L_k
    math_logprobs: list[float] = field(default_factory=list)  # a task without a sandbox: its one response's
    turns: int = 0
    failures: int = 0
    recoveries: int = 0
    restores_from_base: int = 0
    checkpoints: int = 0
    checkpoint_s: float = 0.0
    exposed_checkpoint_s: float = 0.0
    fallback_decisions: int = 0
    policy_down_until: float = float("-inf")  # on this trajectory's clock: see POLICY_RETRY_S
    timeline: list[TimelineEntry] = field(default_factory=list)
    on_action: Callable[[Trajectory, int], None] | None = None  # the chaos hook: step about to run
    weight_version: str = ""  # the weights every turn is generated on ("": the engines' newest)

    @property
    def k(self) -> int:
        return len(self.steps)

    @property
    def sandbox(self) -> str:
        return self.trajectory_id

    @property
    def scripted(self) -> bool:
        """Whether the scripted agent acts: a task whose turns are choices is always the model's."""
        return self.settings.scripted and self.task.choose_turn is None

    def keeps_response(self) -> bool:
        """Whether the kept response answers the context the trajectory stands at: restored to its
        checkpoint, with that checkpoint's L_k."""
        return self.kept is not None and self.kept.k == self.k and self.kept.context == self.context

    def mark(
        self, kind: TimelineKind, start_s: float, detail: str = "", step: int | None = None, tokens: int = 0
    ) -> None:
        self.timeline.append(
            TimelineEntry(
                kind=kind,
                start_s=start_s,
                end_s=self.clock(),
                step=self.k if step is None else step,
                detail=detail,
                tokens=tokens,
            )
        )

    # ------------------------------------------------------------ the loop

    async def run(self) -> TrajectoryResult:
        """Never raises but for cancellation: whatever goes wrong ends the trajectory as an
        infrastructure error with its cause, so one trajectory cannot take its batch down."""
        started = self.clock()
        status: Status = "done"
        error = ""
        reward = 0.0
        try:
            reward = await (self.run_shell() if self.task.needs_sandbox else self.run_math())
        except InfraError as exc:
            status, error = "infra-error", str(exc)
            log.warning("trajectory %s ends on an infrastructure error: %s", self.trajectory_id, error)
        except Exception as exc:  # a bug or an unforeseen failure: still a typed end, with its cause
            status, error = "infra-error", f"{type(exc).__name__}: {exc}"
            log.exception("trajectory %s failed", self.trajectory_id)
        finally:
            await self.clean_up()
        return TrajectoryResult(
            trajectory=self.trajectory_id,
            task=self.task.task_id,
            status=status,
            reward=reward,
            error=error,
            scripted=self.scripted,
            actions=[s.action for s in self.steps],
            observations=[s.observation for s in self.steps],
            context_tokens=self.context,
            prompt_len=self.prompt_len,
            loss_mask=self.loss_mask(),
            logprobs=self.logprobs(),
            turn_sets=[list(allowed) for allowed in self.turn_sets()],
            token_sets=self.token_sets(),
            turns=self.turns,
            failures=self.failures,
            recoveries=self.recoveries,
            restores_from_base=self.restores_from_base,
            checkpoints=self.checkpoints,
            checkpoint_s=self.checkpoint_s,
            exposed_checkpoint_s=self.exposed_checkpoint_s,
            fallback_decisions=self.fallback_decisions,
            wall_s=self.clock() - started,
            timeline=self.timeline,
        )

    async def clean_up(self) -> None:
        """The checkpoint in flight, the trajectory's checkpoints and its sandbox: each step tried
        whatever happened to the one before."""
        try:
            await self.settle_checkpoint()
        except Exception:
            log.exception("trajectory %s: the last checkpoint failed", self.trajectory_id)
        if self.task.needs_sandbox:
            with contextlib.suppress(Exception):
                await self.services.sandboxes.end(self.trajectory_id)
            with contextlib.suppress(Exception):
                await self.services.sandboxes.destroy(self.sandbox)

    async def tell(self, report: Awaitable[None]) -> None:
        """Telemetry for the policy and the event stream: best effort, never a trajectory's end."""
        try:
            await report
        except Exception as exc:
            log.warning("trajectory %s: a report was lost: %s", self.trajectory_id, exc)

    @property
    def prompt_len(self) -> int:
        return len(tokenizer.encode(self.task.prompt))

    def loss_mask(self) -> list[int]:
        """What a trainer may learn from: the model's tokens, not the environment's. Built from the
        steps of the final prefix, so a recovered trajectory's mask is its failure-free run's."""
        if not self.task.needs_sandbox:
            return [1] * (len(self.context) - self.prompt_len)
        return [bit for s in self.steps for bit in [1] * s.response_len + [0] * s.observation_len]

    def logprobs(self) -> list[float]:
        """Parallel to the loss mask: the model's tokens' logprobs, 0.0 on observations; [] if one
        of its responses came without them."""
        if not self.task.needs_sandbox:
            return list(self.math_logprobs)
        if any(len(s.response_logprobs) != s.response_len for s in self.steps):
            return []
        return [x for s in self.steps for x in [*s.response_logprobs, *[0.0] * s.observation_len]]

    def turn_sets(self) -> list[tuple[int, ...]]:
        return list(dict.fromkeys(s.allowed for s in self.steps if s.allowed))

    def token_sets(self) -> list[int]:
        """Parallel to the loss mask: which of `turn_sets` each token was drawn from (0: any)."""
        index = {allowed: i for i, allowed in enumerate(self.turn_sets(), start=1)}
        if not self.task.needs_sandbox:
            return [0] * (len(self.context) - self.prompt_len)
        return [
            bit
            for s in self.steps
            for bit in [index.get(s.allowed, 0)] * s.response_len + [0] * s.observation_len
        ]

    async def run_math(self) -> float:
        self.context = tokenizer.encode(self.task.prompt)
        response, _ = await self.generate(overlap_checkpoints=False)
        self.context = self.context + response.tokens
        self.math_logprobs = response.logprobs
        return math_reward(self.task, response.tokens)

    async def run_shell(self) -> float:
        try:
            # A pointer left by an earlier run under this id (a killed batch) must not be restored.
            await self.services.sandboxes.end(self.trajectory_id)
            await self.start_sandbox()
        except ServiceError as exc:
            raise InfraError(f"no sandbox: {exc}") from None
        while True:
            try:
                if self.k == 0:
                    setup = await self.act(self.task.setup, llm_s=0.0, seen=self.task.setup_seen)
                    if setup.exit_code or setup.timed_out:  # the task is broken: nothing to learn from
                        why = "timed out" if setup.timed_out else f"exit {setup.exit_code}"
                        raise InfraError(f"the task's setup failed ({why}): {setup.stderr[-200:]!r}")
                    continue
                turn = self.k - 1  # the setup is action 1; turn t follows action t + 1
                if turn >= self.task.max_turns:
                    return self.verdict(self.steps[-1])
                last = turn == self.task.max_turns - 1
                choice = self.task.answer_turn if last else self.task.choose_turn
                # Folders have no checkpoints: no policy to consult while the response runs.
                overlap = not isinstance(self.services.sandboxes, LocalSandboxes)
                response, llm_s = await self.generate(overlap_checkpoints=overlap, choice=choice)
                await self.act(self.action_for(response.tokens, last), llm_s, response, choice)
            except ServiceError as exc:
                if exc.code not in ENV_FAILURES:
                    raise InfraError(str(exc)) from None
                await self.recover(str(exc))

    def verdict(self, check: StepRecord) -> float:
        """The reward the check gave; a check with no verdict is an infrastructure error, never a
        reward."""
        if check.timed_out:
            raise InfraError(f"the check did not end in {self.settings.action_timeout_s:g} s")
        if not self.task.scored:
            return 1.0 if check.exit_code == 0 else 0.0
        try:
            return check_score(check.output)
        except ValueError as exc:
            raise InfraError(str(exc)) from None

    def action_for(self, response: list[int], last: bool) -> str:
        """The action a response picks: on the last turn the check (given the response as its
        argument when the task asks for an answer), before it an action of the menu."""
        if last:
            if self.task.answer_turn is None:
                return self.task.check
            return f"{self.task.check} {shlex.quote(tokenizer.decode(response))}"
        if self.task.choose_turn is not None:
            return self.task.menu[self.task.choose_turn.allowed.index(response[0])]
        return choose_action(self.task, response, self.settings.scripted)

    # ------------------------------------------------------------ LLM turns

    async def generate(
        self, overlap_checkpoints: bool, choice: Choice | None = None
    ) -> tuple[Response, float]:
        """The response to the context; with `overlap_checkpoints`, the policy is consulted while it
        is generated and a checkpoint of this boundary may start. A `choice` fixes the response's
        length and the tokens it draws from."""
        if overlap_checkpoints and self.kept is not None and self.keeps_response():
            return self.kept.response, 0.0  # just restored to checkpoint k: its response stands
        kwargs: dict[str, Any] = {
            "seed": turn_seed(self.seed, self.k),
            "temperature": self.settings.temperature,
            "weight_version": self.weight_version or None,
        }
        if choice is not None:
            kwargs |= {"max_tokens": choice.length, "min_tokens": choice.length}
            kwargs["allowed_tokens"] = list(choice.allowed)
        elif self.scripted:
            length = response_tokens(self.seed, self.k)
            kwargs |= {"max_tokens": length, "min_tokens": length}
        else:
            kwargs |= {"max_tokens": self.task.max_tokens, "min_tokens": 0}
        for attempt in range(1, self.settings.max_retries + 1):
            started = self.clock()
            request = asyncio.ensure_future(self.services.llm.generate_all(list(self.context), **kwargs))
            try:
                if overlap_checkpoints:
                    await self.consult_while(request, started)
                generation = await request
            except (GenerationError, ServiceError) as exc:
                self.mark("turn", started, f"failed (attempt {attempt}): {exc}")
                if attempt == self.settings.max_retries:
                    raise InfraError(f"LLM request failed {attempt} times, last: {exc}") from None
                continue
            finally:
                if not request.done():
                    request.cancel()
                    await asyncio.wait([request])  # its end, without re-raising it (or our own cancel)
            if self.weight_version and generation.weight_version != self.weight_version:
                raise InfraError(
                    f"a turn came back from {generation.weight_version}, not {self.weight_version}"
                )
            if choice is not None and len(generation.tokens) != choice.length:  # never a partial choice
                why = f"{len(generation.tokens)} of {choice.length} tokens ({generation.finish_reason})"
                self.mark("turn", started, f"cut short (attempt {attempt}): {why}")
                if attempt == self.settings.max_retries:
                    raise InfraError(f"LLM request cut short {attempt} times, last: {why}")
                continue
            seconds = self.clock() - started
            self.turns += 1
            self.mark(
                "turn",
                started,
                f"{len(generation.tokens)} tokens, {generation.resumes} resumes",
                tokens=len(generation.tokens),
            )
            response = LlmResponse(
                trajectory=self.trajectory_id, seconds=seconds, tokens=len(generation.tokens)
            )
            await self.tell(self.services.policy.report_response(response))
            return Response(generation.tokens, generation.logprobs), seconds
        raise AssertionError("unreachable")

    async def consult_while(self, request: asyncio.Future[Any], started: float) -> None:
        """Ask the policy now and every consult_every_s until it says checkpoint or the response ends."""
        while not request.done():
            if self.checkpoint is None and self.k != self.ready_k:
                decision = await self.ask_policy(self.clock() - started)
                if decision.checkpoint and not request.done():  # decided for a response still running
                    self.start_checkpoint()
            if self.checkpoint is not None:
                return  # one in flight per trajectory: nothing more to ask this turn
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(request), self.settings.consult_every_s)

    async def ask_policy(self, elapsed_s: float) -> PolicyDecision:
        since = self.steps[max(self.ready_k, 0) :]
        # The work a failure would make the trajectory redo, so far: the work since the ready
        # checkpoint, less the response to its L_k, which a recovery keeps. The service adds what
        # it expects of the running response beyond `elapsed_s` to make C_t.
        kept_s = since[0].llm_s if since and self.kept is not None and self.kept.k == self.ready_k else 0.0
        request = PolicyDecide(
            trajectory=self.trajectory_id,
            host_id=self.services.sandboxes.host_id,
            step=self.k,
            step_duration_s=self.steps[-1].env_s if self.steps else 0.0,
            exposure_s=sum(s.llm_s + s.env_s for s in since) - kept_s + elapsed_s,
            env_work_s=sum(s.env_s for s in since),
            elapsed_s=elapsed_s,
            in_flight=self.checkpoint is not None,
            policy=self.settings.policy,
        )
        if self.clock() < self.policy_down_until:
            return await self.fallback(request, "the policy service did not answer a moment ago")
        try:
            return await self.services.policy.decide(request)
        except ServiceError as exc:
            self.policy_down_until = self.clock() + POLICY_RETRY_S
            return await self.fallback(request, str(exc))

    async def fallback(self, request: PolicyDecide, why: str) -> PolicyDecision:
        """The policy service did not answer: a named policy decides here, and an event says so."""
        policy = Policy.parse(self.settings.fallback_policy)
        if not self.fallback_decisions:
            event = PolicyFallback(trajectory=self.trajectory_id, policy=policy.name, why=why)
            subject = self.services.subjects.event("policy_fallback", self.trajectory_id)
            await self.tell(bus.publish(self.services.nc, subject, event))
            log.warning(
                "trajectory %s: policy service unavailable (%s), using %s",
                self.trajectory_id,
                why,
                policy.name,
            )
        self.fallback_decisions += 1
        none = ResponseTimes()
        verdict = decide(
            policy,
            situation_of(request, none),
            p=0.0,
            responses=none,
            cost_s=0.0,
        )
        return decision_message(request, policy, verdict, rate_per_s=0.0, source="fallback")

    # ------------------------------------------------------------ checkpoints

    def start_checkpoint(self) -> None:
        k, context = self.k, list(self.context)
        self.checkpoint_k = k
        self.checkpoint = asyncio.ensure_future(self.take_checkpoint(k, context))

    async def take_checkpoint(self, k: int, context: list[int]) -> CheckpointResult | None:
        started = self.clock()
        timeout_s = self.settings.checkpoint_timeout_s
        try:
            result = await self.services.sandboxes.checkpoint(
                self.sandbox, self.trajectory_id, k, context_tokens=context, timeout_s=timeout_s
            )
        except ServiceError as exc:
            self.checkpoint_s += self.clock() - started  # its time counts, hidden or not, like a ready one's
            self.mark("checkpoint-failed", started, str(exc), step=k)
            if exc.code == "timeout":
                waited = self.clock() - started
                event = CheckpointTimeout(
                    trajectory=self.trajectory_id,
                    host_id=self.services.sandboxes.host_id,
                    k=k,
                    waited_s=waited,
                )
                await self.tell(self.services.policy.report_timeout(event))
            return None
        self.mark(
            "checkpoint", started, f"{result.bytes_written} bytes, frozen {result.freeze_s:.3f} s", step=k
        )
        self.checkpoints += 1
        self.checkpoint_s += self.clock() - started
        self.ready_k = max(self.ready_k, k)
        return result

    async def settle_checkpoint(self) -> None:
        """Wait for the checkpoint in flight (the next action would queue behind it anyway); the
        wait is the checkpoint time this trajectory could not hide."""
        if self.checkpoint is None:
            return
        waited = self.clock()
        try:
            await self.checkpoint
        finally:
            self.exposed_checkpoint_s += self.clock() - waited
            self.checkpoint = None

    # ------------------------------------------------------------ actions and recovery

    async def start_sandbox(self) -> None:
        spec = SandboxSpec(image=self.settings.image, memory_mb=self.settings.memory_mb)
        await self.services.sandboxes.create(
            spec, sandbox=self.sandbox, timeout_s=self.settings.create_timeout_s
        )
        self.steps = []
        self.context = tokenizer.encode(self.task.prompt)

    async def act(
        self,
        command: str,
        llm_s: float,
        response: Response | None = None,
        choice: Choice | None = None,
        seen: bool = True,
    ) -> ExecResult:
        """Run action k+1; on success its observation joins the context (unless not `seen`). A
        failure raises before anything is appended."""
        await self.settle_checkpoint()
        if response is not None and self.ready_k == self.k:  # `response` answered this checkpoint's L_k
            self.kept = KeptResponse(self.k, list(self.context), response)
        step = self.k + 1
        if self.on_action is not None:
            self.on_action(self, step)
        started = self.clock()
        try:
            result = await self.services.sandboxes.exec(
                self.sandbox, command, timeout_s=self.settings.action_timeout_s, expect_step=self.k
            )
        except ServiceError as exc:
            env_s = self.clock() - started
            self.mark("failure", started, str(exc), step=step)
            if exc.code in ENV_FAILURES:  # what λ counts; an RPC timeout is not the environment's failure
                failed = EnvStep(
                    trajectory=self.trajectory_id,
                    host_id=self.services.sandboxes.host_id,
                    step=step,
                    duration_s=env_s,
                    failed=True,
                )
                await self.tell(self.services.policy.report_step(failed))
            raise
        env_s = self.clock() - started
        if not seen:
            text = ""
        elif self.task.observe == "output":
            text = seen_output(result.stdout, result.stderr)
        else:
            text = observation(command, result.exit_code, result.stdout, result.stderr, result.timed_out)
        seen_tokens = tokenizer.encode(text)
        tokens = response.tokens if response is not None else []
        record = StepRecord(
            command, text, llm_s, env_s, len(tokens), len(seen_tokens),
            response_logprobs=response.logprobs if response is not None else [],
            allowed=choice.allowed if choice is not None else (),
            exit_code=result.exit_code, timed_out=result.timed_out,
            output=result.stdout[-OBSERVATION_LIMIT:],
        )  # fmt: skip
        self.steps.append(record)
        self.context = self.context + tokens + seen_tokens
        self.mark("action", started, command, step=step)
        done = EnvStep(
            trajectory=self.trajectory_id,
            host_id=self.services.sandboxes.host_id,
            step=step,
            duration_s=env_s,
        )
        await self.tell(self.services.policy.report_step(done))
        return result

    async def recover(self, why: str) -> None:
        self.failures += 1
        if self.recoveries >= self.settings.max_recoveries:
            raise InfraError(f"{self.failures} environment failures, past --max-recoveries; last: {why}")
        await self.settle_checkpoint()
        started = self.clock()
        for attempt in range(1, self.settings.max_retries + 1):
            try:
                await self.restore()
                break
            except ServiceError as exc:
                if attempt == self.settings.max_retries:
                    raise InfraError(f"restore failed {attempt} times, last: {exc}") from None
        self.recoveries += 1
        if self.k == 0:
            source = "from the base image"
        elif self.keeps_response():
            source = f"from checkpoint k={self.k}, keeping its response"
        else:
            source = f"from checkpoint k={self.k}"
        self.mark("recovery", started, f"{source} ({why})")

    async def restore(self) -> None:
        """The latest ready checkpoint, with its L_k; without one, the base image and the prompt."""
        try:
            restored = await self.services.sandboxes.restore(
                self.trajectory_id, self.settings.restore_timeout_s
            )
        except ServiceError as exc:
            if exc.code != "no-checkpoint":
                raise
            restored = None
        if restored is None or restored.k == 0:
            with contextlib.suppress(ServiceError):
                await self.services.sandboxes.destroy(self.sandbox)
            await self.start_sandbox()
            self.restores_from_base += 1
            self.ready_k = -1
            self.kept = None
            return
        if restored.k > len(self.steps):
            raise ServiceError(
                "stale", f"checkpoint k={restored.k} is past the {len(self.steps)} steps known"
            )
        del self.steps[restored.k :]
        self.context = list(restored.context_tokens)
        self.ready_k = restored.k
