"""The `belayer` command: its global flags and its subcommands, each from a module of its own (up,
status, events, calls, creds, demo, chaos, policy, rollout, train, bench, sandbox, model).

Global flags (--state-dir, --nats) are accepted before or after the subcommand. Commands that only
talk to the bus (status, events, generate, down, --version) never import torch."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

from belayer_rl.cli import calls, compose_file, creds, events, status, up
from belayer_rl.cli.target import add_target_flags
from belayer_rl.shared.config import ConfigError, default_state_dir


def add_global_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--state-dir and --nats. The top-level parser holds their real defaults; every subcommand's
    parser has the same flags with default SUPPRESS, so they are accepted after the subcommand too,
    and a subcommand that did not see one leaves the value given before it alone (argparse copies
    what a subparser parsed over the top-level namespace)."""
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir() if defaults else argparse.SUPPRESS,
        help="local cluster state (default .belayer, or $BELAYER_STATE_DIR)",
    )
    parser.add_argument(
        "--nats",
        default=None if defaults else argparse.SUPPRESS,
        help="NATS URL of an external cluster (or $BELAYER_NATS_URL)",
    )
    add_target_flags(parser, defaults=defaults)


class SubcommandParser(argparse.ArgumentParser):
    """The parser of every subcommand, at any depth: add_subparsers makes each nested parser of its
    parent's class, so the global flags reach the parsers the cli modules add without their help."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_global_flags(self, defaults=False)


def installed_version() -> str:
    try:
        return importlib.metadata.version("belayer-rl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (belayer-rl is not installed)"


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """`benchmarks=False` gives `bench` its name and help but not its subcommands, whose modules
    import torch; main() asks for them only when the command line names `bench`."""
    parser = argparse.ArgumentParser(prog="belayer", description="Fault tolerance for agentic RL rollouts.")
    add_global_flags(parser, defaults=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for module in (up, status, events, calls, creds):
        module.add_parser(commands)

    from belayer_rl.cli import bench, demo
    from belayer_rl.cli import model as model_cli
    from belayer_rl.cli import policy as policy_cli
    from belayer_rl.cli import rollout as rollout_cli
    from belayer_rl.cli import train as train_cli
    from belayer_rl.cli.chaos import campaign as chaos

    demo.add_parser(commands)
    chaos.add_parser(commands)
    policy_cli.add_parser(commands)
    rollout_cli.add_parser(commands)
    train_cli.add_parser(commands)
    bench.add_parser(commands, with_kinds=benchmarks)
    from belayer_rl.cli import sandbox as sandbox_cli

    sandbox_cli.add_parser(commands)
    compose_file.add_parser(commands)
    model_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Only a command line that names `bench` can run a benchmark (subcommands are never abbreviated);
    # every other command is spared the import of torch its parsers bring.
    args = build_parser(benchmarks="bench" in argv).parse_args(argv)
    try:
        sys.exit(args.run(args))
    except ConfigError as exc:
        print(f"belayer: {exc}", file=sys.stderr)
        sys.exit(2)
