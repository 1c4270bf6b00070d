"""A slime custom generate function that runs each sample as a Belayer trajectory: configuration plus
this file, no fork.

slime's default rollout (slime.rollout.sglang_rollout) calls the function named by
--custom-generate-function-path in place of its own `generate`, once per sample. The signature
implemented here, from THUDM/slime, slime/rollout/sglang_rollout.py:

    async def generate(args: Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:

called there as `sample = await custom_generate_func(args, sample, sampling_params)`; and the Sample
fields it fills, from slime/utils/types.py:

    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    status: Status = Status.PENDING   # PENDING, COMPLETED, TRUNCATED, ABORTED, FAILED

What the adapter does with a sample:
- `sample.prompt` (a string, or chat messages whose contents are joined) becomes a Belayer Task's
  prompt; the task's shape (setup, check, menu, max_turns, ...) comes from
  `sample.metadata["belayer_task"]`, else a shell task;
- the trajectory seed is `metadata["belayer_seed"]` when given (replays); else it derives from the
  sample index and slime's `sampling_seed` when deterministic inference set one; else it is fresh;
- Belayer runs the whole multi-turn trajectory (LLM turns on its router, actions in a checkpointed
  sandbox, recovery from environment failures) and the sample gets tokens = prompt + responses +
  observations, response = the text after the prompt, loss_mask = 1 on LLM tokens and 0 on observation
  tokens (its length is response_length, as slime asserts), reward = the task's reward, status
  COMPLETED. slime's reward model is then skipped, the reward being set.
- A trajectory that ends on an infrastructure error (past Belayer's recovery bounds) becomes
  Status.ABORTED, never COMPLETED: slime skips the reward model for it and its fully async rollout puts
  the group back into the data buffer; the loss mask is all zeros, `remove_sample` is set, the reward is
  0.0 and the cause is in `metadata["belayer"]["error"]`. ABORTED rather than FAILED: a FAILED sample
  is scored and trained on as a finished attempt, which this is not.

The settings live on slime's `args`, set from a YAML by --custom-config-path (belayer_config.yaml):
belayer_url, belayer_cluster_id, belayer_creds, belayer_host_id and belayer_settings (RolloutSettings
fields). Token ids are those of the Belayer cluster (its byte-level tokenizer here): the policy slime
trains must be the one Belayer's router serves. `sampling_params["temperature"]` is honoured; slime's
other sampling parameters are not forwarded, and no rollout log-probs are returned.

Nothing here imports slime: the Status enum is taken from the sample's own class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any

from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.workloads import Task, seeded, shell_tasks
from belayer_rl.shared import tokenizer
from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.examples.slime")

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
        pending = _clients[key] = asyncio.ensure_future(Client.connect(target, "belayer-slime"))
    return await pending


async def close_belayer_clients() -> None:
    """Close the connections this event loop opened (at shutdown; tests call it)."""
    loop = asyncio.get_running_loop()
    for key in [k for k in _clients if k[0] is loop]:
        pending = _clients.pop(key)
        if pending.done() and not pending.cancelled() and pending.exception() is None:
            await pending.result().nc.close()


# ---------------------------------------------------------------- sample -> task, result -> tokens


def prompt_text(prompt: Any) -> str:
    """The text of a prompt: a string as is, chat messages' contents one after another."""
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in list(prompt):
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


def loss_mask(result: TrajectoryResult, prompt_len: int, starts: dict[int, int]) -> list[int]:
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


def trajectory_seed(sample: Any, metadata: dict[str, Any], sampling_params: dict[str, Any]) -> int:
    if "belayer_seed" in metadata:
        return int(metadata["belayer_seed"])
    if "sampling_seed" in sampling_params:  # slime's deterministic inference: one seed per group member
        return seeded("slime", sample.index, int(sampling_params["sampling_seed"])).randrange(1 << 40)
    return random.randrange(1 << 40)


# ---------------------------------------------------------------- the generate function


async def generate(args: Namespace, sample: Any, sampling_params: dict[str, Any]) -> Any:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    prompt = prompt_text(sample.prompt)
    task = task_for(prompt, metadata.get("belayer_task"), f"slime-{sample.index}")
    host_id = getattr(args, "belayer_host_id", None) or hostname_id()
    options = {**dict(getattr(args, "belayer_settings", None) or {}), "host_id": host_id}
    if "temperature" in sampling_params:
        options["temperature"] = float(sampling_params["temperature"])
    client = await belayer_client(
        getattr(args, "belayer_url", None) or "nats://127.0.0.1:4222",
        getattr(args, "belayer_cluster_id", None),
        getattr(args, "belayer_creds", None),
    )
    started = time.monotonic()
    trajectory = Trajectory(
        f"slime-{uuid.uuid4().hex[:12]}",
        task,
        trajectory_seed(sample, metadata, sampling_params),
        RolloutSettings(**options),
        Services.on(client, host_id),
        lambda: time.monotonic() - started,
    )
    starts = record_step_starts(trajectory)
    result = await trajectory.run()

    prompt_ids = tokenizer.encode(task.prompt)
    response_ids = result.context_tokens[len(prompt_ids) :]
    done = result.status == "done"
    sample.tokens = prompt_ids + response_ids
    sample.response = tokenizer.decode(response_ids)
    sample.response_length = len(response_ids)
    sample.loss_mask = loss_mask(result, len(prompt_ids), starts) if done else [0] * len(response_ids)
    sample.reward = result.reward if done else 0.0
    sample.status = type(sample).Status.COMPLETED if done else type(sample).Status.ABORTED
    sample.remove_sample = not done
    sample.metadata = {
        **metadata,
        "belayer": {
            "trajectory": result.trajectory,
            "status": result.status,
            "error": result.error,
            "failures": result.failures,
            "recoveries": result.recoveries,
            "checkpoints": result.checkpoints,
            "wall_s": result.wall_s,
        },
    }
    return sample
