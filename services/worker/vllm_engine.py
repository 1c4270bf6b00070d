"""A vLLM engine behind Belayer's worker contract: the same submit/cancel/step/load surface as the
built-in engine (engine.py), so services/worker/worker.py drives it unchanged.

vLLM's engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): a SIGKILLed worker
leaves no engine-core child behind holding a KV cache, and `step()` maps one to one onto a
WorkerFrame. The worker calls `step()` from a thread, as it does the built-in engine's.

Sampling is Belayer's, not vLLM's: `BelayerSampler`, a vLLM logits processor, draws each token with
services/worker/sampling.py, keyed by (seed, absolute position), and leaves only that token finite.
Its value there is the token's log-probability under the distribution Belayer drew from, and vLLM
returns it as the token's logprob ("processed_logits" mode, with vLLM itself greedy). A request
resumed from its prompt plus the tokens so far therefore continues the same sample wherever vLLM
computes the same logits.

Finishing is Belayer's too: vLLM runs with `ignore_eos` and the remaining budget; EOS, stop strings
and min_tokens are decided here exactly as the built-in engine decides them.

This module imports vLLM, which lives in its own virtualenv (README: "vLLM engines"); only the
worker of kind "vllm" imports it.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

# Before vLLM is imported: the engine core in this process, and its KV cache sized on purpose.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import torch
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from belayer_rl.services.worker.engine import (
    EngineRejected,
    FinishReason,
    SeqEvent,
    SeqSpec,
    check_spec,
    finish_reason,
)
from belayer_rl.services.worker.sampling import sample
from belayer_rl.shared.tokenizer import EOS_TOKEN, decode_bytes

SAMPLING_ARG = "belayer"  # the key of Belayer's sampling in SamplingParams.extra_args


@dataclass(frozen=True)
class VllmEngineConfig:
    model_path: Path
    max_model_len: int = 1024
    max_running: int = 32
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV cache, in GiB
    prefix_caching: bool = False  # off: a resumed prefix is computed like the first time


class ModelFolderError(ValueError):
    """A model folder vLLM cannot serve (missing, not a Hugging Face folder, wrong tokenizer)."""


def check_model_folder(folder: Path) -> None:
    """Refuse a folder that is plainly not a model before paying for vLLM's start."""
    if not folder.is_dir():
        raise ModelFolderError(f"--model-path {folder} is not a folder")
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    if missing:
        raise ModelFolderError(f"--model-path {folder} has no {', '.join(missing)}: not a model folder")
    if not any(folder.glob("*.safetensors")):
        raise ModelFolderError(f"--model-path {folder} holds no .safetensors weights")


def folder_version(folder: Path) -> str:
    """A weight version named by the folder's weights: their names and sizes, and their first MiB."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
        with path.open("rb") as weights:
            digest.update(weights.read(1 << 20))
    return f"hf-{digest.hexdigest()[:12]}"


# ---------------------------------------------------------------------------- sampling inside vLLM


@dataclass
class _RowSampling:
    """One batch row's request, as BelayerSampler draws for it."""

    seed: int
    temperature: float
    min_new_tokens: int
    prefix_len: int  # tokens an earlier attempt generated, now at the end of the prompt
    prompt_len: int  # the prompt vLLM was given: Belayer's prompt plus the prefix
    output: list[int]  # vLLM's live list of this request's new tokens
    mask: torch.Tensor | None  # [vocab]: 0 at allowed ids, -inf elsewhere; None = all allowed


class BelayerSampler(LogitsProcessor):
    """Draws each row's token with Belayer's sampler and leaves only it finite, holding its logprob."""

    def __init__(self, vllm_config: object, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _RowSampling] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        args = sampling_params.extra_args or {}
        if SAMPLING_ARG not in args:
            raise ValueError("this engine samples only requests that carry Belayer's sampling")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, prompt, output in batch_update.added:
            seed, temperature, min_new, prefix_len, allowed = params.extra_args[SAMPLING_ARG]
            mask = None
            if allowed:
                vocab = params.extra_args["vocab_size"]
                mask = torch.full((vocab,), -math.inf)
                mask[allowed] = 0.0
            self.rows[index] = _RowSampling(
                seed, temperature, min_new, prefix_len, len(prompt or ()), output, mask
            )
        for a, b, _ in batch_update.moved:  # a swap, or a move (then `a` is empty afterwards)
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [batch, vocab] float32 -> the same, -inf but at each row's drawn token."""
        drawn = torch.full_like(logits, -math.inf)
        for index, row in self.rows.items():
            if index >= logits.shape[0]:
                continue
            row_logits = logits[index]
            if row.mask is not None:
                row_logits = row_logits + row.mask
            if row.prefix_len + len(row.output) < row.min_new_tokens:
                row_logits = row_logits.clone()
                row_logits[EOS_TOKEN] = -math.inf
            position = row.prompt_len + len(row.output)  # as the built-in engine counts it
            draw = sample(row_logits, row.seed, position, row.temperature, vocab_size=logits.shape[1])
            drawn[index, draw.token] = draw.logprob
        return drawn


# ---------------------------------------------------------------------------- the engine


@dataclass
class _Request:
    spec: SeqSpec
    generated: list[int]  # prefix and new tokens
    text: bytearray = field(default_factory=bytearray)  # bytes of `generated`, for stop matching
    stops: tuple[bytes, ...] = ()


