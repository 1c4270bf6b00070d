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


def plot_reward_curves(curves: dict[str, list[float]], png: Path, title: str) -> None:
    """Several runs' mean reward by step on one plot (`curves`: run -> each step's mean reward, in
    the order trained), so that a faulted run's curve reads against its failure-free one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, rewards in curves.items():
        # The failure-free curve solid and wide, the faulted ones dashed over it: where a fault
        # changes nothing, the curves lie on one another and the black shows through the dashes.
        if name == "failure-free":
            ax.plot(range(1, len(rewards) + 1), rewards, label=name, color="black", linewidth=3.0)
        else:
            ax.plot(range(1, len(rewards) + 1), rewards, label=name, linewidth=1.2, linestyle="--")
    ax.set_xlabel("step trained (a step done again counts twice)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
