"""The GRPO objective: group-normalised advantages and the clipped, optionally KL-regularised loss.

Pure tensor arithmetic: no model, no process groups, no bus. The trainer's actor ranks call
`grpo_loss` on their shard and divide by the token count of the whole batch, so the gradients
they all-reduce (sum) are the gradients of one loss over the global batch.

Notation, for the samples i = 1..G of one prompt and their response tokens t:

    r_i                 the sample's reward
    A_i   = (r_i - mean_j r_j) / (std_j r_j + eps_adv)        std: unbiased (n - 1), as torch.std
    rho_it = exp(logp_it - old_logp_it)                        old_logp: the generating version's
    L_clip_it = -min(rho_it * A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) * A_i)
    kl_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1     the k3 estimator of KL(pi || pi_ref)
    L = sum_it m_it * (L_clip_it + beta * kl_it) / N           m: response-token mask

N is the number of response tokens in the whole batch ("token-mean" aggregation: every token
weighs the same, so a long response does not count less per token than a short one). A group
whose rewards are all equal has A = 0 and adds only its KL term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from belayer_rl.shared.config import TrainerGroupConfig, same_as


@dataclass(frozen=True)
class GrpoConfig:
    eps_low: float = same_as(TrainerGroupConfig, "eps_low")
    # Asymmetric clip: a low-probability token may grow a little further.
    eps_high: float = same_as(TrainerGroupConfig, "eps_high")
    kl_beta: float = same_as(TrainerGroupConfig, "kl_beta")  # 0: no reference policy is consulted
    eps_adv: float = 1e-6

    def __post_init__(self) -> None:
        if not (0 < self.eps_low < 1 and self.eps_high > 0):
            raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got {self.eps_low}, {self.eps_high}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")


@dataclass(frozen=True)
class LossParts:
    """The terms of one shard's loss, each already summed over its tokens (divide by N to report)."""

    loss: torch.Tensor  # scalar, differentiable: sum_it m (L_clip + beta kl) / N
    clipped_tokens: int  # tokens whose ratio left [1 - eps_low, 1 + eps_high] and lost their gradient
    kl_sum: float  # sum_it m kl_it (0 when beta = 0 and no ref_logp was given)
    ratio_max: float


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [B] ordered group after group (B = n_prompts * group_size) -> advantages [B]."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size < 2:
        raise ValueError("GRPO needs at least 2 samples per group")
    grouped = rewards.view(-1, group_size).double()  # [P, G]
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True)  # unbiased
    return ((grouped - mean) / (std + eps)).view(-1).float()


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    total_tokens: int,
    config: GrpoConfig,
    ref_logp: torch.Tensor | None = None,
) -> LossParts:
    """logp, old_logp, ref_logp, mask [B, T] (response tokens of B samples); advantages [B].

    `logp` carries the gradient; the others are constants. `total_tokens` is N of the whole batch
    across every rank, so shards' losses add up to the batch's."""
    if total_tokens <= 0:
        raise ValueError("a batch needs at least one response token")
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp.detach())  # [B, T]
    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    kl_sum = 0.0
    if config.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs the reference policy's logp")
        # Masked before exp: at prompt and padding positions the two log-probs need not be close,
        # and exp of a large difference would be inf, and inf * 0 a NaN in the loss.
        delta = torch.where(mask.bool(), ref_logp.detach() - logp, torch.zeros_like(logp))
        kl = torch.exp(delta) - delta - 1  # [B, T], >= 0, 0 where masked
        per_token = per_token + config.kl_beta * kl
        kl_sum = float((kl.detach() * m).sum())
    # A token is clipped when the clipped branch is the one min() took and it is flat in rho.
    outside = (ratio < 1 - config.eps_low) | (ratio > 1 + config.eps_high)
    took_clipped = clipped < unclipped
    clipped_tokens = int(((outside & took_clipped) * mask.bool()).sum())
    masked_ratio = torch.where(mask.bool(), ratio.detach(), torch.zeros_like(ratio))
    return LossParts(
        loss=torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum() / total_tokens,
        clipped_tokens=clipped_tokens,
        kl_sum=kl_sum,
        ratio_max=float(masked_ratio.max()) if mask.any() else 1.0,
    )
