"""The actor: the policy's trainable weights, its optimizer and the GRPO update.

Blocking torch code; the trainer runs it in a thread. Log-probabilities are those of the policy
the engine samples from: at each response token, the softmax of the network's logits over the
token set its turn allowed (the engine's `allowed_tokens`; the whole vocabulary where a turn
allowed any). Old log-probabilities are recomputed here with the weights of the version that
generated each sample, never read back from the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from belayer_rl.services.trainer.grpo import GrpoConfig, grpo_loss
from belayer_rl.shared.config import TrainerGroupConfig, same_as
from belayer_rl.shared.model import sequence_logits
from belayer_rl.shared.params import Params, init_params
from belayer_rl.shared.presets import PRESETS, ModelConfig

# The built-in init makes logits peaked (std ~3) so that exactness tests depend on every token;
# a policy that starts that sure of itself never explores, and GRPO learns nothing from groups
# whose samples all agree. Training starts from the same init with its head scaled down.
EXPLORATION_HEAD_SCALE = 0.1


def initial_weights(preset: str, seed: int) -> Params:
    params = init_params(PRESETS[preset], seed)
    params["lm_head"] = params["lm_head"] * EXPLORATION_HEAD_SCALE
    return params


class DataParallel(Protocol):
    """What an update needs of its process group (services/trainer_group holds the gloo one)."""

    def sum(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        ...

    def passed(self) -> None:
        """One forward/backward pass done: progress for the hang detector."""
        ...


class NonFiniteUpdate(Exception):
    """A step produced a non-finite loss, gradient or weight; the actor is back where it was."""


@dataclass(frozen=True)
class ActorSettings:
    lr: float = same_as(TrainerGroupConfig, "lr")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # Passes over each batch: the second one sees ratios != 1 and clips.
    ppo_epochs: int = same_as(TrainerGroupConfig, "ppo_epochs")

    def __post_init__(self) -> None:
        if self.lr < 0 or self.grad_clip <= 0 or self.ppo_epochs < 1:
            raise ValueError(f"bad actor settings {self}")


@dataclass(frozen=True)
class Rollouts:
    """One step's samples, group after group (G consecutive samples share a prompt)."""

    tokens: torch.Tensor  # [B, S] int64: prompt then response, right-padded
    # [B, S-1] bool: True where the next token is one the model chose and is trained on (not a
    # prompt, observation or padding token).
    response_mask: torch.Tensor
    advantages: torch.Tensor  # [B]
    # [B, S-1] int64: the allowed set the next token was drawn from, 1-based into the task's
    # `allowed_sets`; 0 where any token was allowed (and at every position outside the mask).
    token_sets: torch.Tensor


def padded(
    sequences: list[list[int]],
    prompt_lens: list[int],
    loss_masks: list[list[int]],
    token_sets: list[list[int]],
    advantages: torch.Tensor,
) -> Rollouts:
    """Samples as right-padded tensors. Each sample is its prompt, then the rest (responses, and
    observations in a multi-turn sample); `loss_masks` and `token_sets` run over the rest."""
    length = max((len(x) for x in sequences), default=2)
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)  # [B, S]
    mask = torch.zeros(len(sequences), length - 1, dtype=torch.bool)  # [B, S-1]
    sets = torch.zeros(len(sequences), length - 1, dtype=torch.long)  # [B, S-1]
    for row, (sequence, prompt_len, loss_mask, token_set) in enumerate(
        zip(sequences, prompt_lens, loss_masks, token_sets, strict=True)
    ):
        rest = len(sequence) - prompt_len
        if not (prompt_len >= 1 and rest >= 0 and len(loss_mask) == rest == len(token_set)):
            raise ValueError(
                f"sample {row}: {len(sequence)} tokens, a prompt of {prompt_len}, a loss mask of"
                f" {len(loss_mask)} and {len(token_set)} token sets"
            )
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        trained = torch.tensor(loss_mask, dtype=torch.bool)
        mask[row, prompt_len - 1 : len(sequence) - 1] = trained
        # 0 off the mask: an observation token is in no set, and its log-prob must stay finite.
        sets[row, prompt_len - 1 : len(sequence) - 1] = torch.tensor(token_set) * trained
    return Rollouts(tokens, mask, advantages, sets)


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    kl: float  # mean k3 estimate per token (0 without a reference)
    clipped_fraction: float  # response tokens clipped, over every ppo epoch
    grad_norm: float
    ratio_max: float
    tokens: int


AllowedSets = tuple[tuple[int, ...], ...]


def token_logprobs(
    params: Params, config: ModelConfig, tokens: torch.Tensor, sets: AllowedSets, token_sets: torch.Tensor
) -> torch.Tensor:
    """log pi(token_{t+1} | tokens_{<=t}) for every position: tokens [B, S] -> [B, S-1].

    At a position whose `token_sets` entry is i > 0, pi is the softmax over `sets[i - 1]` only;
    at 0, over the whole vocabulary. Only positions whose target lies in its set are finite:
    the caller gives 0 at every position it does not train on."""
    logits = sequence_logits(params, config, tokens[:, :-1])  # [B, S-1, vocab]
    if sets:
        table = torch.ones(len(sets) + 1, config.vocab_size, dtype=torch.bool)  # [n + 1, vocab]
        for i, allowed in enumerate(sets, start=1):
            table[i] = False
            table[i, list(allowed)] = True
        logits = logits.masked_fill(~table[token_sets], float("-inf"))  # [B, S-1, vocab]
    targets = tokens[:, 1:].unsqueeze(-1)  # [B, S-1, 1]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


