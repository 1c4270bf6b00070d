"""`belayer bench sync` runs end to end at its smallest size and reports each figure with and
without syncing, and their ratio (the figures themselves are the benchmark's, not the test's)."""

from __future__ import annotations

import argparse

from belayer_rl.cli.bench_sync import bench, print_table


async def test_bench_sync_reports_both_settings(capsys) -> None:  # type: ignore[no-untyped-def]
    args = argparse.Namespace(rounds=1, publishes=20, in_flight=8, requests=1, max_tokens=4, preset="tiny")
    report = await bench(args)
    for key in ("acknowledged_one_at_a_time", "acknowledged_in_flight", "rollout"):
        figure = report[key]
        assert figure["always"]["median"] > 0 and figure["default"]["median"] > 0, figure
        assert figure["ratio_always_to_default"] > 0
    print_table(report)
    assert "ratio" in capsys.readouterr().out
