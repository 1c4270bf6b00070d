"""`belayer events`: the cluster's event stream, one line (or JSON object) per event, filtered by
kind, engine or trajectory."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

import msgspec
import uvloop
from nats.aio.msg import Msg

from belayer_rl.cli.target import resolve_target
from belayer_rl.shared import protocol
from belayer_rl.shared.bus import Target
from belayer_rl.shared.subjects import event_kind


def cmd_events(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    kinds = frozenset(args.kind or ())
    selection = EventFilter(
        kinds=kinds,
        engine=args.engine,
        trajectory=args.trajectory,
        heartbeats=args.heartbeats or "heartbeat" in kinds,  # asking for the kind is asking to see it
    )
    try:
        uvloop.run(follow_events(target, selection, args.json, args.count))
    except KeyboardInterrupt:
        pass
    return 0


@dataclass(frozen=True)
class EventFilter:
    """Which events `belayer events` prints. The kind comes from the subject (it chose the type the
    message was decoded with); engine and trajectory are matched on the decoded message's fields,
    so an event whose type has no such field never matches a filter on it."""

    kinds: frozenset[str] = frozenset()  # empty: every kind
    engine: str | None = None
    trajectory: str | None = None
    heartbeats: bool = False  # they arrive five times a second per engine: hidden unless asked for

    def wants_kind(self, kind: str) -> bool:
        if self.kinds:
            return kind in self.kinds
        return kind != "heartbeat" or self.heartbeats

    def matches(self, kind: str, event: msgspec.Struct) -> bool:
        return (
            self.wants_kind(kind)
            and field_matches(event, "engine_id", self.engine)
            and field_matches(event, "trajectory", self.trajectory)
        )


def field_matches(event: msgspec.Struct, name: str, wanted: str | None) -> bool:
    if wanted is None:
        return True
    return name in event.__struct_fields__ and getattr(event, name) == wanted


def describe(kind: str, event: msgspec.Struct) -> str:
    fields = " ".join(f"{name}={getattr(event, name)}" for name in event.__struct_fields__ if name != "v")
    return f"{kind:<18} {fields}"


async def follow_events(target: Target, selection: EventFilter, as_json: bool, count: int) -> None:
    # One decoder per kind: what a subject carries is declared by protocol.EVENT_TYPES, so a message
    # of another type on that subject is reported as undecodable, not shown as what it claims to be.
    decoders = {kind: protocol.decoder_for(kind_type) for kind, kind_type in protocol.EVENT_TYPES.items()}
    nc = await target.connect("belayer-events")
    names = target.subjects
    seen = 0
    done = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        nonlocal seen
        kind = event_kind(msg.subject)
        # Messages already delivered are still handed over after the last one counted: not printed.
        if done.is_set() or not selection.wants_kind(kind):
            return
        try:
            if kind not in decoders:
                raise protocol.BadMessage(f"unknown event kind {kind!r}")
            event = protocol.decode(decoders[kind], msg.data)
        except protocol.BadMessage as exc:
            # Shown even under --engine/--trajectory (its fields cannot be trusted) but not counted.
            if as_json:
                print(json.dumps({"subject": msg.subject, "undecodable": str(exc)}), flush=True)
            else:
                print(f"{time.strftime('%H:%M:%S')} {msg.subject}: undecodable event ({exc})", flush=True)
            return
        if not selection.matches(kind, event):
            return
        if as_json:
            print(msg.data.decode(), flush=True)
        else:
            print(f"{time.strftime('%H:%M:%S')} {describe(kind, event)}", flush=True)
        seen += 1
        if count and seen >= count:
            done.set()

    await nc.subscribe(names.events_all, cb=on_message)
    await nc.flush()  # the server has the subscription: every event published from now on is seen
    # On stderr, so that --json output stays one JSON value per line; scripts may wait for it.
    print(f"following {names.events_all} on {target.url}", file=sys.stderr, flush=True)
    try:
        await done.wait()
    finally:
        await nc.close()


def add_parser(commands: argparse._SubParsersAction) -> None:
    events = commands.add_parser("events", help="follow the event stream, one line per event")
    events.add_argument("--json", action="store_true", help="print each event as JSON")
    events.add_argument("--heartbeats", action="store_true", help="include heartbeats")
    events.add_argument("--count", type=int, default=0, help="stop after this many events")
    events.add_argument(
        "--kind",
        action="append",
        choices=sorted(protocol.EVENT_TYPES),
        metavar="KIND",
        help=f"only this kind, as in belayer.<cluster>.evt.<kind> (repeatable): {', '.join(protocol.EVENT_TYPES)}",
    )
    events.add_argument("--engine", metavar="ID", help="only events of this engine (their engine_id)")
    events.add_argument("--trajectory", metavar="ID", help="only events of this sandbox trajectory")
    events.set_defaults(run=cmd_events)
