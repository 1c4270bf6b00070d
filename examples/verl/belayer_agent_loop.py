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
parameters (top_p, repetition_penalty, logprobs) are not forwarded, and no log-probs are returned.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.workloads import Task, shell_tasks
from belayer_rl.shared import tokenizer
from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.subjects import Subjects

try:  # inside verl: the real base class, output model and registry
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
except ImportError:  # verl not installed (reading or testing this file): importable, but `run` needs an
    # output type: set BelayerAgentLoop.output_type to a class taking AgentLoopOutput's fields.
    AgentLoopBase = object  # type: ignore[assignment,misc]
    AgentLoopOutput = None  # type: ignore[assignment,misc]

    def register(agent_name: str) -> Callable[[type], type]:  # type: ignore[misc]
        return lambda cls: cls


log = logging.getLogger("belayer.examples.verl")

# ---------------------------------------------------------------- the connection, one per process and loop

_clients: dict[tuple[Any, ...], asyncio.Future[Client]] = {}


async def belayer_client(url: str, cluster_id: str | None = None, creds: str | None = None) -> Client:
    """The Client of this event loop for that cluster: connected once, shared by every sample."""
    loop = asyncio.get_running_loop()
    key = (loop, url, cluster_id, creds)
    pending = _clients.get(key)
    if pending is None or (
        pending.done() and (pending.cancelled() or pending.exception() or pending.result().nc.is_closed)
    ):
        target = Target(
            url,
            Subjects(cluster_id) if cluster_id else Subjects(),
            Access(creds=Path(creds)) if creds else Access(),
        )
        pending = _clients[key] = asyncio.ensure_future(Client.connect(target, "belayer-verl"))
    return await pending


async def close_belayer_clients() -> None:
    """Close the connections this event loop opened (at shutdown; tests call it)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _clients if k[0] is loop]:
        pending = _clients.pop(key)
        if pending.done() and not pending.cancelled() and pending.exception() is None:
            await pending.result().nc.close()


# ---------------------------------------------------------------- sample -> task, result -> tokens


def prompt_text(messages: Any) -> str:
    """The text of a chat prompt: its messages' contents, one after another (a string stays as is)."""
    if isinstance(messages, str):
        return messages
    parts = []
    for message in list(messages):
        content = message["content"]
        if not isinstance(content, str):  # a list of typed parts: the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        parts.append(content)
    return "\n".join(parts)


TASK_FIELDS = {f.name for f in dataclasses.fields(Task)} - {"prompt"}


def task_for(prompt: str, spec: Any, task_id: str) -> Task:
    """A Task with this prompt, shaped by `spec` (a mapping of Task's other fields) or a shell task."""
    if not spec:
        return dataclasses.replace(shell_tasks(1)[0], task_id=task_id, prompt=prompt)
    spec = {k: v for k, v in dict(spec).items() if k in TASK_FIELDS}
    spec.setdefault("task_id", task_id)
    spec.setdefault("max_turns", 1)
    if "menu" in spec:
        spec["menu"] = tuple(str(action) for action in spec["menu"])
    for name in ("max_turns", "max_tokens"):
        if name in spec:
            spec[name] = int(spec[name])
    return Task(prompt=prompt, **spec)


def record_step_starts(trajectory: Trajectory) -> dict[int, int]:
    """Where each step begins in the context: the context's length when the step is about to run. A
    step redone after a recovery records again, so the map always describes the final context."""
    starts: dict[int, int] = {}
    previous = trajectory.on_action

    def on_action(t: Trajectory, step: int) -> None:
        starts[step] = len(t.context)
        if previous is not None:
            previous(t, step)

    trajectory.on_action = on_action
    return starts


def response_mask(result: TrajectoryResult, prompt_len: int, starts: dict[int, int]) -> list[int]:
    """1 for the LLM's tokens, 0 for observation tokens, over the context after the prompt. Step s adds
    its response (none for the setup action) then its observation, so it spans starts[s] to starts[s + 1]
    and ends with encode(observation). Should that not hold, nothing is marked trainable."""
    context = result.context_tokens
    length = len(context) - prompt_len
    if not result.observations:  # one generation, no environment
        return [1] * length
    bounds = [starts.get(step) for step in range(1, len(result.observations) + 1)] + [len(context)]
    mask: list[int] = []
    for step, seen in enumerate(result.observations):
        begin, end, tokens = bounds[step], bounds[step + 1], tokenizer.encode(seen)
        if begin is None or end - begin < len(tokens) or context[end - len(tokens) : end] != tokens:
            log.warning("trajectory %s: step boundaries do not match its context", result.trajectory)
            return [0] * length
        mask += [1] * (end - begin - len(tokens)) + [0] * len(tokens)
    return mask if bounds[0] == prompt_len else [0] * length


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
            await belayer_client(self.belayer_url, self.cluster_id, self.creds), self.host_id
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
        starts = record_step_starts(trajectory)
        result = await trajectory.run()
        return self.output(task, result, starts)

    def output(self, task: Task, result: TrajectoryResult, starts: dict[int, int]) -> Any:
        if self.output_type is None:
            raise RuntimeError("verl is not installed: set BelayerAgentLoop.output_type")
        aborted = result.status != "done"
        if aborted and self.on_infra_error == "raise":
            raise RuntimeError(
                f"Belayer trajectory {result.trajectory} ended on an infrastructure error: {result.error}"
            )
        prompt_ids = tokenizer.encode(task.prompt)
        response_ids = result.context_tokens[len(prompt_ids) :]
        mask = [0] * len(response_ids) if aborted else response_mask(result, len(prompt_ids), starts)
        limit = self.response_limit()
        if limit is not None and len(response_ids) > limit:
            response_ids, mask = response_ids[:limit], mask[:limit]
        return self.output_type(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=mask,
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
