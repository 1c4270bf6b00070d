"""Hostile input on every subject the services listen to (property-based, hypothesis).

Random bytes, random JSON, valid messages with one field replaced by a wrong-typed value, oversized
token lists and unknown ids. Request/reply subjects must answer with an error reply exactly when
the payload is not a valid message for the subject; one-way subjects drop it with a log line.
Afterwards every process still runs and a valid request completes token-exact.
"""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from belayer_rl.shared import protocol
from belayer_rl.shared.protocol import ErrorReply
from belayer_rl.shared.subjects import Subjects
from tests.rollout.test_worker_faults import make_job, run
from tests.support import reference_tokens, running_cluster

NAMES = Subjects()  # the default cluster's names

INBOX = "_INBOX.fuzz"
VALID = {
    NAMES.router_generate("cli"): protocol.GenerateRequest(
        request_id="fz",
        prompt="hi",
        max_tokens=4,
        sampling=protocol.SamplingParams(seed=1, temperature=0.5),
        reply_to=INBOX,
    ),
    NAMES.router_attach("cli"): protocol.AttachRequest(request_id="fz", from_position=0, reply_to=INBOX),
    NAMES.router_cancel("cli"): protocol.CancelRequest(request_id="nope"),
    NAMES.router_status: protocol.StatusRequest(),
    NAMES.worker_dispatch("e0"): protocol.Dispatch(
        request_id="fz",
        attempt=1,
        epoch=999,
        engine_id="e0",
        prompt_tokens=[1, 2],
        max_tokens=4,
        sampling=protocol.SamplingParams(seed=1, temperature=0.5),
        reply_to=INBOX,
    ),
    NAMES.worker_cancel("e0"): protocol.CancelDispatch(request_id="fz"),
    NAMES.worker_stream("e0"): protocol.WorkerFrame(
        epoch=1, engine_id="e0", seqs=[protocol.FrameSeq("fz", 1, 0, [1], [-0.5], "length", 1)]
    ),
    NAMES.event("heartbeat", "e0"): protocol.Heartbeat(
        engine_id="e0", epoch=99, pid=1, running=0, waiting=0, outstanding_tokens=0
    ),
    NAMES.event("worker_failed", "e0"): protocol.WorkerFailed(engine_id="e0", epoch=99, pid=1, reason="exit"),
    NAMES.event("worker_registered", "e0"): protocol.WorkerRegistration(
        engine_id="e0", epoch=99, pid=1, preset="tiny", weight_version="x"
    ),
    NAMES.router_keepalive("cli"): protocol.ClientKeepAlive(request_ids=["fz", "unknown-id"]),
}
RPC_TYPES: dict[str, type] = {
    NAMES.router_generate("cli"): protocol.GenerateRequest,
    NAMES.router_attach("cli"): protocol.AttachRequest,
    NAMES.router_cancel("cli"): protocol.CancelRequest,
    NAMES.router_status: protocol.StatusRequest,
    NAMES.worker_dispatch("e0"): protocol.Dispatch,
    NAMES.worker_cancel("e0"): protocol.CancelDispatch,
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated(draw: st.DrawFn, subject: str) -> bytes:
    """A valid message of the subject with one field replaced by an arbitrary JSON value."""
    fields = json.loads(msgspec.json.encode(VALID[subject]))
    name = draw(st.sampled_from(sorted(fields)))
    fields[name] = draw(json_values)
    return json.dumps(fields).encode()


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    subject = draw(st.sampled_from(sorted(VALID)))
    payload = draw(
        st.one_of(
            st.binary(max_size=512),
            json_values.map(lambda v: json.dumps(v).encode()),
            mutated(subject),
            st.just(b'{"type":"dispatch","prompt_tokens":' + json.dumps([7] * 70_000).encode() + b"}"),
            st.just(msgspec.json.encode(protocol.AttachRequest(request_id="unknown-id", reply_to=INBOX))),
            st.just(msgspec.json.encode(protocol.CancelRequest(request_id="unknown-id"))),
        )
    )
    return subject, payload


def is_valid(subject: str, payload: bytes) -> bool:
    try:
        protocol.decode(protocol.decoder_for(RPC_TYPES[subject]), payload)
    except protocol.BadMessage:
        return False
    return True


async def test_hostile_messages_on_every_subject(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    async with running_cluster(nats_server, tmp_path, engines=1) as cluster:
        nc = cluster.client.nc
        pids_before = {name: child.pid for name, child in cluster.supervisor.children.items()}
        loop = asyncio.get_running_loop()
        checked = {"error_replies": 0, "one_way": 0}

        async def send(subject: str, payload: bytes) -> None:
            if subject not in RPC_TYPES:
                await nc.publish(subject, payload)
                checked["one_way"] += 1
                return
            reply = await nc.request(subject, payload, timeout=5)
            answer = protocol.decode(protocol.decoder_for(protocol.Reply | protocol.RouterStatus), reply.data)
            if not is_valid(subject, payload):
                assert isinstance(answer, ErrorReply) and answer.code == "bad-request", (subject, answer)
                checked["error_replies"] += 1

        @settings(
            max_examples=300,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(payloads())
        def fuzz(case: tuple[str, bytes]) -> None:
            asyncio.run_coroutine_threadsafe(send(*case), loop).result(10)

        await asyncio.to_thread(fuzz)
        # Unknown ids on RPC get their own error codes.
        for subject, message, code in [
            (
                NAMES.router_attach("cli"),
                protocol.AttachRequest(request_id="never", reply_to=INBOX),
                "unknown-request",
            ),
            (NAMES.router_cancel("cli"), protocol.CancelRequest(request_id="never"), "unknown-request"),
            (NAMES.worker_dispatch("e0"), VALID[NAMES.worker_dispatch("e0")], "stale-epoch"),
        ]:
            reply = await nc.request(subject, protocol.encode(message), timeout=5)
            answer = protocol.decode(protocol.decoder_for(protocol.Reply), reply.data)
            assert isinstance(answer, ErrorReply) and answer.code == code, answer
        # Oversized for the bus itself: the client refuses to send it, nothing reaches a service.
        too_big = b"x" * (nc.max_payload + 1)
        try:
            await nc.publish(NAMES.router_generate("cli"), too_big)
            refused = False
        except Exception:
            refused = True

        job = make_job(rng, "after-fuzz", max_tokens=64)
        result = await run(cluster.client, job)
        pids_after = {name: child.pid for name, child in cluster.supervisor.children.items()}

    assert refused
    assert checked["error_replies"] > 20 and checked["one_way"] > 20, checked
    assert pids_after == pids_before  # nothing crashed and was restarted
    assert result.tokens == reference_tokens([job])[job.request_id]
