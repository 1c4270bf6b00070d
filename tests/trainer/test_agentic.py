"""The agentic workload, piece by piece: a turn's allowed token set from the engine's draw to the
trainer's log-probs, the lookup trajectory's record (its loss mask, its sets, its reward from the
sandbox's check), and a broken task ending as an infrastructure error, never as a reward. The
trajectories run on a real cluster (router, tiny worker) with their actions in scratch folders;
test_agentic_training.py runs them in the checkpointer's Docker sandboxes and trains on them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.local_sandbox import LocalSandboxes
from belayer_rl.services.rollout.workloads import (
    DIGIT_TOKENS,
    LOOKUP_MENU,
    MENU_TOKENS,
    check_score,
    lookup_task,
)
from belayer_rl.services.trainer.actor import initial_weights, padded, token_logprobs
from belayer_rl.services.trainer.tasks import Lookup
from belayer_rl.services.trainer.trainer import StepResult, Trainer, TrainSettings
from belayer_rl.shared import tokenizer
from belayer_rl.shared.model import sequence_logits
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import SandboxSpec
from tests.support import Cluster

SETS = (MENU_TOKENS, DIGIT_TOKENS)


def test_each_position_draws_from_its_own_set() -> None:
    """token_logprobs at a position of set i is log softmax over set i's logits alone; at set 0,
    over the vocabulary. Checked against the direct computation, and shown to tell the sets apart
    (scoring every position under one set gives other numbers)."""
    config = PRESETS["tiny"]
    params = initial_weights("tiny", 3)
    prompt = tokenizer.encode("find the code\n")
    rest = [MENU_TOKENS[2], *tokenizer.encode("hello\n"), DIGIT_TOKENS[4], DIGIT_TOKENS[7]]
    loss_mask = [1] + [0] * 6 + [1, 1]
    sets = [1] + [0] * 6 + [2, 2]
    batch = padded([prompt + rest], [len(prompt)], [loss_mask], [sets], torch.zeros(1))
    logp = token_logprobs(params, config, batch.tokens, SETS, batch.token_sets)[0]  # [S-1]

    logits = sequence_logits(params, config, batch.tokens[:, :-1])[0]  # [S-1, vocab]
    for offset, (bit, set_id) in enumerate(zip(loss_mask, sets, strict=True)):
        at = len(prompt) - 1 + offset  # the position whose next token is rest[offset]
        allowed = list(SETS[set_id - 1]) if set_id else list(range(config.vocab_size))
        direct = torch.log_softmax(logits[at, allowed], dim=-1)[allowed.index(rest[offset])]
        assert torch.allclose(logp[at], direct, atol=1e-5), (offset, bit)
    one_set = token_logprobs(params, config, batch.tokens, (DIGIT_TOKENS,), batch.token_sets.clamp(max=1))[0]
    assert not torch.allclose(one_set[len(prompt) - 1], logp[len(prompt) - 1])  # the menu token's
    # An observation token is never in a set: it stays at 0 whatever the caller says.
    wrong = padded([prompt + rest], [len(prompt)], [loss_mask], [[2] * len(rest)], torch.zeros(1))
    assert int(wrong.token_sets[0, len(prompt)]) == 0  # the first observation token's position
    with pytest.raises(ValueError, match="loss mask"):
        padded([prompt + rest], [len(prompt)], [loss_mask[:-1]], [sets], torch.zeros(1))


async def lookup(
    cluster: Cluster, sandboxes: LocalSandboxes, code: str, seed: int, **settings: object
) -> TrajectoryResult:
    options = {"host_id": "local", "policy": "never", "fallback_policy": "never", "scripted": False}
    started = time.monotonic()
    return await Trajectory(
        trajectory_id=f"lookup-{code}-{seed}",
        task=lookup_task(code),
        seed=seed,
        settings=RolloutSettings(**(options | settings)),  # type: ignore[arg-type]
        services=Services.on(cluster.client, "local", local=sandboxes),
        clock=lambda: time.monotonic() - started,
    ).run()


async def test_a_lookup_trajectory_records_its_turns_and_is_rewarded_by_the_check(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    sandboxes = LocalSandboxes(tmp_path / "sandboxes")
    code = "042"
    prompt = tokenizer.encode(lookup_task(code).prompt)
    actions = set()
    for seed in range(12):
        result = await lookup(train_cluster, sandboxes, code, seed, temperature=1.0)
        assert result.status == "done", result.error
        assert result.turn_sets == [list(MENU_TOKENS), list(DIGIT_TOKENS)]
        # The prompt, one menu token, the action's observation, three digits, the check's observation.
        choice, rest = result.context_tokens[len(prompt)], result.context_tokens[len(prompt) + 1 :]
        action = LOOKUP_MENU[MENU_TOKENS.index(choice)]
        actions.add(action)
        assert result.actions[:2] == [lookup_task(code).setup, action]
        assert result.observations[0] == ""  # the setup names the code: the agent never sees it
        seen = result.observations[1]
        assert seen == (f"{code}\n" if action != "wc -c code" else "4 code\n"), (action, seen)
        observed = tokenizer.encode(seen)
        answer = rest[len(observed) : len(observed) + 3]
        assert all(t in DIGIT_TOKENS for t in answer)
        assert result.actions[2] == f"sh check.sh {tokenizer.decode(answer)}"
        assert result.loss_mask == [1] + [0] * len(observed) + [1, 1, 1] + [0] * (
            len(rest) - len(observed) - 3
        )
        assert result.token_sets == [1] + [0] * len(observed) + [2, 2, 2] + [0] * (
            len(rest) - len(observed) - 3
        )
        given = tokenizer.decode(answer)
        assert result.reward == sum(a == b for a, b in zip(given, code, strict=True)) / 3
        assert result.reward == Lookup().reward(code, result.context_tokens[len(prompt) :])
    assert len(actions) >= 2, actions  # the model's token picks the action
    # The check is the judge: only the exact answer scores 1 and passes.
    await sandboxes.create(SandboxSpec(image="local"), sandbox="judge")
    await sandboxes.exec("judge", lookup_task(code).setup)
    for answer, score, exit_code in (
        ("042", 1.0, 0),
        ("043", 2 / 3, 1),
        ("'042 '", 3 / 4, 1),
        ("''", 0.0, 1),
    ):
        verdict = await sandboxes.exec("judge", f"sh check.sh {answer}")
        assert (check_score(verdict.stdout), verdict.exit_code) == (score, exit_code), answer


async def test_a_broken_task_ends_as_an_infrastructure_error_never_a_reward(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    sandboxes = LocalSandboxes(tmp_path / "sandboxes")
    settings = RolloutSettings(host_id="local", policy="never", fallback_policy="never", action_timeout_s=1.0)
    services = Services.on(train_cluster.client, "local", local=sandboxes)
    broken_setup = dataclasses.replace(lookup_task("123"), setup="echo no disk >&2; exit 3")
    endless_check = dataclasses.replace(lookup_task("123"), check="sleep 30; true")
    started = time.monotonic()
    for task, why in (
        (broken_setup, "the task's setup failed (exit 3): 'no disk\\n'"),
        (endless_check, "did not end"),
    ):
        result = await Trajectory(
            task.task_id, task, 1, settings, services, lambda: time.monotonic() - started
        ).run()
        assert (result.status, result.reward) == ("infra-error", 0.0), result
        assert why in result.error, result.error


async def test_held_out_accuracy_counts_exact_codes_only(train_cluster: Cluster, tmp_path: Path) -> None:
    """The trainer's accuracy on lookup is the exact-match rate of greedy trajectories, not their
    mean partial reward: on codes where the untrained policy gets some digits right but none whole,
    it is 0 while the mean reward is not."""
    task = Lookup()
    rollout = RolloutSettings(host_id="local", policy="never", fallback_policy="never", scripted=False)
    settings = TrainSettings(run="acc", steps=0, rollout=rollout)
    trainer = Trainer(train_cluster.client, task, settings, sandboxes=LocalSandboxes(tmp_path / "sandboxes"))
    await trainer.publish()
    items = task.held_out[:16]
    greedy = [
        await trainer.trajectory(f"check-{item}", task, item, 0, trainer.version, greedy=True).run()
        for item in items
    ]
    exact = sum(r.reward == 1.0 for r in greedy) / len(items)
    mean_reward = sum(r.reward for r in greedy) / len(items)
    assert exact != mean_reward, (exact, mean_reward)  # partial credit among them: the two differ
    assert await trainer.accuracy(items) == exact


async def test_the_update_counts_only_the_models_tokens(train_cluster: Cluster, tmp_path: Path) -> None:
    """Two inline steps on lookup trajectories: the actor trains on exactly the tokens the model
    chose (one menu token and three digits a trajectory), none of the observations'."""
    task = Lookup()
    rollout = RolloutSettings(host_id="local", policy="never", fallback_policy="never", scripted=False)
    settings = TrainSettings(run="inline", steps=2, prompts_per_step=4, group_size=4, seed=2, rollout=rollout)
    trainer = Trainer(train_cluster.client, task, settings, sandboxes=LocalSandboxes(tmp_path / "sandboxes"))
    results: list[StepResult] = []
    await trainer.run(results.append)
    assert [r.event.step for r in results] == [1, 2]
    for result in results:
        observed = sum(len(x.answer) - sum(x.loss_mask) for x in result.samples)
        assert observed > 0  # observation tokens were in the samples...
        assert result.stats.tokens == 4 * len(result.samples)  # ...and out of the loss
        assert all(x.trajectory is not None and x.trajectory.status == "done" for x in result.samples)
