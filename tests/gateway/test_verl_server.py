"""examples/verl/belayer_server.py as verl calls it: `server_manager.generate(request_id,
prompt_ids=..., sampling_params=...)`, answered with verl's own TokenOutput (the real verl package,
0.9.1) through the HTTP gateway. The tokens and logprobs are those the engine computes in-process
for the same seed; a request cancelled mid-generation comes back "aborted"; a sampling parameter
Belayer does not serve is refused, not dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from omegaconf import OmegaConf
from verl.workers.rollout.replica import TokenOutput

from belayer_rl.shared import tokenizer
from belayer_rl.shared.processes import free_port
from tests.gateway.test_gateway import key_of, ready
from tests.support import Job, load_example, poll, reference_outputs, running_cluster

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl" / "belayer_server.py"


example = load_example("belayer_example_verl_server", EXAMPLE)


async def test_verl_server_manager_generate_returns_verls_token_output(nats_server, tmp_path) -> None:
    port = free_port()
    async with running_cluster(nats_server, tmp_path, engines=1, gateway=True, http_port=port) as cluster:
        await ready(port)
        config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"response_length": 48}}})
        versions = {"seed:0:tiny": 0}  # the trainer's own record of which step published which weights
        server = example.BelayerServerClient(
            config, gateway_url=f"http://127.0.0.1:{port}", api_key=key_of(tmp_path), steps_of=versions.get
        )
        job = Job("verl-ref", "the tool said: 3 files", max_tokens=48, seed=9)
        sampling = {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
                    "seed": 9}  # fmt: skip
        out = await server.generate(
            "session-1", prompt_ids=tokenizer.encode(job.prompt), sampling_params=sampling
        )
        want = reference_outputs([job])[job.request_id]
        assert isinstance(out, TokenOutput)
        assert out.token_ids == want.tokens and out.log_probs == want.logprobs
        assert out.stop_reason == "completed"
        assert out.extra_fields["weight_version"] == "seed:0:tiny" and out.extra_fields["global_steps"] == 0

        # Cancelled while it runs: the tokens so far, "aborted".
        long = {"temperature": 0.8, "min_tokens": 400, "max_tokens": 400}
        running = asyncio.create_task(server.generate("session-2", prompt_ids=[65, 66], sampling_params=long))
        request = await poll(lambda: busy(cluster))
        async with aiohttp.ClientSession() as http:
            cancel = f"http://127.0.0.1:{port}/v1/requests/{request}/cancel"
            async with http.post(cancel, headers={"Authorization": f"Bearer {key_of(tmp_path)}"}) as answer:
                assert answer.status == 200, await answer.text()
        aborted = await running
        assert aborted.stop_reason == "aborted" and 0 < len(aborted.token_ids) < 400
        assert len(aborted.log_probs) == len(aborted.token_ids)

        with pytest.raises(ValueError, match="top_p"):
            await server.generate("session-3", prompt_ids=[65], sampling_params={"top_p": 0.9})
        with pytest.raises(ValueError, match="does not know"):
            await server.generate("session-3", prompt_ids=[65], sampling_params={"typical_p": 0.5})


async def busy(cluster) -> str | None:  # type: ignore[no-untyped-def]
    status = await cluster.client.status()
    return next(
        (r.request_id for r in status.requests if r.request_id.startswith("verl-") and r.num_tokens > 20),
        None,
    )
