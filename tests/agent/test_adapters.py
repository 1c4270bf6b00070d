"""The verl and slime examples (examples/verl, examples/slime) driven exactly as those frameworks call
them, on a real cluster (tests/agent/conftest.py). verl is the real package (0.9.1, the `verl`
extra): its AgentLoopBase, its registry, its AgentLoopOutput (a pydantic model that checks what it
is given) and its config wrappers. slime is not in the package registry (another package owns the
name), so its Sample is a stand-in that mirrors only what the quoted signature takes and returns.

- verl: an instance of BelayerAgentLoop built with the keywords verl's hydra passes, then
  `await loop.run(sampling_params, **dataset_row)`; the output's response ids are the context tokens
  after the prompt of a direct Trajectory(...).run() of the same task and seed, the response mask is 0
  on exactly the observation tokens, the response logprobs are the trajectory's, and the reward is
  propagated.
- slime: `await generate(args, sample, sampling_params)`; the same comparison on Sample's tokens,
  response, response_length, loss_mask, reward and status.
- An infrastructure error (an action OOM-killed, no recovery allowed) is verl's aborted output (fully
  masked) and slime's Status.ABORTED, never a normal finish.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from argparse import Namespace
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopOutput,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)

from belayer_rl.services.rollout.adapter import close_clients
from belayer_rl.services.rollout.agent import RolloutSettings, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.workloads import response_tokens, shell_tasks
from belayer_rl.shared import tokenizer
from tests.agent.conftest import AgentCluster
from tests.support import load_example

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# One short shell task; its check passes, so a propagated reward reads 1.0, not a default.
TASK = dataclasses.replace(shell_tasks(1, turns=2, action_s=0.0)[0], check="test -f /tmp/task/notes.txt")
SEED = 31337
TEMPERATURE = 0.8
SPEC = {
    "task_id": TASK.task_id,
    "max_turns": TASK.max_turns,
    "setup": TASK.setup,
    "check": TASK.check,
    "menu": list(TASK.menu),  # a list, as it comes out of a JSON or parquet dataset
}
HOG = {**SPEC, "task_id": "hog", "menu": ["memhold 400"]}  # every action past the setup is OOM-killed
OOM_SETTINGS = {"max_recoveries": 0, "memory_mb": 64}


verl_example = load_example("belayer_example_verl", EXAMPLES / "verl" / "belayer_agent_loop.py")
slime_example = load_example("belayer_example_slime", EXAMPLES / "slime" / "belayer_rollout.py")


# ---------------------------------------------------------------- a stand-in for slime's type


class Sample:
    """slime's Sample: the fields a custom generate function reads and fills."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    def __init__(self, index: int, prompt: str, metadata: dict[str, Any]) -> None:
        self.group_index, self.index, self.prompt, self.metadata = 0, index, prompt, metadata
        self.tokens: list[int] = []
        self.response, self.response_length = "", 0
        self.reward: float | None = None
        self.loss_mask: list[int] | None = None
        self.status = Sample.Status.PENDING
        self.remove_sample = False


def verl_loop(ac: AgentCluster, **settings: object) -> Any:
    """The loop as verl 0.9.1's hydra builds it (AgentLoopWorker): verl's keywords, then
    agent_loop.yaml's. It is registered in verl's own registry under its name."""
    assert "belayer" in _agent_loop_registry
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 8192}}})
    return verl_example.BelayerAgentLoop(
        trainer_config=DictConfigWrap(config=config),
        server_manager=None,
        tokenizer=None,
        processor=None,
        hf_model_type=None,
        dataset_cls=None,
        data_config=DictConfigWrap(OmegaConf.create({})),
        tools=ToolListWrap([]),
        name="belayer",
        belayer_url=ac.cluster.nats.url,
        host_id=ac.host_id,
        rollout_settings={"consult_every_s": 0.2, **settings},
    )


def verl_row(spec: dict[str, Any]) -> dict[str, Any]:
    """A dataset row as verl's RLHFDataset hands it to `run` (with return_raw_chat)."""
    messages = [{"role": "user", "content": TASK.prompt}]
    return {
        "data_source": "belayer/shell",
        "prompt": messages,
        "ability": "shell",
        "reward_model": {"style": "rule", "ground_truth": ""},
        "extra_info": {"index": 0, "belayer_task": spec, "belayer_seed": SEED},
        "raw_prompt": messages,
        "index": 0,
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "uid": str(uuid.uuid4()),
    }


