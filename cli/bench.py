"""`belayer bench <what>`: benchmark commands. Each prints its figure and its baseline from the same
run, as JSON (--json) or a readable table (cli/bench_report.py)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser("bench", help="benchmarks: figure and baseline from the same run")
    kinds = bench.add_subparsers(dest="bench", required=True)
    from belayer_rl.cli import bench_rollout

    bench_rollout.add_parser(kinds)
    from belayer_rl.cli import bench_handover

    bench_handover.add_parser(kinds)
    from belayer_rl.cli import bench_checkpoint as checkpoint_bench

    checkpoint_bench.add_parser(kinds)
