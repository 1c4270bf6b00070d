"""The HTTP gateway, called as its users call it: the official `openai` client, a raw server-sent
events client that drops its connection and comes back with Last-Event-ID, and SGLang's /generate.
Every answer is checked against a reference computed in-process by the engine with the same seed
(tokens and logprobs, bitwise), through a worker SIGKILL and a gateway SIGKILL at seeded points.

Mutation checks, each run by hand: with the gateway's resume skipping nothing (`skip = 0`), the
reconnected stream repeats tokens and the Last-Event-ID test fails; with the router's owner check
off (`owned` taking any client), the other key's attach is answered 200 and the access test fails;
with the router's dispatches carrying no prefix logprobs, the successor router resumes the chat
stream from position 0 instead of adopting it, and the openai test fails.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from belayer_rl.services.gateway.api import rendered_chat
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import tokenizer
from belayer_rl.shared.access import api_key_path, write_api_keys
from belayer_rl.shared.processes import free_port
from belayer_rl.shared.protocol import RequestResumed
from tests.support import Cluster, EventLog, Job, Output, kill, poll, reference_outputs, running_cluster

MODEL = "belayer"


def key_of(state: Path, name: str = "default") -> str:
    return api_key_path(state / "creds", name).read_text().strip()


async def ready(port: int) -> None:
    """Until the gateway answers /health with 200 (it sees a live engine)."""

    async def healthy() -> bool | None:
        try:
            async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/health") as r:
                return True if r.status == 200 else None
        except aiohttp.ClientError:
            return None

    await poll(healthy, timeout_s=60, every_s=0.1)


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, Any]]:
    """(event id, data) of each server-sent event; data "[DONE]" as the string."""
    event_id, data = "", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield event_id, (data if data == "[DONE]" else json.loads(data))
            event_id, data = "", ""


def max_difference(got: list[float], want: list[float]) -> float:
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)


async def at_least(cluster: Cluster, request_id: str, tokens: int) -> bool | None:
    status = await cluster.client.status()
    return (
        True if any(r.request_id == request_id and r.num_tokens >= tokens for r in status.requests) else None
    )


async def serving_engine_pid(cluster: Cluster, request_id: str) -> int:
    status = await cluster.client.status()
    engine = next(r.engine_id for r in status.requests if r.request_id == request_id)
    return await cluster.engine_pid(engine)


async def test_the_openai_client_gets_exact_tokens_and_logprobs_across_a_worker_kill(
    nats_server, tmp_path, seed
) -> None:
    rng = random.Random(seed)
    port = free_port()
    options = {"engines": 2, "gateway": True, "http_port": port, "standby_routers": 1}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        await ready(port)
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key_of(tmp_path), max_retries=0
        )

        # Whole, with the prompt as token ids.
        whole = Job("gw-whole", "The agent calls a tool and waits.", max_tokens=40, seed=11)
        completion = await api.completions.create(
            model=MODEL, prompt=tokenizer.encode(whole.prompt), max_tokens=40, seed=11, temperature=0.8,
            logprobs=0, extra_body={"return_token_ids": True, "request_id": whole.request_id},
        )  # fmt: skip
        choice = completion.choices[0]
        want = reference_outputs([whole])[whole.request_id]
        assert completion.id == whole.request_id
        assert choice.token_ids == want.tokens and choice.prompt_token_ids == tokenizer.encode(whole.prompt)
        assert choice.logprobs is not None and choice.logprobs.token_logprobs == want.logprobs
        assert (
            completion.model_extra is not None and completion.model_extra["weight_version"] == "seed:0:tiny"
        )

        # Whole again, 300 tokens, and the worker serving it is SIGKILLed while it generates.
        long = Job("gw-whole-kill", "A longer answer, please.", max_tokens=300, seed=12, min_tokens=300)
        asked = asyncio.create_task(api.completions.create(
            model=MODEL, prompt=long.prompt, max_tokens=300, seed=12, temperature=0.8, logprobs=0,
            extra_body={"return_token_ids": True, "request_id": long.request_id, "min_tokens": 300},
        ))  # fmt: skip
        whole_kill_at = rng.randrange(20, 150)  # well before its end: the kill must find it running
        await poll(lambda: at_least(cluster, long.request_id, whole_kill_at))
        kill(await serving_engine_pid(cluster, long.request_id), signal.SIGKILL)
        answer = (await asked).choices[0]
        want = reference_outputs([long])[long.request_id]
        assert answer.token_ids == want.tokens
        assert answer.logprobs is not None and answer.logprobs.token_logprobs == want.logprobs
        await cluster.client.wait_for_engines(2, 60)  # the supervisor restarted it

        resumed = await EventLog.start(cluster.client, "request_resumed")
        # A chat stream of 400 tokens; the worker serving it is SIGKILLed at a seeded position, and
        # then the active router (its warm standby takes over).
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List files."},
        ]
        prompt = rendered_chat([openai_message(m) for m in messages])
        chat = Job("gw-chat", prompt, max_tokens=400, seed=23, min_tokens=400)
        kill_at = rng.randrange(20, 150)
        router_kill_at = kill_at + rng.randrange(10, 60)  # counted by the router, ahead of the client
        print(
            f"seed {seed}: the worker dies at {kill_at} tokens the client has, the router at {router_kill_at} it has"
        )
        stream = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=400, seed=23, temperature=0.8, stream=True, logprobs=True,
            extra_body={"return_token_ids": True, "request_id": chat.request_id, "min_tokens": 400},
        )  # fmt: skip
        tokens: list[int] = []
        logprobs: list[float] = []
        first_seen_at_router = -1
        killed = router = None
        ends = []
        async for event in stream:
            piece = event.choices[0]
            tokens += piece.token_ids if getattr(piece, "token_ids", None) else []
            logprobs += [entry.logprob for entry in (piece.logprobs.content if piece.logprobs else [])]
            if first_seen_at_router < 0:  # the first event came while the router still generated
                status = await cluster.client.status()
                first_seen_at_router = next(
                    (r.num_tokens for r in status.requests if r.request_id == chat.request_id), 0
                )
            if killed is None and len(tokens) >= kill_at:
                killed = await serving_engine_pid(cluster, chat.request_id)
                kill(killed, signal.SIGKILL)
            if (
                killed is not None
                and router is None
                and await at_least(cluster, chat.request_id, router_kill_at)
            ):
                lease = await lease_holder(cluster.client.nc.jetstream(), cluster.client.subjects)
                assert lease is not None
                router = lease.pid  # the active router, whichever of the two took the lease
                kill(router, signal.SIGKILL)
            if piece.finish_reason is not None:
                ends.append(event)
        want = reference_outputs([chat])[chat.request_id]
        assert router is not None, "the stream ended before the router kill"
        # The successor adopted what the worker held, though that attempt began as a resume: its
        # dispatch carried the prefix's logprobs, which the worker handed back.
        try:
            adopted = await resumed.wait_for(lambda e: isinstance(e, RequestResumed) and e.request_id == chat.request_id
                                             and e.reason == "adopt", timeout_s=10)  # fmt: skip
        except TimeoutError:
            raise AssertionError(f"no adoption; resumes: {resumed.events}") from None
        assert isinstance(adopted, RequestResumed) and adopted.from_position > 0

    assert killed is not None and router is not None, "the stream ended before the kills"
    assert 0 < first_seen_at_router < 400
    assert len(ends) == 1 and ends[0].choices[0].finish_reason == "length"
    assert ends[0].model_extra is not None and ends[0].model_extra["resumes"] >= 1
    assert tokens == want.tokens
    print(f"largest logprob difference from the reference: {max_difference(logprobs, want.logprobs)}")
    assert logprobs == want.logprobs


def openai_message(message: dict[str, str]) -> Any:
    from belayer_rl.services.gateway.api import ChatMessage

    return ChatMessage(role=message["role"], content=message["content"])  # type: ignore[arg-type]


async def test_streams_survive_a_dropped_connection_and_a_gateway_kill_and_keys_see_only_their_own(
    nats_server, tmp_path, seed
) -> None:
    rng = random.Random(seed)
    port = free_port()
    (tmp_path / "creds").mkdir()
    write_api_keys(tmp_path / "creds", ("default", "other"))
    options = {"engines": 2, "gateway": True, "http_port": port, "max_concurrent": 2}
    async with running_cluster(nats_server, tmp_path, **options) as cluster, aiohttp.ClientSession() as http:
        await ready(port)
        url = f"http://127.0.0.1:{port}"
        mine = {"Authorization": f"Bearer {key_of(tmp_path)}"}
        theirs = {"Authorization": f"Bearer {key_of(tmp_path, 'other')}"}
        jobs = [Job(f"gw-sse-{i}", f"request {i} of the agent", max_tokens=200, seed=30 + i, min_tokens=200)
                for i in range(2)]  # fmt: skip
        want = reference_outputs(jobs)

        def body(job: Job) -> dict[str, Any]:
            return {"model": MODEL, "prompt": job.prompt, "max_tokens": job.max_tokens, "seed": job.seed,
                    "temperature": job.temperature, "min_tokens": job.min_tokens, "stream": True,
                    "logprobs": 0, "return_token_ids": True, "request_id": job.request_id}  # fmt: skip

        async def read(job: Job, headers: dict[str, str], until: int, query: str = "") -> tuple[Output, str]:
            """The tokens and logprobs of the events, until `until` tokens (then the connection is
            dropped) or the end; and the last event id."""
            got, last = Output([], []), ""
            async with http.post(f"{url}/v1/completions{query}", json=body(job), headers=headers) as r:
                assert r.status == 200, await r.text()
                async for event_id, data in events(r):
                    if data == "[DONE]":
                        break
                    last = event_id
                    choice = data["choices"][0]
                    got.tokens.extend(choice.get("token_ids", []))
                    got.logprobs.extend((choice["logprobs"] or {"token_logprobs": []})["token_logprobs"])
                    if len(got.tokens) >= until:
                        break
            return got, last

        # A connection dropped mid-stream, taken up again with Last-Event-ID: exactly the rest.
        cut = rng.randrange(10, 150)
        first, last = await read(jobs[0], mine, cut)
        assert last == f"{jobs[0].request_id}:{len(first.tokens)}"
        rest, _ = await read(jobs[0], mine | {"Last-Event-ID": last}, 10**9)
        assert Output(first.tokens + rest.tokens, first.logprobs + rest.logprobs) == want[jobs[0].request_id]

        # Another key can neither follow nor cancel it.
        async with http.post(
            f"{url}/v1/completions", json=body(jobs[0]), headers=theirs | {"Last-Event-ID": last}
        ) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (404, "request_not_found")
        async with http.post(f"{url}/v1/requests/{jobs[0].request_id}/cancel", headers=theirs) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (404, "request_not_found")

        # The gateway SIGKILLed mid-stream; its successor (the supervisor restarts it) serves the rest.
        gateway = cluster.pid_of("gateway")
        cut = rng.randrange(10, 150)
        print(f"seed {seed}: the gateway dies once the client has {cut} tokens")
        reader = asyncio.create_task(read(jobs[1], mine, 10**9))
        await poll(lambda: at_least(cluster, jobs[1].request_id, cut))
        kill(gateway, signal.SIGKILL)
        with pytest.raises(aiohttp.ClientError):
            await reader
        await poll(lambda: restarted(cluster, "gateway", gateway))
        await ready(port)
        rest, _ = await read(jobs[1], mine, 10**9, query=f"?resume={jobs[1].request_id}:0")
        assert rest == want[jobs[1].request_id]

    assert cluster.pid_of("gateway") != gateway


async def busy(cluster: Cluster, request_id: str, at_least: int) -> bool | None:
    status = await cluster.client.status()
    return (
        True
        if any(r.request_id == request_id and r.num_tokens >= at_least for r in status.requests)
        else None
    )


async def restarted(cluster: Cluster, name: str, old_pid: int) -> bool | None:
    child = cluster.supervisor.children[name]
    return True if child.pid not in (0, old_pid) else None


async def test_sglang_generate_and_every_bad_input_get_their_answer_and_the_gateway_serves_on(
    nats_server, tmp_path
) -> None:
    port = free_port()
    options = {"engines": 1, "gateway": True, "http_port": port, "max_concurrent": 1}
    async with running_cluster(nats_server, tmp_path, **options) as cluster, aiohttp.ClientSession() as http:
        await ready(port)
        url = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {key_of(tmp_path)}"}
        pid = cluster.pid_of("gateway")

        # SGLang's native shape: input ids in, output ids and their logprobs out.
        job = Job("gw-sglang", "tool output: 3 files", max_tokens=24, seed=5)
        request = {"input_ids": tokenizer.encode(job.prompt), "rid": job.request_id, "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 5}}  # fmt: skip
        async with http.post(f"{url}/generate", json=request, headers=auth) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        want = reference_outputs([job])[job.request_id]
        meta = answer["meta_info"]
        assert answer["output_ids"] == want.tokens
        assert [entry[1] for entry in meta["output_token_logprobs"]] == want.tokens
        assert [entry[0] for entry in meta["output_token_logprobs"]] == want.logprobs
        assert meta["id"] == job.request_id and meta["weight_version"] == "seed:0:tiny"
        assert meta["finish_reason"]["type"] in ("length", "stop")

        # A request without a seed gets one, and the response says which: drawn again, it is the same.
        plain = {"model": MODEL, "prompt": "again", "max_tokens": 12, "return_token_ids": True}
        async with http.post(f"{url}/v1/completions", json=plain, headers=auth) as r:
            first = await r.json()
        async with http.post(
            f"{url}/v1/completions", json=plain | {"seed": first["seed"]}, headers=auth
        ) as r:
            second = await r.json()
        assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]

        # Each bad input: its status and code, and the gateway serves on.
        good = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        cases: list[tuple[str, dict[str, str], bytes, int, str]] = [
            ("/v1/completions", {}, json.dumps(good).encode(), 401, "invalid_api_key"),
            ("/v1/completions", {"Authorization": "Bearer bk-not-a-key"}, json.dumps(good).encode(), 401, "invalid_api_key"),
            ("/v1/completions", auth, b'{"model": "belayer", "prompt": ', 400, "invalid_json"),
            ("/v1/completions", auth, json.dumps(good | {"model": "gpt-4"}).encode(), 404, "model_not_found"),
            ("/v1/completions", auth, json.dumps(good | {"max_tokens": 600}).encode(), 400, "context_length_exceeded"),
            ("/v1/completions", auth, json.dumps(good | {"prompt": "x" * 600}).encode(), 400, "context_length_exceeded"),
            ("/v1/completions", auth, json.dumps(good | {"prompt": "x" * (1100 << 10)}).encode(), 413, "request_too_large"),
            ("/v1/completions", auth, json.dumps(good | {"top_p": 0.9}).encode(), 400, "unsupported_parameter"),
            ("/v1/completions", auth, json.dumps(good | {"n": 2}).encode(), 400, "unsupported_parameter"),
            ("/v1/completions", auth, json.dumps(good | {"frequency_penalty": 0.5}).encode(), 400, "unsupported_parameter"),
            ("/v1/completions", auth, json.dumps(good | {"logprobs": 5}).encode(), 400, "unsupported_parameter"),
            ("/v1/completions", auth, json.dumps(good | {"frobnicate": 1}).encode(), 400, "invalid_request"),
            ("/v1/completions", auth, json.dumps(good | {"max_tokens": "many"}).encode(), 400, "invalid_request"),
            ("/v1/completions", auth, json.dumps(good | {"prompt": [300]}).encode(), 400, "invalid_prompt"),
            ("/v1/chat/completions", auth, json.dumps({"model": MODEL, "messages": []}).encode(), 400, "invalid_messages"),
            ("/generate", auth, json.dumps({"text": "x", "input_ids": [1]}).encode(), 400, "invalid_prompt"),
        ]  # fmt: skip
        for path, headers, data, status, code in cases:
            async with http.post(
                url + path, data=data, headers=headers | {"Content-Type": "application/json"}
            ) as r:
                answer = await r.json()
                assert (r.status, answer["error"]["code"]) == (status, code), (path, data[:80], answer)
                assert answer["error"]["message"] and answer["error"]["type"]

        # Past --gateway-max-concurrent (1 here): 429 while the first runs.
        long = {"model": MODEL, "prompt": "long", "max_tokens": 300, "min_tokens": 300, "stream": True}
        async with http.post(f"{url}/v1/completions", json=long, headers=auth) as running:
            assert running.status == 200
            async with http.post(f"{url}/v1/completions", json=good, headers=auth) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (429, "too_many_requests")

        # No engine: 503 at once. The worker is stopped so that it cannot be restarted before the call.
        engine = (await cluster.client.status()).engines[0]
        kill(engine.pid, signal.SIGSTOP)
        try:
            await poll(lambda: unhealthy(http, url), timeout_s=30, every_s=0.1)
            async with http.post(f"{url}/v1/completions", json=good, headers=auth) as r:
                assert (r.status, (await r.json())["error"]["code"]) == (503, "no_engine")
        finally:
            kill(engine.pid, signal.SIGCONT)

        async with http.get(f"{url}/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
        errors = {
            s.labels["code"]: s.value
            for s in families["belayer_gateway_errors"].samples
            if s.name.endswith("_total")
        }
        async with http.get(f"{url}/v1/models", headers=auth) as r:
            models = await r.json()
        assert cluster.pid_of("gateway") == pid

    for _, _, _, _, code in cases:
        assert errors[code] >= 1, (code, errors)
    assert errors["too_many_requests"] == 1 and errors["no_engine"] == 1
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 512


async def unhealthy(http: aiohttp.ClientSession, url: str) -> bool | None:
    async with http.get(f"{url}/health") as r:
        return True if r.status == 503 else None
