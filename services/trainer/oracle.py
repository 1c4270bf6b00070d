"""The training oracle: a run that suffered faults against its fault-free twin.

Each step a run trains on is recorded (`samples.jsonl` in its folder, one `TrainedStep` a line,
appended as the step is applied): the samples in the order they were trained, each with its
trajectory's tokens, actions, observations, reward and infrastructure error. A step replayed after
a reschedule from a checkpoint is recorded again; the later record is the one the weights carry.

`compare` then requires, step by step, the same samples in the same order, each with the same
record: nothing trained twice, nothing skipped, no reward or observation that differs, and no
trajectory that ended as an infrastructure error in one run only. The weights and the AdamW state
are compared by the caller, from the groups' state files (`same_state`).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from belayer_rl.services.trainer import checkpoint

RECORD = "samples.jsonl"


class TrainedSample(msgspec.Struct, frozen=True, kw_only=True):
    item: str
    trajectory: str  # its id ("" for a single-turn sample)
    tokens: list[int]  # the prompt, then every token after it
    actions: list[str]
    observations: list[str]
    reward: float
    error: str  # the trajectory's infrastructure error ("": none)


class TrainedStep(msgspec.Struct, frozen=True, kw_only=True):
    step: int  # 0-based: the step these samples were trained in
    weight_version: str  # the version they were generated on
    samples: list[TrainedSample]


def lineage(folder: Path) -> dict[int, TrainedStep]:
    """The steps the final weights carry: the latest record of each step (none, for a run that
    trained none: it has no record)."""
    decoder = msgspec.json.Decoder(TrainedStep)
    steps: dict[int, TrainedStep] = {}
    path = folder / RECORD
    if not path.exists():
        return steps
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            step = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{path}:{number}: not a trained step: {exc}") from None
        # A replay drops every step after the one it restarts from.
        steps = {k: v for k, v in steps.items() if k < step.step}
        steps[step.step] = step
    return steps


def compare(faulty: Path, twin: Path, through: int | None = None) -> list[str]:
    """What differs between the steps `faulty` and `twin` trained on ([] when nothing); with
    `through`, between their first `through` steps (a twin of a run's beginning)."""
    ours, theirs = lineage(faulty), lineage(twin)
    if through is not None:
        ours = {k: v for k, v in ours.items() if k < through}
        theirs = {k: v for k, v in theirs.items() if k < through}
    found = []
    if sorted(ours) != sorted(theirs):
        found.append(f"steps trained: {sorted(ours)} against the twin's {sorted(theirs)}")
    for number in sorted(set(ours) & set(theirs)):
        a, b = ours[number].samples, theirs[number].samples
        ids_a, ids_b = [s.trajectory or s.item for s in a], [s.trajectory or s.item for s in b]
        twice = sorted({i for i in ids_a if ids_a.count(i) > 1})
        if twice:
            found.append(f"step {number}: trained twice: {twice}")
        missing = sorted(set(ids_b) - set(ids_a))
        if missing:
            found.append(f"step {number}: skipped: {missing}")
        if ids_a != ids_b and not twice and not missing:
            found.append(f"step {number}: the samples in another order")
        for x, y in zip(a, b, strict=False):
            if x == y:
                continue
            what = [f for f in TrainedSample.__struct_fields__ if getattr(x, f) != getattr(y, f)]
            if bool(x.error) != bool(y.error):
                what.append("an infrastructure error in one run only")
            found.append(f"step {number}: {x.trajectory or x.item}: its {', '.join(what)} differ")
    return found


def state_of(state_file: Path) -> dict[str, torch.Tensor]:
    """A group's state file as flat tensors: the weights, the AdamW slots and the step."""
    return flat(checkpoint.read(state_file))


def flat(state: dict) -> dict[str, torch.Tensor]:
    """A group's state (what its state file holds) as flat tensors."""
    tensors = {f"param.{k}": v for k, v in state["actor"]["params"].items()}
    for index, slots in state["actor"]["optimizer"]["state"].items():
        for name, value in slots.items():
            tensors[f"opt.{index}.{name}"] = torch.as_tensor(value)
    tensors["step"] = torch.tensor(state["step"])
    return tensors


def same_tensors(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def same_state(a: Path, b: Path) -> bool:
    """Whether two state files hold bitwise the same weights, AdamW state and step."""
    return same_tensors(state_of(a), state_of(b))


def same_checkpoint(a: Path, b: Path) -> bool:
    """Whether two trainer checkpoints of group-mode runs (their group's state inside) hold bitwise
    the same weights, AdamW state and step."""
    return same_tensors(flat(checkpoint.read(a)["actor"]), flat(checkpoint.read(b)["actor"]))
