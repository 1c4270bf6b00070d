"""`belayer events` against a real nats-server: every kind of the event table comes back decoded,
a message on another kind's subject does not, and the filters select on the decoded fields."""

from __future__ import annotations

import asyncio
import contextlib
import json

import msgspec

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.subjects import Subjects
from tests.cli.helpers import SAMPLES, events_process
from tests.support import NatsServer

NAMES = Subjects()  # the default cluster's names


def subject_of(kind: str, ident: str) -> str:
    return NAMES.event(kind, ident)


async def publish_all(url: str, items: list[tuple[str, protocol.Message]]) -> None:
    nc = await bus.connect(url, "test-events-publisher")
    try:
        for subject, message in items:
            await bus.publish(nc, subject, message)
        await nc.flush()
    finally:
        await nc.close()


async def test_every_kind_comes_back_decoded_and_a_wrong_kind_subject_is_undecodable(
    nats_server: NatsServer,
) -> None:
    kinds = list(SAMPLES)
    # Mutation: each kind's message on the next kind's subject. Were the CLI decoding with a union of
    # all types (not the subject's), these would pass as events.
    mutants = [
        (subject_of(kinds[(i + 1) % len(kinds)], "m"), SAMPLES[kind][1]) for i, kind in enumerate(kinds)
    ]
    genuine = [(subject_of(kind, ident), message) for kind, (ident, message) in SAMPLES.items()]
    async with events_process(
        "--json", "--heartbeats", "--count", str(len(genuine)), "--nats", nats_server.url
    ) as events:
        await publish_all(nats_server.url, mutants + genuine)
        lines = await events.output()

    records = [json.loads(line) for line in lines]
    undecodable = [r for r in records if "undecodable" in r]
    assert [r["subject"] for r in undecodable] == [subject for subject, _ in mutants]
    decoded = [line for line, r in zip(lines, records, strict=True) if "undecodable" not in r]
    assert len(decoded) == len(genuine)
    for line, (subject, sent) in zip(decoded, genuine, strict=True):
        got = msgspec.json.decode(line, type=type(sent))
        assert got == sent, subject


# The stream the filter cases read, in order. Ids in the subject sometimes disagree with the fields
# on purpose: a filter must read the decoded message, not the subject.
HANDOVER_E0 = msgspec.structs.replace(SAMPLES["handover"][1], engine_id="e0")
HANDOVER_E1 = SAMPLES["handover"][1]
FAILED_E0_ON_E1 = SAMPLES["worker_failed"][1]  # engine_id e0, published as .worker_failed.e1
HEARTBEAT_E1 = msgspec.structs.replace(SAMPLES["heartbeat"][1], engine_id="e1")
REGISTERED_E1 = SAMPLES["worker_registered"][1]
READY_T1_ON_T2 = SAMPLES["checkpoint_ready"][1]  # trajectory t1, published as .checkpoint_ready.t2
READY_T2_ON_T1 = msgspec.structs.replace(READY_T1_ON_T2, trajectory="t2")
RESTORED_T1 = msgspec.structs.replace(SAMPLES["sandbox_restored"][1], trajectory="t1")
ENV_FAILURE = SAMPLES["env_failure"][1]  # neither engine nor trajectory
RESUMED_E1 = SAMPLES["request_resumed"][1]
PROCESS = SAMPLES["process"][1]
STREAM: list[tuple[str, protocol.Message]] = [
    (subject_of("handover", "e0"), HANDOVER_E0),
    (subject_of("handover", "e1"), HANDOVER_E1),
    (subject_of("worker_failed", "e1"), FAILED_E0_ON_E1),
    (subject_of("heartbeat", "e1"), HEARTBEAT_E1),
    (subject_of("worker_registered", "e1"), REGISTERED_E1),
    (subject_of("checkpoint_ready", "t2"), READY_T1_ON_T2),
    (subject_of("checkpoint_ready", "t1"), READY_T2_ON_T1),
    (subject_of("sandbox_restored", "t1"), RESTORED_T1),
    (subject_of("env_failure", "s2"), ENV_FAILURE),
    (subject_of("request_resumed", "r1"), RESUMED_E1),
    (subject_of("process", "router"), PROCESS),
]
# Each case: its flags, what of STREAM it must print, and a closing event that it alone (among the
# cases still running) selects, so that it stops at --count having seen the whole stream. A closer is
# published after the previous cases' closers, which it must therefore not select.
CLOSE_KINDS = msgspec.structs.replace(READY_T1_ON_T2, trajectory="t9")
CLOSE_ENGINE = msgspec.structs.replace(FAILED_E0_ON_E1, engine_id="e1")
CLOSE_TRAJECTORY = msgspec.structs.replace(RESTORED_T1, trajectory="t2", k=9)
CLOSE_BOTH = msgspec.structs.replace(HANDOVER_E0, new_pid=999)
CLOSE_HEARTBEAT = msgspec.structs.replace(HEARTBEAT_E1, engine_id="e7")
CASES: list[tuple[list[str], list[protocol.Message], tuple[str, protocol.Message]]] = [
    (
        ["--kind", "handover", "--kind", "checkpoint_ready"],
        [HANDOVER_E0, HANDOVER_E1, READY_T1_ON_T2, READY_T2_ON_T1],
        (subject_of("checkpoint_ready", "t9"), CLOSE_KINDS),
    ),
    (
        ["--engine", "e1"],  # heartbeats stay hidden unless asked for
        [HANDOVER_E1, REGISTERED_E1, RESUMED_E1],
        (subject_of("worker_failed", "e1"), CLOSE_ENGINE),
    ),
    (["--trajectory", "t2"], [READY_T2_ON_T1], (subject_of("sandbox_restored", "t2"), CLOSE_TRAJECTORY)),
    (["--kind", "handover", "--engine", "e0"], [HANDOVER_E0], (subject_of("handover", "e0"), CLOSE_BOTH)),
    (["--kind", "heartbeat"], [HEARTBEAT_E1], (subject_of("heartbeat", "e7"), CLOSE_HEARTBEAT)),
]


async def test_filters_select_exactly_the_matching_events(nats_server: NatsServer) -> None:
    async with contextlib.AsyncExitStack() as stack:
        runs = []
        for flags, expected, closer in CASES:
            count = str(len(expected) + 1)
            # Global flag after the subcommand, as a user types it.
            run = events_process("--json", "--count", count, *flags, "--nats", nats_server.url)
            runs.append((flags, [*expected, closer[1]], await stack.enter_async_context(run)))
        await publish_all(nats_server.url, STREAM + [closer for _, _, closer in CASES])
        outputs = await asyncio.gather(*(events.output() for _, _, events in runs))
    for (flags, expected, _), lines in zip(runs, outputs, strict=True):
        got = [protocol.decode(protocol.decoder_for(protocol.AnyEvent), line.encode()) for line in lines]
        assert got == expected, flags