def slime_args(ac: AgentCluster, **settings: object) -> Namespace:
    return Namespace(
        belayer_url=ac.cluster.nats.url,
        belayer_host_id=ac.host_id,
        belayer_settings={"consult_every_s": 0.2, **settings},
        custom_generate_function_path="belayer_rollout.generate",
    )


# slime's GenerateState.sampling_params for a rollout (what generate_and_rm passes on)
SLIME_SAMPLING = {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8192}


async def direct(ac: AgentCluster) -> TrajectoryResult:
    settings = RolloutSettings(host_id=ac.host_id, temperature=TEMPERATURE, consult_every_s=0.2)
    started = time.monotonic()
    trajectory = Trajectory(
        f"ref-{uuid.uuid4().hex[:8]}", TASK, SEED, settings, ac.services, lambda: time.monotonic() - started
    )
    result = await trajectory.run()
    assert result.status == "done", result.error
    return result


def expected_mask(result: TrajectoryResult) -> list[int]:
    """Worked out apart from the adapters: the setup's observation, then for each turn t (after t + 1
    actions) the scripted agent's response of response_tokens(seed, t + 1) tokens and its observation."""
    observations = [tokenizer.encode(o) for o in result.observations]
    mask = [0] * len(observations[0])
    for k, seen in enumerate(observations[1:], start=1):
        mask += [1] * response_tokens(SEED, k) + [0] * len(seen)
    return mask


async def test_verl_and_slime_adapters_run_belayer_trajectories(agent_cluster: AgentCluster) -> None:
    ac = agent_cluster
    reference = await direct(ac)
    prompt_ids = tokenizer.encode(TASK.prompt)
    assert reference.context_tokens[: len(prompt_ids)] == prompt_ids
    response = reference.context_tokens[len(prompt_ids) :]
    mask = expected_mask(reference)
    assert len(mask) == len(response) and len(reference.observations) == TASK.max_turns + 1
    assert reference.reward == 1.0

    try:
        # ---- verl: AgentLoopBase.run(sampling_params, **kwargs) -> AgentLoopOutput
        sampling = {"temperature": TEMPERATURE, "top_p": 1.0, "repetition_penalty": 1.0, "logprobs": False}
        out = await verl_loop(ac).run(sampling_params=sampling, **verl_row(SPEC))
        assert isinstance(out, AgentLoopOutput)  # verl's own, a pydantic model that checks its fields
        assert out.prompt_ids == prompt_ids
        assert out.response_ids == response
        assert out.response_mask == mask
        assert out.response_logprobs == reference.logprobs and len(out.response_logprobs) == len(response)
        assert out.reward_score == reference.reward
        assert out.num_turns == 2 * len(reference.observations)
        assert out.extra_fields["rollout_status"] == "completed" and out.extra_fields["belayer_error"] == ""

        # ---- slime: generate(args, sample, sampling_params) -> Sample
        sample = Sample(0, TASK.prompt, {"belayer_task": SPEC, "belayer_seed": SEED})
        done = await slime_example.generate(slime_args(ac), sample, dict(SLIME_SAMPLING))
        assert done is sample
        assert done.status == Sample.Status.COMPLETED and not done.remove_sample
        assert done.tokens == reference.context_tokens
        assert done.response_length == len(response) and done.response == tokenizer.decode(response)
        assert done.loss_mask == mask
        assert done.reward == reference.reward
        assert done.metadata["belayer"]["status"] == "done"

        # ---- an infrastructure error: the frameworks' aborted status, never a normal finish
        hog = verl_row(HOG)
        out = await verl_loop(ac, **OOM_SETTINGS).run(sampling_params=sampling, **hog)
        assert out.extra_fields["rollout_status"] == "aborted"
        assert "oom" in out.extra_fields["belayer_error"].lower(), out.extra_fields["belayer_error"]
        assert set(out.response_mask) <= {0} and out.reward_score == 0.0
        assert len(out.response_mask) == len(out.response_ids) > 0

        sample = Sample(1, TASK.prompt, {"belayer_task": HOG, "belayer_seed": SEED})
        failed = await slime_example.generate(slime_args(ac, **OOM_SETTINGS), sample, dict(SLIME_SAMPLING))
        assert failed.status == Sample.Status.ABORTED and failed.remove_sample
        assert failed.loss_mask == [0] * failed.response_length and failed.response_length > 0
        assert failed.reward == 0.0
        assert "oom" in failed.metadata["belayer"]["error"].lower(), failed.metadata["belayer"]
    finally:
        await close_clients()
