"""`belayer bench <what>`: benchmark commands. Each prints its figure and its baseline from the same
run, as JSON (--json) or a readable table (cli/bench_report.py)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction, with_kinds: bool = True) -> None:
    """`with_kinds=False` registers the command's name and help only: the benchmarks' modules import
    torch, which a command line that does not run a benchmark should not pay for (cli/main.py)."""
    bench = commands.add_parser("bench", help="benchmarks: figure and baseline from the same run")
    if not with_kinds:
        return
    kinds = bench.add_subparsers(dest="bench", required=True)
    from belayer_rl.cli import bench_rollout

    bench_rollout.add_parser(kinds)
    from belayer_rl.cli import bench_handover

    bench_handover.add_parser(kinds)
    from belayer_rl.cli import bench_checkpoint as checkpoint_bench

    checkpoint_bench.add_parser(kinds)
    from belayer_rl.cli import bench_env_recovery

    bench_env_recovery.add_parser(kinds)
    from belayer_rl.cli import bench_train_recovery

    bench_train_recovery.add_parser(kinds)
    from belayer_rl.cli import bench_sync

    bench_sync.add_parser(kinds)
    from belayer_rl.cli import bench_takeover

    bench_takeover.add_parser(kinds)
    from belayer_rl.cli import bench_gateway

    bench_gateway.add_parser(kinds)
    from belayer_rl.cli import bench_vllm_resume

    bench_vllm_resume.add_parser(kinds)
