"""The HTTP API's request bodies and the one error envelope, as Structs: a body is decoded once, at
the edge, into one of these, and an unknown field is an error that names it, never dropped.

Three shapes of request:
- `/v1/completions` (OpenAI's, with vLLM's extensions `return_token_ids`, `request_id`,
  `min_tokens`, `allowed_token_ids`): `prompt` is text or token ids;
- `/v1/chat/completions` (OpenAI's, the same extensions): messages rendered by CHAT_TEMPLATE;
- `/generate` (SGLang's native shape): `input_ids` or `text`, `sampling_params`, `return_logprob`.

A parameter Belayer does not serve is accepted only at the value that turns it off (`top_p` 1,
`n` 1, penalties 0, ...); any other value is refused with a 400 that names it. What every shape
becomes is one `Job`.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from belayer_rl.shared import tokenizer
from belayer_rl.shared.protocol import SamplingParams

Shape = Literal["completion", "chat", "generate"]

# The chat template of the built-in byte tokenizer, which has no special tokens but EOS: each
# message is a header line `<|role|>` and its content on the lines after it, and the prompt ends
# with the header of the assistant's turn. The model's turn ends at EOS (or a stop string).
CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
ASSISTANT_HEADER = "<|assistant|>\n"


class ApiError(Exception):
    """An error in OpenAI's shape, `{"error": {"message", "type", "code"}}`, with its HTTP status."""

    def __init__(self, status: int, kind: str, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.message = status, kind, code, message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.code}}


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", code, message)


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False  # the usage comes with the last event either way


class UnservedSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling parameters Belayer does not serve, at the value that turns each off, in every shape."""

    n: int = 1
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class ServedOnlyOff(UnservedSampling, frozen=True, kw_only=True):
    """And OpenAI's other parameters that Belayer does not serve."""

    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    suffix: str | None = None
    user: str | None = None  # an end user's name, for the caller's own records: taken, unused
    stream_options: StreamOptions | None = None


# Field -> the values that mean "off" (None: not given).
OFF: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (None, 1),
    "top_p": (None, 1.0),
    "top_k": (None, -1, 0),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "echo": (False,),
    "suffix": (None, ""),
}


def refuse_unserved(body: UnservedSampling) -> None:
    for name, off in OFF.items():
        if not hasattr(body, name):  # a shape without the parameter
            continue
        value = getattr(body, name)
        if value not in off:
            raise bad_request(
                "unsupported_parameter",
                f"{name}={value!r} is not supported: Belayer samples from the whole tempered distribution,"
                f" one sequence per request ({name} may only be {' or '.join(repr(v) for v in off if v is not None)})",
            )


