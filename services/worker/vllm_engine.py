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

import math
import os
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

# Before vLLM is imported: the engine core in this process, and its KV cache sized on purpose.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# vLLM logs to stdout by default, which is a shadow's pipe to its supervisor (shadow.py).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

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
from belayer_rl.shared.model_folder import ModelFolderError, check_model_folder, folder_version
from belayer_rl.shared.tokenizer import EOS_TOKEN, decode_bytes

SAMPLING_ARG = "belayer"  # the key of Belayer's sampling in SamplingParams.extra_args


@dataclass(frozen=True)
class VllmEngineConfig:
    model_path: Path
    max_model_len: int = 1024
    max_running: int = 32
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV cache, in GiB
    prefix_caching: bool = False  # off: a resumed prefix is computed like the first time


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
class _Held:
    """Requests for a version that vLLM does not compute with yet, and that version's weights."""

    tensors: dict[str, torch.Tensor]
    specs: list[SeqSpec] = field(default_factory=list)


@dataclass
class _Request:
    spec: SeqSpec
    generated: list[int]  # prefix and new tokens
    text: bytearray = field(default_factory=bytearray)  # bytes of `generated`, for stop matching
    stops: tuple[bytes, ...] = ()


class VllmEngine:
    """Not thread-safe: submit, cancel and step must not run concurrently (as Engine).

    Weight versions: vLLM computes with one set of weights (`loaded_version`). A new version is
    staged (`stage`) and becomes what a request without a version gets (`weight_version`); its
    requests wait until no request of the loaded version runs, then the weights are replaced in
    place (vLLM's reload_weights, no restart) and they start. A request never mixes versions; one
    for a version replaced since is refused with the reason.
    """

    def __init__(self, config: VllmEngineConfig) -> None:
        check_model_folder(config.model_path)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)  # the setting wins
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
        self.loaded_version: str = folder_version(config.model_path)
        self.weight_version: str = self.loaded_version  # the newest: a spec without one gets it
        self._staged: dict[str, _Held] = {}  # versions staged, not loaded yet
        self.replaced: list[str] = []  # versions loaded once and replaced since
        self._requests: dict[str, _Request] = {}  # vLLM request id -> what Belayer asked for
        self._ids: dict[Hashable, str] = {}  # a spec's key -> its vLLM request id
        self._held_keys: dict[Hashable, str] = {}  # a held spec's key -> the version it waits for
        self._offered: list[tuple[str, dict[str, torch.Tensor]]] = []  # published, not staged yet
        self._next_id = 0
        self._done_events: list[SeqEvent] = []

    @property
    def weights(self) -> dict[str, object]:
        """The versions this engine can serve: the loaded one and those staged."""
        return {self.loaded_version: None, **self._staged}

    def offer(self, version: str, tensors: dict[str, torch.Tensor]) -> None:
        """Hand a published version over from the worker's loop: the next step stages it (a list
        append is the only thing done here, so it never races a step running in its thread)."""
        self._offered.append((version, tensors))

    def stage(self, version: str, tensors: dict[str, torch.Tensor]) -> None:
        """Hold `version` as the newest; it is loaded once the loaded version's requests are done."""
        if version == self.loaded_version or version in self._staged:
            return
        self._staged[version] = _Held(tensors)
        self.weight_version = version

    def switch_when_idle(self) -> float | None:
        """Load the next staged version, in the order they were staged, once no request of the
        loaded one runs; a staged version that no request waits for and a newer one follows is
        skipped. The seconds the in-place reload took, or None if there was nothing to do."""
        if self._requests or not self._staged:
            return None
        version, held = next(iter(self._staged.items()))
        while not held.specs and len(self._staged) > 1:
            del self._staged[version]
            version, held = next(iter(self._staged.items()))
        del self._staged[version]
        started = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(held.tensors.items())})
        took = time.perf_counter() - started
        self.replaced.append(self.loaded_version)
        self.loaded_version = version
        for spec in held.specs:
            del self._held_keys[spec.key]
            self._start(spec)
        return took

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
        if spec.key in self._ids or spec.key in self._held_keys:
            raise EngineRejected(f"key {spec.key!r} is already queued or running")
        if spec.weight_version in self.replaced:
            raise EngineRejected(
                f"weight version {spec.weight_version} was replaced in place by {self.loaded_version}:"
                " a vLLM engine computes with one version at a time"
            )
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
        version = spec.weight_version or self.weight_version
        if version != self.loaded_version:  # it waits for its weights (switch_when_idle)
            self._staged[version].specs.append(spec)
            self._held_keys[spec.key] = version
            return
        self._start(spec)

    def _start(self, spec: SeqSpec) -> None:
        """Hand `spec` to vLLM, which computes with its version now."""
        request = _Request(spec, list(spec.prefix_tokens), bytearray(decode_bytes(spec.prefix_tokens)))
        request.stops = tuple(s.encode() for s in spec.stop)
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
        if key in self._held_keys:
            held = self._staged[self._held_keys.pop(key)]
            held.specs = [spec for spec in held.specs if spec.key != key]
            return True
        request_id = self._ids.pop(key, None)
        if request_id is None:
            n = len(self._done_events)
            self._done_events = [e for e in self._done_events if e.key != key]
            return len(self._done_events) != n
        del self._requests[request_id]
        self.llm.abort_request([request_id])
        return True

    def has_work(self) -> bool:
        return bool(self._requests or self._done_events or self._held_keys or self._offered)

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, outstanding tokens): waiting counts the requests held for their
        weights; vLLM's own queue is not split out."""
        outstanding = sum(r.spec.max_new_tokens - len(r.generated) for r in self._requests.values())
        held = [spec for version in self._staged.values() for spec in version.specs]
        outstanding += sum(spec.max_new_tokens - len(spec.prefix_tokens) for spec in held)
        return len(self._requests), len(held), outstanding

    # ------------------------------------------------------------------ steps

    def step(self) -> list[SeqEvent]:
        offered, self._offered = self._offered, []
        for version, tensors in offered:
            self.stage(version, tensors)
        self.switch_when_idle()
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
