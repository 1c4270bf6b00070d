"""`belayer demo`: agentic RL training under a fault in every layer, checked against its fault-free
twin (training.py); `belayer demo generation`: one generation streamed through a worker killed
mid-stream (generation.py)."""

from __future__ import annotations

import argparse

from belayer_rl.cli.demo import generation, training


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo", help="GRPO on an agentic task under a fault in every layer, against its fault-free twin"
    )
    training.add_flags(demo)
    demo.set_defaults(run=training.run)
    kinds = demo.add_subparsers(dest="demo", metavar="{generation}", title="other demos")
    generation.add_parser(kinds)
