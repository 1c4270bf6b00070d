"""Shared helpers for engine tests (plain functions; fixtures live in conftest.py)."""

from collections.abc import Hashable

from belayer_rl.services.worker.engine import Engine


def drain(engine: Engine, max_steps: int = 10_000) -> dict[Hashable, tuple[list[int], str]]:
    """Step until idle; key -> (new tokens in order, finish reason). Checks event invariants."""
    out: dict[Hashable, list[int]] = {}
    first: dict[Hashable, int] = {}
    reasons: dict[Hashable, str] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for ev in engine.step():
            assert ev.key not in reasons, f"event for {ev.key!r} after it finished"
            toks = out.setdefault(ev.key, [])
            first.setdefault(ev.key, ev.position)
            assert ev.position == first[ev.key] + len(toks), "positions must be contiguous"
            toks += ev.new_tokens
            if ev.finished is not None:
                reasons[ev.key] = ev.finished
    assert not engine.has_work(), "engine did not go idle"
    assert set(reasons) == set(out)
    return {k: (out[k], reasons[k]) for k in out}
