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

The framework-neutral parts (the connection to the cluster, the prompt's text, the Task a sample names)
come from belayer_rl.services.rollout.adapter; the mask is the result's own `loss_mask`.
"""

from __future__ import annotations

import random
import time
import uuid
from argparse import Namespace
from typing import Any

from belayer_rl.services.rollout.adapter import client, prompt_text, task_for
from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory
from belayer_rl.services.rollout.workloads import seeded
from belayer_rl.shared import tokenizer
from belayer_rl.shared.config import hostname_id

# ---------------------------------------------------------------- the seed


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
    belayer = await client(
        getattr(args, "belayer_url", None) or "nats://127.0.0.1:4222",
        getattr(args, "belayer_cluster_id", None),
        getattr(args, "belayer_creds", None),
        "belayer-slime",
    )
    started = time.monotonic()
    trajectory = Trajectory(
        f"slime-{uuid.uuid4().hex[:12]}",
        task,
        trajectory_seed(sample, metadata, sampling_params),
        RolloutSettings(**options),
        Services.on(belayer, host_id),
        lambda: time.monotonic() - started,
    )
    result = await trajectory.run()

    prompt_ids = tokenizer.encode(task.prompt)
    response_ids = result.context_tokens[result.prompt_len :]
    done = result.status == "done"
    sample.tokens = prompt_ids + response_ids
    sample.response = tokenizer.decode(response_ids)
    sample.response_length = len(response_ids)
    sample.loss_mask = list(result.loss_mask) if done else [0] * len(response_ids)
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
