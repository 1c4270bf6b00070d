"""Agent turns through the router (contract version 3): a prompt given as token ids generates what
the same prompt as text does; SamplingParams.min_tokens holds EOS back end to end; and malformed
token prompts are refused with bad-request, the router serving on."""

from __future__ import annotations

import msgspec
import pytest

from belayer_rl.shared import bus, protocol, tokenizer
from belayer_rl.shared.bus import ServiceError
from tests.support import NAMES, running_cluster

PROMPT = "The belayer holds the rope while the climber"


async def test_token_prompts_min_tokens_and_bad_token_prompts(nats_server, tmp_path) -> None:
    async with running_cluster(nats_server, tmp_path, engines=1) as cluster:
        client = cluster.client
        as_text = await client.generate_all(PROMPT, max_tokens=40, seed=5, temperature=0.8)
        as_tokens = await client.generate_all(
            tokenizer.encode(PROMPT), max_tokens=40, seed=5, temperature=0.8
        )
        assert as_tokens.tokens == as_text.tokens
        # Bytes that are not UTF-8 survive as a token prompt (they could not as text).
        raw = await client.generate_all([0xFF, 0xFE, *tokenizer.encode(PROMPT)], max_tokens=8, seed=5)
        assert len(raw.tokens) >= 1

        early = None
        for seed in range(300):
            run = await client.generate_all(PROMPT, max_tokens=120, seed=seed, temperature=0.8)
            if run.finish_reason == "eos" and len(run.tokens) < 40:
                early = seed, run
                break
        assert early is not None, "no seed in 300 ended with EOS within 40 tokens"
        seed, run = early
        held = await client.generate_all(PROMPT, max_tokens=120, seed=seed, temperature=0.8, min_tokens=100)
        assert tokenizer.EOS_TOKEN not in held.tokens[:100] and len(held.tokens) >= 100
        assert held.tokens[: len(run.tokens) - 1] == run.tokens[:-1]  # the same draws until the masked EOS

        for bad, why in (([], "non-empty"), ([300], "below"), (None, "not both")):
            request = protocol.GenerateRequest(
                request_id=f"bad-{why.split()[0]}",
                prompt="x" if bad is None else "",
                prompt_tokens=[1, 2] if bad is None else bad,
                max_tokens=4,
                reply_to=client.nc.new_inbox(),
            )
            with pytest.raises(ServiceError) as refused:
                await bus.request(client.nc, NAMES.router_generate("cli"), request, 5)
            assert refused.value.code == "bad-request" and why in str(refused.value)
        # 40,000 characters, under the character bound, but 80,000 bytes of UTF-8: as many tokens,
        # more than a record may hold. Refused at the edge, before any record is written.
        wide = msgspec.json.encode(
            {"type": "generate", "request_id": "wide", "prompt": "é" * 40_000, "max_tokens": 4,
             "reply_to": client.nc.new_inbox()}
        )  # fmt: skip
        reply = await client.nc.request(NAMES.router_generate("cli"), wide, timeout=5)
        answer = protocol.decode(protocol.decoder_for(protocol.Reply), reply.data)
        assert isinstance(answer, protocol.ErrorReply) and answer.code == "bad-request"
        assert "80000 bytes of UTF-8" in answer.message
        again = await client.generate_all(PROMPT, max_tokens=40, seed=5, temperature=0.8)
        assert again.tokens == as_text.tokens
