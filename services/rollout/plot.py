"""A batch's timelines as one PNG: a row per trajectory, its LLM turns, actions, checkpoints,
failures, recoveries and kills on a shared time axis (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from belayer_rl.services.rollout.agent import TimelineEntry

COLORS = {
    "turn": "tab:blue",
    "action": "tab:green",
    "checkpoint": "tab:orange",
    "checkpoint-failed": "tab:brown",
    "failure": "tab:red",
    "recovery": "tab:purple",
}


def read_timelines(folder: Path) -> dict[str, list[TimelineEntry]]:
    decoder = msgspec.json.Decoder(TimelineEntry)
    return {
        path.stem: [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
        for path in sorted(folder.glob("*.jsonl"))
    }


def plot_timelines(folder: Path, png: Path) -> int:
    """Draws every timeline of `folder` into `png`; returns how many trajectories were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.patches import Patch

    timelines = read_timelines(folder)
    if not timelines:
        raise SystemExit(f"no timelines (*.jsonl) in {folder}")
    figure, axis = plt.subplots(figsize=(12, 0.45 * len(timelines) + 1.5))
    for row, entries in enumerate(timelines.values()):
        for entry in entries:
            if entry.kind == "kill":
                axis.plot(entry.start_s, row, marker="x", color="black", markersize=8)
                continue
            # Checkpoints overlap turns: drawn as a thinner bar on top of them.
            on_top = entry.kind.startswith("checkpoint")
            axis.barh(row, max(entry.end_s - entry.start_s, 0.005), left=entry.start_s, height=0.3 if on_top else 0.6,
                      color=COLORS[entry.kind], zorder=3 if on_top else 2)  # fmt: skip
    axis.set_yticks(range(len(timelines)), list(timelines), fontsize=7)
    axis.invert_yaxis()
    axis.set_xlabel("seconds since the batch started")
    handles: list[Artist] = [Patch(color=color, label=kind) for kind, color in COLORS.items()]
    handles.append(axis.plot([], [], marker="x", color="black", linestyle="", label="kill")[0])
    axis.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=7, fontsize=8, frameon=False
    )
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return len(timelines)
