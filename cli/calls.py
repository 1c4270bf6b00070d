"""The commands that are one call on the bus: `belayer generate`, `belayer weights ls|publish`,
`belayer engines unquarantine`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import uvloop

from belayer_rl.cli.target import resolve_target
from belayer_rl.cli.up import UP_TIMEOUT_S
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client, GenerationError


def cmd_generate(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    try:
        result = uvloop.run(generate(target, args))
    except GenerationError as exc:
        print(
            json.dumps(
                {"request_id": exc.error.request_id, "error": exc.error.code, "message": exc.error.message}
            )
        )
        return 2
    print(json.dumps(result) if args.json else result["text"])
    return 0


async def generate(target: Target, args: argparse.Namespace) -> dict[str, object]:
    nc = await target.connect("belayer-generate")
    async with Client(nc, subjects=target.subjects, client=target.access.client) as client:
        result = await client.generate_all(
            args.prompt,
            max_tokens=args.max_tokens,
            seed=args.seed,
            temperature=args.temperature,
            stop=args.stop or None,
            weight_version=args.weight_version,
        )
    return {
        "request_id": result.request_id,
        "tokens": result.tokens,
        "text": result.text,
        "resumes": result.resumes,
        "finish_reason": result.finish_reason,
        "weight_version": result.weight_version,
    }


def cmd_weights(args: argparse.Namespace) -> int:
    if args.action == "publish" and args.file is None:
        print("belayer weights publish: give the weights file", file=sys.stderr)
        return 2
    target = resolve_target(args)
    try:
        result = uvloop.run(weights(target, args))
    except bus.ServiceError as exc:
        print(f"belayer weights {args.action}: {exc}", file=sys.stderr)
        return 2
    print(result)
    return 0


async def weights(target: Target, args: argparse.Namespace) -> str:
    from belayer_rl.services.weight_server.client import WeightClient

    nc = await target.connect("belayer-weights")
    try:
        client = WeightClient(nc, subjects=target.subjects)
        if args.action == "publish":
            handles = await client.publish(args.file.resolve())
            if args.json:
                return protocol.encode(handles).decode()
            return f"published {handles.version} ({handles.manifest.size} bytes)"
        listing = await client.versions()
        if args.json:
            return protocol.encode(listing).decode()
        return "\n".join(
            f"{v.version}{' (newest)' if v.version == listing.newest else ''}  {v.size} bytes  "
            f"pinned by {', '.join(v.holders) or 'nobody'}"
            for v in listing.versions
        )
    finally:
        await nc.close()


def cmd_engines(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    try:
        done = uvloop.run(unquarantine(target, args.engine))
    except bus.ServiceError as exc:
        print(f"belayer engines unquarantine {args.engine}: {exc}", file=sys.stderr)
        return 2
    print(f"engine {done.engine_id} unquarantined: worker pid {done.new_pid} at epoch {done.epoch}")
    return 0


async def unquarantine(target: Target, engine_id: str) -> protocol.EngineRestarted:
    nc = await target.connect("belayer-engines")
    try:
        subject = target.subjects.engine_unquarantine(engine_id)
        ask = protocol.EngineUnquarantine()
        return await bus.request_struct(nc, subject, ask, protocol.EngineRestarted, UP_TIMEOUT_S)
    finally:
        await nc.close()


def add_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="run one generation")
    gen.add_argument("prompt")
    gen.add_argument("--json", action="store_true", help="print request_id, tokens, text and resumes as JSON")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--weight-version", help="weights to generate with (default: the newest)")
    gen.set_defaults(run=cmd_generate)

    weights_cmd = commands.add_parser("weights", help="list or publish weight versions (weight server)")
    weights_cmd.add_argument("action", choices=["ls", "publish"])
    weights_cmd.add_argument("file", nargs="?", type=Path, help="publish: a weights file on this host")
    weights_cmd.add_argument("--json", action="store_true")
    weights_cmd.set_defaults(run=cmd_weights)

    engines_cmd = commands.add_parser("engines", help="an engine's quarantine: the manual way back")
    engines_cmd.add_argument("action", choices=["unquarantine"])
    engines_cmd.add_argument("engine", help="engine id, e.g. e0")
    engines_cmd.set_defaults(run=cmd_engines)
