"""Records and messages written by the previous version still decode (the compatibility rule in
shared/protocol.py). The fixtures were written by the code before SamplingParams existed (schema
version 1 of LogStart, GenerateRequest and Dispatch, with flat seed/temperature/stop)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from belayer_rl.services.checkpointer.store import CorruptCheckpoint, Store, decode_manifest
from belayer_rl.services.router import token_log
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import Dispatch, GenerateRequest, SamplingParams
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names

FIXTURES = Path(__file__).parent / "fixtures"


async def test_a_token_log_written_by_the_previous_version_is_read_back(nats_server) -> None:
    nc = await bus.connect(nats_server.url, "test-compat")
    try:
        js = nc.jetstream()
        await bus.declare_jetstream(js, NAMES)
        for line in (FIXTURES / "token_log_v1.jsonl").read_bytes().splitlines():
            request_id = protocol.decode(protocol.decoder_for(protocol.LogRecord), line).request_id
            await js.publish(NAMES.token_log(request_id), line)
        logged, skipped = await token_log.read_all(js, NAMES)
    finally:
        await nc.close()

    assert skipped == []
    first, second = logged["old-1"], logged["old-2"]
    assert first.start.sampling == SamplingParams(seed=1234, temperature=0.8, stop=["zz"])
    assert first.start.prompt_tokens == [5, 6, 7] and first.start.weight_version == "seed-0"
    assert first.tokens == list(range(40, 56))
    assert first.end is not None and first.end.finish_reason == "length" and first.end.resumes == 1
    assert second.start.sampling == SamplingParams(seed=99, temperature=1.5, stop=[])
    assert second.end is not None and second.end.error_code == "no-workers"


def test_version_1_requests_and_dispatches_decode_into_sampling_params() -> None:
    generate_line, dispatch_line = (FIXTURES / "wire_v1.jsonl").read_bytes().splitlines()
    generate = protocol.decode(protocol.decoder_for(GenerateRequest), generate_line)
    dispatch = protocol.decode(protocol.decoder_for(Dispatch), dispatch_line)
    # Re-encoded by this version and read again, nothing is lost.
    again = protocol.decode(protocol.decoder_for(Dispatch), protocol.encode(dispatch))

    assert generate.v == 1 and generate.sampling == SamplingParams(seed=77, temperature=0.6, stop=["\n"])
    assert dispatch.sampling == SamplingParams(seed=55, temperature=0.9, stop=["."])
    assert dispatch.prefix_tokens == [3] and dispatch.max_tokens == 5
    assert again.sampling == dispatch.sampling


def test_a_newer_version_is_refused_with_a_clear_error() -> None:
    current = GenerateRequest(request_id="new", prompt="x", max_tokens=1, reply_to="_INBOX.x")
    assert current.v == protocol.ALLOWED_TOKENS_VERSION == 4
    newer = protocol.encode(current).replace(b'"v":4', b'"v":5')
    try:
        protocol.decode(protocol.decoder_for(GenerateRequest), newer)
        refused = ""
    except protocol.BadMessage as exc:
        refused = str(exc)

    assert refused == "GenerateRequest version 5 is newer than 4"


def test_a_version_2_request_still_decodes() -> None:
    """Version 2 had no min_tokens and no prompt_tokens: it reads as a text prompt, EOS unmasked."""
    older = (
        b'{"type":"generate","v":2,"request_id":"old","prompt":"x","max_tokens":4,'
        b'"sampling":{"seed":3,"temperature":0.5,"stop":[]},"reply_to":"_INBOX.x"}'
    )
    request = protocol.decode(protocol.decoder_for(GenerateRequest), older)
    assert request.v == 2 and request.prompt_tokens is None
    assert request.sampling == protocol.SamplingParams(seed=3, temperature=0.5, min_tokens=0)


def test_a_checkpoint_manifest_written_by_the_first_version_decodes_but_is_refused(tmp_path) -> None:
    folder = tmp_path / "ck-0001"
    folder.mkdir()
    shutil.copy(FIXTURES / "manifest_v1.json", folder / "manifest.json")
    manifest = decode_manifest((folder / "manifest.json").read_bytes(), folder.name)
    with pytest.raises(CorruptCheckpoint, match="not authenticated"):  # it has no MAC: never restored
        Store(tmp_path, b"k" * 32).load(folder)

    assert (manifest.trajectory, manifest.incarnation, manifest.k) == ("traj-old", 2, 7)
    assert manifest.spec.image == "belayer-sandbox:test" and manifest.spec.cap_add == ["CHOWN"]
    assert manifest.spec.memory_mb == 256 and manifest.spec.env == {"A": "1"}
    assert [f.path for f in manifest.files] == ["layer.tar", "criu/inventory.img"]
    assert manifest.bytes == 10240 + 42