class VllmEngine:
    """Not thread-safe: submit, cancel and step must not run concurrently (as Engine)."""

    def __init__(self, config: VllmEngineConfig) -> None:
        check_model_folder(config.model_path)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_gib))
        self.config = config
        args = EngineArgs(
            model=str(config.model_path),
            dtype="float32",
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_running,
            enforce_eager=True,
            seed=0,
            logits_processors=[BelayerSampler],
            logprobs_mode="processed_logits",
            enable_prefix_caching=config.prefix_caching,
            disable_log_stats=True,
        )
        try:
            self.llm = LLMEngine.from_engine_args(args)
        except Exception as exc:  # vLLM raises many kinds; the worker reports one
            raise ModelFolderError(f"vLLM could not start on {config.model_path}: {exc}") from exc
        model_config = self.llm.vllm_config.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.max_seq_len: int = model_config.max_model_len
        self.device = torch.device("cpu")
        self.weight_version: str = folder_version(config.model_path)
        self.weights: dict[str, object] = {self.weight_version: config.model_path}
        self._requests: dict[str, _Request] = {}  # vLLM request id -> what Belayer asked for
        self._ids: dict[Hashable, str] = {}  # a spec's key -> its vLLM request id
        self._next_id = 0
        self._done_events: list[SeqEvent] = []

    def warm_up(self) -> None:
        """Run one small request to its end: vLLM's first step pays for setting up its kernels
        (about 2 s here), which a request should not."""
        key = ("warm-up", 0)
        self.submit(
            SeqSpec(key, prompt_tokens=[1] * 8, prefix_tokens=[], max_new_tokens=4, seed=0, temperature=1.0)
        )
        while self.has_work():
            self.step()

    # ------------------------------------------------------------------ intake

    def submit(self, spec: SeqSpec) -> None:
        if spec.key in self._ids:
            raise EngineRejected(f"key {spec.key!r} is already queued or running")
        if spec.weight_version is not None and spec.weight_version not in self.weights:
            raise EngineRejected(
                f"weight version {spec.weight_version} is not held; have {list(self.weights)}"
            )
        check_spec(spec, self.vocab_size, self.max_seq_len)
        request = _Request(spec, list(spec.prefix_tokens), bytearray(decode_bytes(spec.prefix_tokens)))
        request.stops = tuple(s.encode() for s in spec.stop)
        reason = finish_reason(
            request.generated, request.text, request.stops, spec.max_new_tokens, n_new=len(request.generated)
        )
        if reason is not None:  # the earlier attempt already ended the request
            self._done_events.append(SeqEvent(spec.key, len(request.generated), [], [], reason))
            return
        request_id = f"r{self._next_id}"
        self._next_id += 1
        params = SamplingParams(
            temperature=0.0,  # vLLM's own draw is an argmax over the one token BelayerSampler left
            max_tokens=spec.max_new_tokens - len(spec.prefix_tokens),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={
                SAMPLING_ARG: [
                    spec.seed,
                    spec.temperature,
                    spec.min_new_tokens,
                    len(spec.prefix_tokens),
                    list(spec.allowed_tokens),
                ],
                "vocab_size": self.vocab_size,
            },
        )
        prompt = TokensPrompt(prompt_token_ids=[*spec.prompt_tokens, *spec.prefix_tokens])
        self.llm.add_request(request_id, prompt, params)
        self._requests[request_id] = request
        self._ids[spec.key] = request_id

    def cancel(self, key: Hashable) -> bool:
        request_id = self._ids.pop(key, None)
        if request_id is None:
            n = len(self._done_events)
            self._done_events = [e for e in self._done_events if e.key != key]
            return len(self._done_events) != n
        del self._requests[request_id]
        self.llm.abort_request([request_id])
        return True

    def has_work(self) -> bool:
        return bool(self._requests or self._done_events)

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, outstanding tokens): vLLM's own queue is not split out here."""
        outstanding = sum(r.spec.max_new_tokens - len(r.generated) for r in self._requests.values())
        return len(self._requests), 0, outstanding

    # ------------------------------------------------------------------ steps

    def step(self) -> list[SeqEvent]:
        events, self._done_events = self._done_events, []
        for output in self.llm.step():
            request = self._requests.get(output.request_id)
            if request is None:  # cancelled while the step ran
                continue
            completion = output.outputs[0]
            new_tokens = list(completion.token_ids)
            if not new_tokens and not output.finished:
                continue
            new_logprobs = [
                entry[token].logprob
                for token, entry in zip(new_tokens, completion.logprobs or [], strict=True)
            ]
            position = len(request.generated)
            request.generated.extend(new_tokens)
            request.text += decode_bytes(new_tokens)
            reason: FinishReason | None = finish_reason(
                request.generated,
                request.text,
                request.stops,
                request.spec.max_new_tokens,
                n_new=len(new_tokens),
            )
            if reason is None and output.finished:
                reason = "length"  # vLLM ends a request only at its max_tokens here
            if reason is not None:
                del self._requests[output.request_id]
                del self._ids[request.spec.key]
                if not output.finished:
                    self.llm.abort_request([output.request_id])
            events.append(SeqEvent(request.spec.key, position, new_tokens, new_logprobs, reason))
        return events
