"""verl's server-manager call, served by Belayer's HTTP gateway: token ids in, token ids and their
logprobs out, with the stop reason and the weight version.

verl's agent loops generate through `server_manager.generate(...)`; its signature in verl 0.9.1
(verl/workers/rollout/llm_server.py, LLMServerClient):

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, audio_data=None, mm_processor_kwargs=None,
                       **kwargs) -> TokenOutput

and TokenOutput (verl/workers/rollout/replica.py) holds `token_ids`, `log_probs`, `stop_reason`
("completed", "aborted" or None) and `extra_fields` (verl reads `global_steps` there).

`BelayerServerClient` stands where verl's LLMServerClient does. Each call is one request to the
gateway's /v1/completions with the prompt as ids, `logprobs: 0` and `return_token_ids`, under a
fresh Belayer request id (verl's `request_id` names a sticky session that spans turns, and a
Belayer request id names one generation). A worker that dies, a router that fails over, are
Belayer's to recover: the call returns the same tokens and logprobs as without the fault.

What comes back:
- `token_ids`, `log_probs`: the generated tokens, and each one's log-probability under the
  distribution it was drawn from (temperature applied): verl's rollout log-probs;
- `stop_reason`: "completed" for EOS, a stop string or the length budget, "aborted" for a request
  that was cancelled;
- `extra_fields`: `weight_version` (Belayer's name of the weights every token came from),
  `global_steps` (the trainer step that published them, when the caller's `steps_of` knows it, else
  None), `belayer_request_id`, `resumes`.

Sampling parameters are forwarded to the gateway, which refuses what it does not serve (top_p below
1, penalties, ...) with an error that names it; this raises it as ValueError. Images, video and
audio are refused the same way.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import aiohttp

try:  # inside verl: its own output type
    from verl.workers.rollout.replica import TokenOutput
except ImportError:  # verl not installed: importable for reading; `generate` needs it
    TokenOutput = None  # type: ignore[assignment,misc]

# verl's sampling keys -> the gateway's (None: taken, nothing to send).
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
    "min_tokens": "min_tokens",
    "max_tokens": "max_tokens",
    "max_new_tokens": "max_tokens",
    "logprobs": None,  # every answer carries them
}


class BelayerServerClient:
    """verl's `server_manager`: `generate` through the gateway at `gateway_url` with `api_key`."""

    def __init__(
        self,
        config: Any = None,
        *,
        gateway_url: str = "http://127.0.0.1:8000",
        api_key: str,
        model: str = "belayer",
        steps_of: Callable[[str], int | None] = lambda version: None,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.url = gateway_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.model = model
        self.steps_of = steps_of  # weight version -> the trainer step that published it
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    def response_length(self) -> int | None:
        """verl's rollout.response_length: the budget when the sampling parameters give none."""
        try:
            return int(self.config.actor_rollout_ref.rollout.response_length)
        except (AttributeError, TypeError, ValueError):
            return None

    def body(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(sampling_params) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling parameters Belayer does not know: {unknown}")
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt_ids), "logprobs": 0,
                                "return_token_ids": True, "request_id": f"verl-{uuid.uuid4().hex}"}  # fmt: skip
        for key, value in sampling_params.items():
            if SAMPLING_KEYS[key] is not None and value is not None:
                body[SAMPLING_KEYS[key]] = value
        if "max_tokens" not in body and self.response_length() is not None:
            body["max_tokens"] = self.response_length()
        return body

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        if TokenOutput is None:
            raise RuntimeError("verl is not installed: BelayerServerClient returns verl's TokenOutput")
        if any(x is not None for x in (image_data, video_data, audio_data)):
            raise ValueError("Belayer's engines take token ids only: no images, video or audio")
        body = self.body(prompt_ids, sampling_params)
        async with (
            aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as http,
            http.post(f"{self.url}/v1/completions", json=body) as answer,
        ):
            reply = await answer.json()
        if answer.status != 200:  # an error in OpenAI's shape
            raise ValueError(
                f"the gateway answered {answer.status}: {reply['error']['code']}: {reply['error']['message']}"
            )
        choice = reply["choices"][0]
        version = reply["weight_version"]
        logprobs = choice["logprobs"]["token_logprobs"]  # None entries: a request older than logprobs
        return TokenOutput(
            token_ids=choice["token_ids"],
            log_probs=None if None in logprobs else logprobs,
            stop_reason="aborted" if choice["finish_reason"] == "abort" else "completed",
            extra_fields={
                "weight_version": version,
                "global_steps": self.steps_of(version) if version else None,
                "belayer_request_id": reply["id"],
                "resumes": reply["resumes"],
            },
        )
