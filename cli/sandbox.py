"""`belayer sandbox create|exec|checkpoint|restore|ls|rm`: drive sandboxes by hand against a running
cluster, for users debugging an environment and for scripted checks (`--json` prints the reply).

Wired into the `belayer` command by `add_parser(commands)`; also runs alone as
`python -m belayer_rl.cli.sandbox [--nats URL] <verb> ...`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.target import add_target_flags, resolve_target
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import ConfigError, default_state_dir, hostname_id
from belayer_rl.shared.protocol import ExecResult, Message, SandboxSpec


def sandbox_options(*, defaults: bool) -> argparse.ArgumentParser:
    """--host and --json, for `sandbox` (real defaults) and each verb (default SUPPRESS, so that
    `sandbox exec S CMD --json` works and a verb that did not see a flag keeps the value given
    before it). Built afresh per use: parents share their actions, and with them the defaults."""
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--host",
        default=hostname_id() if defaults else argparse.SUPPRESS,
        help="checkpointer host id (default: hostname)",
    )
    options.add_argument(
        "--json",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="print the reply as JSON",
    )
    return options


def add_parser(commands: argparse._SubParsersAction) -> None:
    sandbox = commands.add_parser(
        "sandbox", help="drive sandboxes of a checkpointer by hand", parents=[sandbox_options(defaults=True)]
    )
    verbs = sandbox.add_subparsers(dest="verb", required=True)
    verb_options = [sandbox_options(defaults=False)]

    create = verbs.add_parser("create", help="create a sandbox from a local image", parents=verb_options)
    create.add_argument("image")
    create.add_argument("--name", default="", help="sandbox id (default: generated)")
    create.add_argument("--memory-mb", type=int, default=1024)
    create.add_argument("--pids-limit", type=int, default=512)
    create.add_argument("--network", action="store_true", help="attach to the default bridge network")
    create.add_argument("--cap-add", action="append", default=[], help="a capability to keep (repeatable)")
    create.add_argument(
        "--user", default="", help="name, uid or uid:gid that runs the actions (default: the image's USER)"
    )

    exec_ = verbs.add_parser("exec", help="run one action: /bin/sh -c COMMAND", parents=verb_options)
    exec_.add_argument("sandbox")
    exec_.add_argument("command")
    exec_.add_argument("--timeout", type=float, default=60.0, help="seconds before the action is killed")

    checkpoint = verbs.add_parser(
        "checkpoint", help="full checkpoint at action boundary k", parents=verb_options
    )
    checkpoint.add_argument("sandbox")
    checkpoint.add_argument("trajectory")
    checkpoint.add_argument("k", type=int)
    checkpoint.add_argument("--context-ref", default="", help="a reference to the LLM context L_k")
    checkpoint.add_argument("--tokens", default="", help="L_k as comma-separated token ids")

    restore = verbs.add_parser(
        "restore", help="restore a trajectory's sandbox from its latest checkpoint", parents=verb_options
    )
    restore.add_argument("trajectory")

    verbs.add_parser("ls", help="list the host's sandboxes", parents=verb_options)
    rm = verbs.add_parser("rm", help="destroy a sandbox", parents=verb_options)
    rm.add_argument("sandbox")
    sandbox.set_defaults(run=run)


async def call(args: argparse.Namespace, client: SandboxClient) -> Message:
    if args.verb == "create":
        spec = SandboxSpec(
            image=args.image, memory_mb=args.memory_mb, pids_limit=args.pids_limit,
            network=args.network, cap_add=args.cap_add, user=args.user,
        )  # fmt: skip
        return await client.create(spec, sandbox=args.name)
    if args.verb == "exec":
        return await client.exec(args.sandbox, args.command, timeout_s=args.timeout)
    if args.verb == "checkpoint":
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        return await client.checkpoint(args.sandbox, args.trajectory, args.k, tokens, args.context_ref)
    if args.verb == "restore":
        return await client.restore(args.trajectory)
    if args.verb == "ls":
        return await client.list()
    return await client.destroy(args.sandbox)


async def main_async(args: argparse.Namespace) -> int:
    # Both ways in (`belayer sandbox`, `python -m belayer_rl.cli.sandbox`) set every global flag.
    target = resolve_target(args)
    nc = await target.connect("belayer-sandbox")
    try:
        reply = await call(
            args, SandboxClient(nc, args.host, subjects=target.subjects, client=target.access.client)
        )
    except ServiceError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await nc.close()
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(reply)).decode())
    elif isinstance(reply, ExecResult):
        sys.stdout.write(reply.stdout)
        sys.stderr.write(reply.stderr)
        if reply.timed_out:
            print(f"[timed out after {args.timeout}s]", file=sys.stderr)
        return reply.exit_code
    else:
        print(msgspec.json.format(msgspec.json.encode(reply)).decode())
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return uvloop.run(main_async(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    options.add_argument("--state-dir", type=Path, default=default_state_dir())
    add_target_flags(options, defaults=True)
    known, rest = options.parse_known_args(argv if argv is not None else sys.argv[1:])
    parser = argparse.ArgumentParser(prog="belayer-sandbox", parents=[options])
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sandbox", *rest])
    for name, value in vars(known).items():
        setattr(args, name, value)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
