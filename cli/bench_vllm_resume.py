"""`belayer bench vllm-resume --model-path DIR`: how often a request resumed on vLLM equals its
uninterrupted twin, for greedy and sampled decoding (temperature 1.0).

A resume is what the router dispatches after a worker dies: the prompt plus every token so far, the
same seed, the rest of the budget. Here it is dispatched to a vLLM engine in this process at a
random position, with `--concurrency` requests at once (a resumed batch is never the batch its twin
ran in), and compared with the twin from that position on. Belayer's sampler keys each draw by
(seed, position), so a resumed request differs only where vLLM computes different logits for the
same tokens: a prefill against a decode, another batch. The tokens' mean entropy is reported with
the rate: the flatter the distribution, the likelier a rounding difference moves a draw.

Runs where vLLM is installed (its own virtualenv: README, vLLM engines). The worker-kill test of
tests/vllm does the same with a real SIGKILL and a shadow; this counts hundreds of resumes without
paying a vLLM start for each.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.shared.tokenizer import EOS_TOKEN


def add_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser("vllm-resume", help="exact-match rate of requests resumed on vLLM")
    bench.add_argument(
        "--model-path", type=Path, required=True, help="a model folder (belayer model make-tiny)"
    )
    bench.add_argument("--resumes", type=int, default=200, help="resumes per temperature, at least")
    bench.add_argument("--concurrency", type=int, default=8, help="requests at once")
    bench.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    bench.add_argument("--prompt-tokens", type=int, default=24, help="prompt length")
    bench.add_argument("--seed", type=int, default=0, help="prompts, seeds and resume positions")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(bench(args), args.json, print_table)


def bench(args: argparse.Namespace) -> Report:
    from belayer_rl.services.worker.engine import SeqSpec
    from belayer_rl.services.worker.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(VllmEngineConfig(args.model_path))
    engine.warm_up()
    rng = random.Random(args.seed)
    report: Report = {"model": args.model_path.name, "concurrency": args.concurrency, "temperatures": {}}

    def run_all(specs: list[SeqSpec]) -> dict[object, tuple[list[int], list[float]]]:
        out: dict[object, tuple[list[int], list[float]]] = {s.key: (list(s.prefix_tokens), []) for s in specs}
        for spec in specs:
            engine.submit(spec)
        while engine.has_work():
            for event in engine.step():
                tokens, logprobs = out[event.key]
                if event.position != len(tokens):
                    raise RuntimeError(f"{event.key}: a token lost or repeated at {event.position}")
                tokens += event.new_tokens
                logprobs += event.new_logprobs
        return out

    for temperature in (0.0, 1.0):
        resumes = exact = 0
        first_differences: list[dict[str, int]] = []
        max_logprob_gap = 0.0
        twins_all: list[tuple[list[int], list[int]]] = []
        started = time.perf_counter()
        round_ = 0
        while resumes < args.resumes:
            round_ += 1
            jobs = [
                SeqSpec(
                    key=(f"t{round_}-{i}", 1),
                    prompt_tokens=[rng.randrange(256) for _ in range(args.prompt_tokens)],
                    prefix_tokens=[],
                    max_new_tokens=args.max_tokens,
                    seed=rng.randrange(1 << 31),
                    temperature=temperature,
                    min_new_tokens=args.max_tokens,
                )
                for i in range(args.concurrency)
            ]
            twins = run_all(jobs)
            cut = {job.key: rng.randrange(1, args.max_tokens) for job in jobs}
            resumed_specs = [
                SeqSpec(
                    key=(f"t{round_}-{i}", 2),
                    prompt_tokens=job.prompt_tokens,
                    prefix_tokens=twins[job.key][0][: cut[job.key]],
                    max_new_tokens=job.max_new_tokens,
                    seed=job.seed,
                    temperature=temperature,
                    min_new_tokens=job.min_new_tokens,
                )
                for i, job in enumerate(jobs)
            ]
            resumed = run_all(resumed_specs)
            for job, again in zip(jobs, resumed_specs, strict=True):
                twin_tokens, twin_logprobs = twins[job.key]
                got_tokens, got_logprobs = resumed[again.key]
                twins_all.append((job.prompt_tokens, twin_tokens))
                resumes += 1
                if got_tokens == twin_tokens:
                    exact += 1
                    k = cut[job.key]
                    gaps = [abs(a - b) for a, b in zip(got_logprobs, twin_logprobs[k:], strict=True)]
                    max_logprob_gap = max([max_logprob_gap, *gaps])
                else:
                    at = next(
                        i for i, (a, b) in enumerate(zip(got_tokens, twin_tokens, strict=True)) if a != b
                    )
                    first_differences.append({"resumed_at": cut[job.key], "first_difference": at})
        report["temperatures"][str(temperature)] = {
            "resumes": resumes,
            "exact": exact,
            "exact_rate": round(exact / resumes, 4),
            "mean_entropy_nats": round(mean_entropy(args.model_path, twins_all, temperature), 3),
            "max_logprob_gap_when_exact": max_logprob_gap,
            "differences": first_differences[:20],
            "seconds": round(time.perf_counter() - started, 1),
        }
    return report


def mean_entropy(model_path: Path, sequences: list[tuple[list[int], list[int]]], temperature: float) -> float:
    """The mean entropy of the distribution each generated token was drawn from (EOS masked, as
    min_tokens masks it), from `transformers` on the same folder; at T = 0 that of softmax(logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, generated in sequences:
            logits = model(torch.tensor([prompt + generated])).logits[0]  # [prompt + generated, vocab]
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)].double() / (temperature or 1.0)
            rows[:, EOS_TOKEN] = -math.inf
            logp = torch.log_softmax(rows, dim=-1)
            total += float(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum())
            count += len(generated)
    return total / count


def print_table(report: Report) -> None:
    print(f"model {report['model']}, {report['concurrency']} requests at once")
    for temperature, f in report["temperatures"].items():
        print(
            f"  T={temperature}: {f['exact']}/{f['resumes']} resumes token-exact ({100 * f['exact_rate']:.1f}%),"
            f" mean entropy {f['mean_entropy_nats']} nats, largest logprob gap when exact"
            f" {f['max_logprob_gap_when_exact']:.2e}, {f['seconds']} s"
        )
        for difference in f["differences"]:
            print(
                f"    differed: resumed at {difference['resumed_at']}, first difference at {difference['first_difference']}"
            )