class Extensions(ServedOnlyOff, frozen=True, kw_only=True):
    """vLLM's extensions that an RL framework uses, and Belayer's sampling parameters."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    seed: int | None = None
    stream: bool = False
    stop: str | list[str] | None = None
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    request_id: str | None = None  # to retry or re-attach without waiting for the first answer
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None


class CompletionBody(Extensions, frozen=True, kw_only=True):
    prompt: str | list[int]
    logprobs: int | None = None  # 0: each token's own logprob; top alternatives are not served


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None


class ChatBody(Extensions, frozen=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # 0 or absent: top alternatives are not served


class SglangSampling(UnservedSampling, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    stop: str | list[str] | None = None
    min_new_tokens: int = 0
    sampling_seed: int | None = None
    skip_special_tokens: bool = True  # EOS never shows in the text either way
    no_stop_trim: bool = False  # a matched stop string stays in the text either way


class GenerateBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SglangSampling = SglangSampling()
    return_logprob: bool = False
    stream: bool = False
    rid: str | None = None
    model: str | None = None  # not SGLang's; when given, it must be the served model


@dataclass(frozen=True)
class Job:
    """What any shape of request asks the router for, and what its answer includes."""

    shape: Shape
    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams
    stream: bool
    logprobs: bool  # include each token's logprob
    token_ids: bool  # include the prompt's and the output's token ids
    model: str


def new_request_id() -> str:
    return "gw-" + uuid.uuid4().hex


def new_seed() -> int:
    """A seed for a request that names none: the response returns it, so the sample can be drawn again."""
    return secrets.randbits(63)


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def rendered_chat(messages: list[ChatMessage]) -> str:
    if not messages:
        raise bad_request("invalid_messages", "messages must not be empty")
    return "".join(CHAT_TEMPLATE.format(role=m.role, content=m.content) for m in messages) + ASSISTANT_HEADER


def prompt_ids(prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < tokenizer.VOCAB_SIZE]
    if bad:
        raise bad_request("invalid_prompt", f"token ids are 0..{tokenizer.VOCAB_SIZE - 1}; got {bad[:5]}")
    return list(prompt)


def sampling(
    temperature: float, seed: int | None, stop: list[str], min_tokens: int, allowed: list[int] | None
) -> SamplingParams:
    """Belayer's SamplingParams, or a 400 that says which value is out of its range."""
    try:
        return msgspec.convert(
            {
                "seed": new_seed() if seed is None else seed,
                "temperature": temperature,
                "stop": stop,
                "min_tokens": min_tokens,
                "allowed_tokens": allowed or [],
            },
            SamplingParams,
        )
    except msgspec.ValidationError as exc:
        raise bad_request("invalid_parameter", str(exc)) from None


def completion_job(body: CompletionBody) -> Job:
    refuse_unserved(body)
    if body.logprobs not in (None, 0):
        raise bad_request(
            "unsupported_parameter",
            f"logprobs={body.logprobs}: top alternatives are not served; logprobs=0 gives each token's own",
        )
    return Job(
        shape="completion",
        request_id=body.request_id or new_request_id(),
        prompt_tokens=prompt_ids(body.prompt),
        max_tokens=16 if body.max_tokens is None else body.max_tokens,
        sampling=sampling(
            body.temperature, body.seed, stop_list(body.stop), body.min_tokens, body.allowed_token_ids
        ),
        stream=body.stream,
        logprobs=body.logprobs is not None,
        token_ids=body.return_token_ids,
        model=body.model,
    )


def chat_job(body: ChatBody, context: int) -> Job:
    refuse_unserved(body)
    if body.top_logprobs not in (None, 0):
        raise bad_request(
            "unsupported_parameter",
            f"top_logprobs={body.top_logprobs}: top alternatives are not served; logprobs=true gives each token's own",
        )
    prompt = prompt_ids(rendered_chat(body.messages))
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return Job(
        shape="chat",
        request_id=body.request_id or new_request_id(),
        prompt_tokens=prompt,
        max_tokens=max(1, context - len(prompt)) if limit is None else limit,
        sampling=sampling(
            body.temperature, body.seed, stop_list(body.stop), body.min_tokens, body.allowed_token_ids
        ),
        stream=body.stream,
        logprobs=body.logprobs,
        token_ids=body.return_token_ids,
        model=body.model,
    )


def generate_job(body: GenerateBody, model: str) -> Job:
    params = body.sampling_params
    refuse_unserved(params)
    if (body.input_ids is None) == (body.text is None):
        raise bad_request("invalid_prompt", "give exactly one of input_ids and text")
    prompt = prompt_ids(body.input_ids if body.input_ids is not None else body.text or "")
    return Job(
        shape="generate",
        request_id=body.rid or new_request_id(),
        prompt_tokens=prompt,
        max_tokens=params.max_new_tokens,
        sampling=sampling(
            params.temperature, params.sampling_seed, stop_list(params.stop), params.min_new_tokens, None
        ),
        stream=body.stream,
        logprobs=body.return_logprob,
        token_ids=True,  # SGLang's answer always carries output_ids
        model=body.model or model,
    )
