"""The GRPO objective against a direct, loop-by-loop computation of its formula, on a tiny batch:
value and gradient. Mutation checks show the comparison catches a wrong estimator."""

from __future__ import annotations

import math

import pytest
import torch

from belayer_rl.services.trainer.grpo import GrpoConfig, group_advantages, grpo_loss


def direct_loss(logp, old_logp, ref_logp, rewards, mask, group_size, cfg: GrpoConfig):
    """The docstring's formula written out with Python loops over samples and tokens."""
    B, T = logp.shape
    advantages = []
    for g in range(B // group_size):
        group = [float(r) for r in rewards[g * group_size : (g + 1) * group_size]]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (group_size - 1))
        advantages += [(r - mean) / (std + cfg.eps_adv) for r in group]
    total = torch.zeros(())
    n = 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            n += 1
            ratio = torch.exp(logp[i, t] - old_logp[i, t])
            a = advantages[i]
            clipped = torch.clamp(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
            term = -torch.minimum(ratio * a, clipped * a)
            if cfg.kl_beta:
                d = ref_logp[i, t] - logp[i, t]
                term = term + cfg.kl_beta * (torch.exp(d) - d - 1)
            total = total + term
    return total / n


def tiny_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T, G = 6, 5, 3
    logits = torch.randn(B, T, 4, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 4, (B, T), generator=gen)
    old_logp = torch.log_softmax(logits + 0.4 * torch.randn(B, T, 4, generator=gen, dtype=torch.float64), -1)
    old_logp = old_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_logp = old_logp + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # a short response
    mask[4, :2] = False
    return logits, targets, old_logp, ref_logp, rewards, mask, G


def loss_and_grad(fn, logits, targets):
    leaf = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(leaf, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = fn(logp)
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_loss_and_gradient_match_the_direct_computation(kl_beta: float) -> None:
    logits, targets, old_logp, ref_logp, rewards, mask, G = tiny_batch()
    cfg = GrpoConfig(eps_low=0.2, eps_high=0.28, kl_beta=kl_beta)
    advantages = group_advantages(rewards, G).double()

    def ours(logp):
        return grpo_loss(logp, old_logp, advantages, mask, int(mask.sum()), cfg, ref_logp).loss

    def direct(logp):
        return direct_loss(logp, old_logp, ref_logp, rewards, mask, G, cfg)

    loss, grad = loss_and_grad(ours, logits, targets)
    want_loss, want_grad = loss_and_grad(direct, logits, targets)
    assert torch.allclose(loss, want_loss, rtol=1e-6, atol=1e-9)
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-9)
    # Some tokens really are clipped in this batch, so the clip branch was exercised.
    parts = grpo_loss(
        torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        old_logp,
        advantages,
        mask,
        int(mask.sum()),
        cfg,
        ref_logp,
    )
    assert 0 < parts.clipped_tokens < int(mask.sum())

    # Mutations the comparison must catch: no clipping, a sequence-mean aggregation.
    unclipped = GrpoConfig(eps_low=0.999, eps_high=100.0, kl_beta=kl_beta)
    _, wrong_grad = loss_and_grad(
        lambda logp: grpo_loss(logp, old_logp, advantages, mask, int(mask.sum()), unclipped, ref_logp).loss,
        logits,
        targets,
    )
    assert not torch.allclose(wrong_grad, want_grad, rtol=1e-5, atol=1e-9)
    per_sequence, _ = loss_and_grad(
        lambda logp: (
            sum(
                grpo_loss(
                    logp[i : i + 1],
                    old_logp[i : i + 1],
                    advantages[i : i + 1],
                    mask[i : i + 1],
                    int(mask[i].sum()),
                    cfg,
                    ref_logp[i : i + 1],
                ).loss
                for i in range(len(logp))
            )
            / len(logp)
        ),
        logits,
        targets,
    )
    assert not torch.allclose(per_sequence, want_loss, rtol=1e-6, atol=1e-9)


def test_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)  # std 0.5
    assert torch.equal(adv[4:], torch.zeros(4))  # all equal: no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_a_non_finite_reward_makes_a_non_finite_loss() -> None:
    """What the actor checks before it steps: NaN in, NaN out, never silently zeroed."""
    logits, targets, old_logp, _, rewards, mask, G = tiny_batch()
    rewards[0] = float("nan")
    logp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    parts = grpo_loss(
        logp, old_logp, group_advantages(rewards, G).double(), mask, int(mask.sum()), GrpoConfig()
    )
    assert not torch.isfinite(parts.loss)
