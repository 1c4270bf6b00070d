"""A verl agent loop that runs each sample as a Belayer trajectory: configuration plus this file, no fork.

verl picks an agent loop per sample by name, instantiates it with hydra, and awaits its `run`. The
signature implemented here, from volcengine/verl, verl/experimental/agent_loop/agent_loop.py:

    class AgentLoopBase(ABC):
        @abstractmethod
        async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:

    def register(agent_name: str):

    class AgentLoopOutput(BaseModel):
        prompt_ids: list[int]
        response_ids: list[int]
        response_mask: list[int]
        response_logprobs: Optional[list[float]] = None
        reward_score: Optional[float] = None
        num_turns: int = 0
        metrics: AgentLoopMetrics
        extra_fields: dict[str, Any] = {}

and its call site in the same file: `output: AgentLoopOutput = await agent_loop.run(sampling_params, **kwargs)`,
where kwargs are the dataset row's fields (raw_prompt, extra_info, index, data_source, reward_model, ...).

What the adapter does with a sample:
- the prompt text (the contents of `raw_prompt`'s messages) becomes a Belayer Task's prompt; the task's
  shape (setup, check, menu, max_turns, ...) comes from `extra_info["belayer_task"]`, else a shell task;
- the trajectory seed is `extra_info["belayer_seed"]` when given (replays), else fresh for each call, since
  verl hands `rollout.n` copies of a prompt the same kwargs and a shared seed would make them identical;
- Belayer runs the whole multi-turn trajectory (LLM turns on its router, actions in a checkpointed
  sandbox, recovery from environment failures) and the result becomes an AgentLoopOutput:
  prompt_ids = encode(prompt), response_ids = everything after it (responses and observations),
  response_mask = 1 on LLM tokens and 0 on observation tokens, reward_score = the task's reward.
- AgentLoopOutput has no failure status. A trajectory that ends on an infrastructure error (past
  Belayer's recovery bounds) is returned with `extra_fields["rollout_status"] == "aborted"`, the cause
  in `extra_fields["belayer_error"]`, an all-zero response_mask (nothing of it is trained on) and
  reward_score 0.0 (verl's reward manager is not asked to score it). With `on_infra_error: raise` the
  loop raises instead, which fails verl's generation step.

Token ids are those of the Belayer cluster (its byte-level tokenizer here): the policy verl trains must
be the one Belayer's router serves. `sampling_params["temperature"]` is honoured; verl's other sampling
parameters (top_p, repetition_penalty) are not forwarded. `response_logprobs` holds each model
token's log-probability as it was generated (the rollout policy's, which verl's off-policy
correction reads) and 0.0 on observation tokens, which the mask leaves out anyway; a recovered
trajectory's are those of its failure-free run.

For verl's own agent loops, belayer_server.py offers the other seam: `BelayerServerClient` is a
`server_manager` whose `generate(request_id, prompt_ids=..., sampling_params=...)` returns verl's
TokenOutput through Belayer's HTTP gateway.

The framework-neutral parts (the connection to the cluster, the prompt's text, the Task a sample names)
come from belayer_rl.services.rollout.adapter; the mask is the result's own `loss_mask`.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from belayer_rl.services.rollout.adapter import client, prompt_text, task_for
from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.workloads import Task
from belayer_rl.shared import tokenizer
from belayer_rl.shared.config import hostname_id

try:  # inside verl: the real base class, output model and registry
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
except ImportError:  # verl not installed (reading or testing this file): importable, but `run` needs an
    # output type: set BelayerAgentLoop.output_type to a class taking AgentLoopOutput's fields.
    AgentLoopBase = object  # type: ignore[assignment,misc]
    AgentLoopOutput = None  # type: ignore[assignment,misc]

    def register(agent_name: str) -> Callable[[type], type]:  # type: ignore[misc]
        return lambda cls: cls


# ---------------------------------------------------------------- result -> AgentLoopOutput


def seconds(result: TrajectoryResult, kind: str) -> float:
    return sum(e.end_s - e.start_s for e in result.timeline if e.kind == kind)


# ---------------------------------------------------------------- the agent loop


@register("belayer")
class BelayerAgentLoop(AgentLoopBase):  # type: ignore[misc,valid-type]
    """Configured from agent_loop.yaml: every key but name and _target_ arrives here as a keyword."""

    output_type: Any = AgentLoopOutput

    def __init__(
        self,
        *args: Any,
        belayer_url: str = "nats://127.0.0.1:4222",
        cluster_id: str | None = None,
        creds: str | None = None,
        host_id: str | None = None,
        rollout_settings: Any = None,
        on_infra_error: str = "abort",
        **kwargs: Any,
    ) -> None:
        if AgentLoopBase is not object:
            super().__init__(*args, **kwargs)  # verl's own: trainer_config, server_manager, tokenizer, ...
        else:
            self.config = getattr(kwargs.get("trainer_config"), "config", None)
        if on_infra_error not in ("abort", "raise"):
            raise ValueError(f"on_infra_error is 'abort' or 'raise', not {on_infra_error!r}")
        self.belayer_url, self.cluster_id, self.creds = belayer_url, cluster_id, creds
        self.host_id = host_id or hostname_id()  # the host whose checkpointer runs the sandboxes
        self.rollout_settings = dict(rollout_settings or {})  # RolloutSettings fields: policy, image, ...
        self.on_infra_error = on_infra_error

    def response_limit(self) -> int | None:
        """verl's rollout.response_length, which its padding needs the response to fit."""
        try:
            return int(self.config.actor_rollout_ref.rollout.response_length)
        except (AttributeError, TypeError, ValueError):
            return None

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        extra = dict(kwargs.get("extra_info") or {})
        prompt = prompt_text(kwargs["raw_prompt"])
        task = task_for(prompt, extra.get("belayer_task"), f"verl-{kwargs.get('index', 0)}")
        seed = int(extra["belayer_seed"]) if "belayer_seed" in extra else random.randrange(1 << 40)
        options = {**self.rollout_settings, "host_id": self.host_id}
        if "temperature" in sampling_params:
            options["temperature"] = float(sampling_params["temperature"])
        services = Services.on(
            await client(self.belayer_url, self.cluster_id, self.creds, "belayer-verl"), self.host_id
        )
        started = time.monotonic()
        trajectory = Trajectory(
            f"verl-{uuid.uuid4().hex[:12]}",
            task,
            seed,
            RolloutSettings(**options),
            services,
            lambda: time.monotonic() - started,
        )
        result = await trajectory.run()
        return self.output(task, result)

    def output(self, task: Task, result: TrajectoryResult) -> Any:
        if self.output_type is None:
            raise RuntimeError("verl is not installed: set BelayerAgentLoop.output_type")
        aborted = result.status != "done"
        if aborted and self.on_infra_error == "raise":
            raise RuntimeError(
                f"Belayer trajectory {result.trajectory} ended on an infrastructure error: {result.error}"
            )
        prompt_ids = tokenizer.encode(task.prompt)
        response_ids = result.context_tokens[result.prompt_len :]
        mask = [0] * len(response_ids) if aborted else list(result.loss_mask)
        logprobs = list(result.logprobs) if len(result.logprobs) == len(response_ids) else None
        limit = self.response_limit()
        if limit is not None and len(response_ids) > limit:
            response_ids, mask = response_ids[:limit], mask[:limit]
            logprobs = logprobs[:limit] if logprobs is not None else None
        return self.output_type(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
            response_logprobs=logprobs,
            reward_score=0.0 if aborted else result.reward,
            # verl counts messages: the prompt, then a response and an observation a step (the setup
            # step has no response), so 2 a step; a math task is a prompt and one response
            num_turns=2 * len(result.observations) if result.observations else 2,
            metrics={"generate_sequences": seconds(result, "turn"), "tool_calls": seconds(result, "action")},
            extra_fields={
                "rollout_status": "aborted" if aborted else "completed",
                "belayer_error": result.error,
                "belayer_trajectory": result.trajectory,
                "belayer_failures": result.failures,
                "belayer_recoveries": result.recoveries,
                "belayer_checkpoints": result.checkpoints,
            },
        )
