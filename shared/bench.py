"""`belayer bench ...`: benchmark commands (filled in below)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = commands.add_parser("bench", help="benchmarks")
    bench.set_defaults(run=lambda args: 0)
