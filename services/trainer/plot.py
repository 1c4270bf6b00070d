"""The reward curve of a training run as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from belayer_rl.shared.protocol import TrainerStep


def plot_rewards(steps: list[TrainerStep], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s.step for s in steps], [s.reward_mean for s in steps], label="mean reward", color="tab:blue")
    resumed = [s for s in steps if s.resumes]
    if resumed:
        ax.scatter([s.step for s in resumed], [s.reward_mean for s in resumed], color="tab:red",
                   label="step with resumed generations", zorder=3)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