class Actor:
    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        settings: ActorSettings,
        grpo: GrpoConfig,
        sets: AllowedSets = (),
    ) -> None:
        self.config = config
        self.settings = settings
        self.grpo = grpo
        self.sets = sets  # the task's allowed token sets, as Rollouts.token_sets index them
        self.params = {name: t.detach().clone().requires_grad_(True) for name, t in params.items()}
        self.optimizer = torch.optim.AdamW(
            list(self.params.values()),
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )

    def weights(self) -> Params:
        """A detached copy: what is published and what old log-probs are later computed with."""
        return {name: t.detach().clone() for name, t in self.params.items()}

    def logprobs(self, params: Params, tokens: torch.Tensor, token_sets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(params, self.config, tokens, self.sets, token_sets)

    def update(
        self,
        batch: Rollouts,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None = None,
        *,
        dp: DataParallel | None = None,
        at: Callable[[str], None] | None = None,
    ) -> UpdateStats:
        """`settings.ppo_epochs` optimizer steps on the batch. Raises NonFiniteUpdate, with weights
        and optimizer state as they were, when any step goes non-finite.

        With `dp`, `batch` is this rank's shard: the loss is divided by the token count of the
        whole batch and the gradients are summed over the ranks before clipping, so every rank
        takes the same step as one process on the whole batch would (to float rounding).

        `at` (chaos) is told when the first epoch reaches "forward" (before its forward pass) and
        "backward" (inside its backward pass, from a gradient hook)."""
        before = (self.weights(), _clone_state(self.optimizer.state_dict()))
        local_tokens = torch.tensor([float(batch.response_mask.sum())])
        if dp is not None:
            dp.sum(local_tokens)
        total_tokens = int(local_tokens.item())
        losses, clipped, kl, norms, ratio_max = [], 0, 0.0, [], 1.0
        for epoch in range(self.settings.ppo_epochs):
            hook = None
            if at is not None and epoch == 0:
                at("forward")
                hook = next(iter(self.params.values())).register_hook(lambda grad: at("backward"))
            try:
                logp = token_logprobs(self.params, self.config, batch.tokens, self.sets, batch.token_sets)
                parts = grpo_loss(
                    logp, old_logp, batch.advantages, batch.response_mask, total_tokens, self.grpo, ref_logp
                )
                self.optimizer.zero_grad(set_to_none=True)
                parts.loss.backward()
            finally:
                if hook is not None:
                    hook.remove()
            terms = torch.tensor([float(parts.loss.detach()), parts.clipped_tokens, parts.kl_sum])
            if dp is not None:
                for name, t in self.params.items():
                    if t.grad is None:  # every rank must sum every gradient, or the collective hangs
                        raise RuntimeError(f"no gradient for {name} after the backward pass")
                    dp.sum(t.grad)
                dp.sum(terms)
                dp.passed()
            norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.settings.grad_clip)
            if not (bool(torch.isfinite(terms).all()) and torch.isfinite(norm)):
                self._restore(*before)
                raise NonFiniteUpdate(f"loss {float(terms[0])}, gradient norm {float(norm)}")
            self.optimizer.step()
            losses.append(float(terms[0]))
            clipped += int(terms[1])
            kl += float(terms[2])
            norms.append(float(norm))
            ratio_max = max(ratio_max, parts.ratio_max)
        bad = [name for name, t in self.params.items() if not bool(torch.isfinite(t).all())]
        if bad:
            self._restore(*before)
            raise NonFiniteUpdate(f"non-finite weights after the step: {bad[:3]}")
        epochs = self.settings.ppo_epochs
        return UpdateStats(
            loss=sum(losses) / epochs,
            kl=kl / (total_tokens * epochs),
            clipped_fraction=clipped / (total_tokens * epochs),
            grad_norm=sum(norms) / epochs,
            ratio_max=ratio_max,
            tokens=total_tokens,
        )

    def _restore(self, weights: Params, optimizer_state: dict) -> None:
        with torch.no_grad():
            for name, t in self.params.items():
                t.copy_(weights[name])
        self.optimizer.load_state_dict(optimizer_state)

    def state(self) -> dict[str, object]:
        return {"params": self.weights(), "optimizer": _clone_state(self.optimizer.state_dict())}

    def load_state(self, state: dict) -> None:
        self._restore(state["params"], state["optimizer"])


def _clone_state(state: dict) -> dict:
    """A deep copy of an optimizer state dict (its tensors cloned)."""
    return {
        "state": {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in state["state"].items()
        },
        "param_groups": [dict(g) for g in state["param_groups"]],
    }
