"""The gateway's HTTP side: each request is authenticated, decoded into a Job (api.py), sent to the
router as the API key's own client, and answered in the shape it came in, whole or as server-sent
events.

Owns: nothing durable. The router holds every request and its tokens (the token log), so a stream
that breaks, or a gateway that dies, loses nothing: the client asks again with `Last-Event-ID:
<request id>:<position>` (each event's id) and gets exactly the rest, for as long as the router
keeps a request nobody follows (its --client-timeout, 60 s by default).

Ownership: the gateway calls the router as `gateway.<key name>` (shared/subjects.caller), so the
router records the key as the request's owner in the token log, and only that key may re-attach to
or cancel it, across restarts of the gateway and of the router.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import itertools
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from nats.aio.client import Client as NATS
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from belayer_rl.services.gateway.api import (
    ApiError,
    ChatBody,
    CompletionBody,
    GenerateBody,
    Job,
    bad_request,
    chat_job,
    completion_job,
    generate_job,
)
from belayer_rl.shared import tokenizer
from belayer_rl.shared.access import key_owner
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.config import GatewayConfig
from belayer_rl.shared.metrics import GatewayMetrics
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import GenerateEnd, TokenChunk

log = logging.getLogger("belayer.gateway")
T = TypeVar("T")

EVENT_ID = re.compile(r"^([A-Za-z0-9_-]{1,64}):([0-9]{1,9})\Z")  # <request id>:<tokens sent so far>
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort", "error": "abort"}
# Router codes, as the HTTP client sees them: (status, type, code).
ROUTER_ERRORS = {
    "no-workers": (503, "service_unavailable", "no_engine"),
    "unknown-request": (404, "invalid_request_error", "request_not_found"),
    "log-full": (503, "service_unavailable", "log_full"),
    "bad-request": (400, "invalid_request_error", "invalid_request"),
    "unknown-weight-version": (400, "invalid_request_error", "unknown_weight_version"),
    "engine-rejected": (400, "invalid_request_error", "engine_rejected"),
}


def router_error(code: str, message: str) -> ApiError:
    status, kind, api_code = ROUTER_ERRORS.get(code, (503, "service_unavailable", "router_unavailable"))
    return ApiError(status, kind, api_code, f"{code}: {message}")


def token_text(token: int) -> str:
    """A token as a string in a logprobs entry: its byte (U+FFFD for a byte of a longer UTF-8 character)."""
    return "<|eos|>" if token == tokenizer.EOS_TOKEN else bytes([token]).decode("utf-8", "replace")


class Text:
    """The text of a token stream, as it grows: bytes that begin a UTF-8 character wait for the rest."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, tokens: list[int]) -> str:
        return self.decoder.decode(tokenizer.decode_bytes(tokens))

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)


class Gateway:
    def __init__(self, config: GatewayConfig, nc: NATS, keys: dict[str, str], metrics: GatewayMetrics,
                 registry: CollectorRegistry | None) -> None:  # fmt: skip
        self.config = config
        self.nc = nc
        self.keys = keys  # digest -> key name
        self.metrics = metrics
        self.registry = registry  # the process's metrics, served on /metrics too (None: metrics off)
        self.context = PRESETS[config.preset].max_seq_len
        self.started = int(time.time())
        self.clients: dict[str, Client] = {}  # key name -> its client of the router
        self.running: collections.Counter[str] = collections.Counter()  # key name -> requests followed now
        self.router = Client(nc, subjects=config.subjects, client="gateway")  # for the router's status
        self.live_engines: int | None = None  # from the router's status, each second; None: no answer
        self.why_not = "the router has not answered yet"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_kb * 1024, middlewares=[self.envelope])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/requests/{request_id}/cancel", self.cancel)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    # ------------------------------------------------------------ around every request

    @web.middleware
    async def envelope(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error in OpenAI's shape, counted by code; every answer counted by endpoint."""
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "unknown"
        try:
            response: web.StreamResponse = await handler(request)
        except ApiError as exc:
            response = self.error_response(exc)
        except web.HTTPRequestEntityTooLarge as exc:
            response = self.error_response(
                ApiError(413, "invalid_request_error", "request_too_large", exc.text or "too large")
            )
        except web.HTTPException as exc:  # no such route, or method
            code = (
                "not_found"
                if exc.status == 404
                else "method_not_allowed"
                if exc.status == 405
                else "http_error"
            )
            response = self.error_response(ApiError(exc.status, "invalid_request_error", code, exc.reason))
        self.metrics.requests.labels(endpoint, str(response.status)).inc()
        return response

    def error_response(self, exc: ApiError) -> web.Response:
        self.metrics.errors.labels(exc.code).inc()
        return web.json_response(exc.body(), status=exc.status)

    def key_of(self, request: web.Request) -> str:
        scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
        name = key_owner(self.keys, bearer.strip()) if scheme.lower() == "bearer" and bearer else None
        if name is None:
            raise ApiError(401, "authentication_error", "invalid_api_key",
                           "give an API key: Authorization: Bearer <key> (`belayer creds` writes them)")  # fmt: skip
        return name

    def client_for(self, key: str) -> Client:
        """The key's own client of the router: the router records it as the owner of what it starts."""
        if key not in self.clients:
            self.clients[key] = Client(self.nc, subjects=self.config.subjects, client=f"gateway.{key}")
        return self.clients[key]

    @contextlib.contextmanager
    def admitted(self, key: str) -> Iterator[None]:
        if self.running[key] >= self.config.max_concurrent:
            raise ApiError(429, "rate_limit_error", "too_many_requests",
                           f"this key has {self.running[key]} requests running; at most {self.config.max_concurrent}")  # fmt: skip
        self.running[key] += 1
        self.metrics.running.inc()
        try:
            yield
        finally:
            self.running[key] -= 1
            self.metrics.running.dec()

    async def refresh(self) -> None:
        """How many engines the router sees live (a new request with none gets a 503 at once)."""
        try:
            status = await self.router.status(patience_s=0.5)
        except (ServiceError, TimeoutError) as exc:
            self.live_engines, self.why_not = None, f"the router does not answer: {exc}"
            return
        self.live_engines = sum(e.alive for e in status.engines)
        self.why_not = "" if self.live_engines else "the router sees no live engine"

    # ------------------------------------------------------------ endpoints

    async def completions(self, request: web.Request) -> web.StreamResponse:
        key = self.key_of(request)
        return await self.serve(request, key, completion_job(await self.body(request, CompletionBody)))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        key = self.key_of(request)
        return await self.serve(request, key, chat_job(await self.body(request, ChatBody), self.context))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        key = self.key_of(request)
        return await self.serve(
            request, key, generate_job(await self.body(request, GenerateBody), self.config.model_name)
        )

    async def cancel(self, request: web.Request) -> web.Response:
        key = self.key_of(request)
        request_id = request.match_info["request_id"]
        try:
            await self.client_for(key).cancel(request_id, patience_s=self.config.stream_patience_s)
        except ServiceError as exc:
            raise router_error(exc.code, exc.message) from None
        return web.json_response({"id": request_id, "object": "request.cancelled"})

    async def models(self, request: web.Request) -> web.Response:
        self.key_of(request)
        model = {"id": self.config.model_name, "object": "model", "created": self.started,
                 "owned_by": "belayer", "max_model_len": self.context}  # fmt: skip
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, _: web.Request) -> web.Response:
        if self.live_engines:
            return web.json_response({"status": "ok", "engines": self.live_engines})
        return web.json_response({"status": "unavailable", "why": self.why_not}, status=503)

    async def metrics_text(self, _: web.Request) -> web.Response:
        body = generate_latest(self.registry) if self.registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def body(self, request: web.Request, kind: type[T]) -> T:
        raw = await request.read()  # past --max-body-kb: HTTPRequestEntityTooLarge, a 413
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.ValidationError as exc:
            raise bad_request("invalid_request", str(exc)) from None
        except msgspec.DecodeError as exc:
            raise bad_request("invalid_json", f"the body is not JSON: {exc}") from None

    # ------------------------------------------------------------ one generation

    def check(self, job: Job) -> None:
        if job.model != self.config.model_name:
            raise ApiError(404, "invalid_request_error", "model_not_found",
                           f"the model {job.model!r} does not exist; this gateway serves {self.config.model_name!r}")  # fmt: skip
        if job.max_tokens < 1:
            raise bad_request("invalid_parameter", f"max_tokens must be at least 1, got {job.max_tokens}")
        if len(job.prompt_tokens) + job.max_tokens > self.context:
            raise bad_request("context_length_exceeded",
                              f"the prompt's {len(job.prompt_tokens)} tokens and max_tokens {job.max_tokens} exceed"
                              f" the model's context of {self.context} tokens")  # fmt: skip

    def resumed_at(self, request: web.Request) -> tuple[str, int] | None:
        """(request id, position) a client takes a stream up again from: the `Last-Event-ID` header,
        or the query's `resume=<request id>:<position>`."""
        given = request.headers.get("Last-Event-ID") or request.query.get("resume")
        if not given:
            return None
        match = EVENT_ID.match(given)
        if match is None:
            raise bad_request("invalid_event_id", f"an event id is <request id>:<position>, got {given!r}")
        return match.group(1), int(match.group(2))

    async def serve(self, request: web.Request, key: str, job: Job) -> web.StreamResponse:
        self.check(job)
        resume = self.resumed_at(request)
        # Only when the router said so: one that does not answer may be failing over, which a
        # request rides out (--stream-patience).
        if resume is None and self.live_engines == 0:
            raise ApiError(503, "service_unavailable", "no_engine", f"no engine serves now: {self.why_not}")
        with self.admitted(key):
            if resume is not None:
                self.metrics.resumed_streams.inc()
            async with contextlib.aclosing(self.follow(key, job, resume)) as items:  # its inbox let go
                if job.stream:
                    return await self.stream(request, job, items, resume)
                return await self.whole(job, items, resume)

    async def follow(self, key: str, job: Job, resume: tuple[str, int] | None
                     ) -> AsyncGenerator[TokenChunk | GenerateEnd, None]:  # fmt: skip
        """The request's chunks from position 0 (a resumed one's too: its text is rebuilt from them)."""
        client = self.client_for(key)
        patience = self.config.stream_patience_s
        if resume is not None:
            stream = client.attach(resume[0], 0, patience_s=patience)
        else:
            s = job.sampling
            stream = client.generate(job.prompt_tokens, max_tokens=job.max_tokens, seed=s.seed,
                                     temperature=s.temperature, stop=s.stop, min_tokens=s.min_tokens,
                                     allowed_tokens=s.allowed_tokens, request_id=job.request_id,
                                     patience_s=patience)  # fmt: skip
        try:
            async for item in stream:
                yield item
        except ServiceError as exc:
            raise router_error(exc.code, exc.message) from None
        except GenerationError as exc:
            raise router_error(exc.error.code, exc.error.message) from None

    async def whole(self, job: Job, items: AsyncIterator[TokenChunk | GenerateEnd],
                    resume: tuple[str, int] | None) -> web.Response:  # fmt: skip
        skip = resume[1] if resume is not None else 0
        request_id = resume[0] if resume is not None else job.request_id
        tokens: list[int] = []
        logprobs: list[float] = []
        started = time.monotonic()
        async for item in items:
            if isinstance(item, GenerateEnd):
                self.metrics.tokens.inc(max(0, len(tokens) - skip))
                shape = Shape(job, request_id, self.started)
                return web.json_response(shape.whole(tokens[skip:], logprobs[skip:], item),
                                         headers={"X-Request-Id": request_id})  # fmt: skip
            if not tokens:
                self.metrics.first_token.observe(time.monotonic() - started)
            tokens += item.tokens
            logprobs += item.logprobs
        raise ApiError(
            502, "service_unavailable", "stream_ended", f"{request_id}: the stream ended without an end"
        )

    async def stream(self, request: web.Request, job: Job, items: AsyncIterator[TokenChunk | GenerateEnd],
                     resume: tuple[str, int] | None) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: one per chunk the router relays, each with id `<request id>:<tokens
        sent so far>`; the last carries the end, then `data: [DONE]`. An error once the stream has
        begun is an event of its own (`{"error": ...}`)."""
        skip = resume[1] if resume is not None else 0
        request_id = resume[0] if resume is not None else job.request_id
        shape = Shape(job, request_id, self.started)
        text = Text()
        response: web.StreamResponse | None = None
        position = 0
        started = time.monotonic()
        try:
            async for item in items:
                if response is None:  # the router took it: from here on, the answer is a stream
                    response = await self.open_stream(request, request_id)
                if isinstance(item, GenerateEnd):
                    await send(response, shape.end_event(item, text.end()), f"{request_id}:{position}")
                    break
                new = item.tokens
                tail = max(0, min(len(new), skip - position))  # positions the client had before it left
                text.add(new[:tail])  # their text too: the decoder's state is the stream's
                position += len(new)
                if tail == len(new):
                    continue
                if not shape.sent_any and resume is None:
                    self.metrics.first_token.observe(time.monotonic() - started)
                self.metrics.tokens.inc(len(new) - tail)
                event = shape.chunk_event(new[tail:], item.logprobs[tail:], text.add(new[tail:]))
                await send(response, event, f"{request_id}:{position}")
        except ApiError as exc:
            if response is None:
                raise
            self.metrics.errors.labels(exc.code).inc()
            with contextlib.suppress(ConnectionError):  # told, if the client is still there
                await send(response, exc.body(), f"{request_id}:{position}")
        except ConnectionError:  # the client went away: the router keeps the request for its return
            log.info("%s: the client left at %d", request_id, position)
            return response or web.Response(status=499)
        assert response is not None
        with contextlib.suppress(ConnectionError):
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        return response

    async def open_stream(self, request: web.Request, request_id: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": request_id})  # fmt: skip
        await response.prepare(request)
        return response


async def send(response: web.StreamResponse, event: dict[str, Any], event_id: str) -> None:
    await response.write(b"id: " + event_id.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n")


def known(tokens: list[int], logprobs: list[float]) -> list[float | None]:
    """Each token's logprob; None where the router kept none (a request older than logprobs)."""
    return list(logprobs) if len(logprobs) == len(tokens) else [None] * len(tokens)


class Shape:
    """The answer to one Job in the shape it was asked in: a whole response, or its events."""

    def __init__(self, job: Job, request_id: str, created: int) -> None:
        self.job, self.request_id, self.created = job, request_id, created
        self.sent_any = False
        self.text_offset = 0  # characters of the token strings sent so far (a stream's text_offset)

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.job.model}

    def completion_logprobs(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.job.logprobs:
            return None
        texts = [token_text(t) for t in tokens]
        offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=self.text_offset))
        self.text_offset += sum(len(t) for t in texts)
        return {
            "tokens": texts,
            "token_logprobs": known(tokens, logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }

    def chat_logprobs(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any] | None:
        if not self.job.logprobs:
            return None
        return {"content": [{"token": token_text(t), "logprob": lp, "bytes": [t] if t < 256 else [],
                             "top_logprobs": []} for t, lp in zip(tokens, known(tokens, logprobs), strict=True)]}  # fmt: skip

    def usage(self, end: GenerateEnd) -> dict[str, int]:
        prompt = len(self.job.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": end.num_tokens,
            "total_tokens": prompt + end.num_tokens,
        }

    def extras(self, end: GenerateEnd) -> dict[str, Any]:
        """What an RL framework reads beside the text: the weights every token came from and the seed."""
        return {"weight_version": end.weight_version, "seed": self.job.sampling.seed, "resumes": end.resumes}

    def sglang_meta(
        self, tokens: list[int], logprobs: list[float], end: GenerateEnd | None
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": self.request_id, "prompt_tokens": len(self.job.prompt_tokens),
                                "completion_tokens": len(tokens)}  # fmt: skip
        if self.job.logprobs:
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(tokens, known(tokens, logprobs), strict=True)
            ]
        if end is not None:
            reason = FINISH[end.finish_reason]
            meta["finish_reason"] = {"type": reason} | (
                {"length": end.num_tokens} if reason == "length" else {}
            )
            meta |= self.extras(end)
            meta["completion_tokens"] = end.num_tokens
        else:
            meta["finish_reason"] = None
        return meta

    # ------------------------------------------------------------ whole

    def whole(self, tokens: list[int], logprobs: list[float], end: GenerateEnd) -> dict[str, Any]:
        decoded = Text()
        text = decoded.add(tokens) + decoded.end()  # as the stream's pieces would add up
        reason = FINISH[end.finish_reason]
        ids = {"token_ids": tokens} if self.job.token_ids else {}
        prompt_ids = {"prompt_token_ids": self.job.prompt_tokens} if self.job.token_ids else {}
        if self.job.shape == "generate":
            return {"text": text, "output_ids": tokens, "meta_info": self.sglang_meta(tokens, logprobs, end)}
        if self.job.shape == "completion":
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(tokens, logprobs),
                      "finish_reason": reason} | prompt_ids | ids  # fmt: skip
            return (
                self.head("text_completion")
                | {"choices": [choice], "usage": self.usage(end)}
                | self.extras(end)
            )
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self.chat_logprobs(tokens, logprobs), "finish_reason": reason} | ids  # fmt: skip
        return (self.head("chat.completion") | {"choices": [choice], "usage": self.usage(end)} | prompt_ids
                | self.extras(end))  # fmt: skip

    # ------------------------------------------------------------ events

    def chunk_event(self, tokens: list[int], logprobs: list[float], text: str) -> dict[str, Any]:
        first = not self.sent_any
        self.sent_any = True
        ids = {"token_ids": tokens} if self.job.token_ids else {}
        if self.job.shape == "generate":
            return {"text": text, "output_ids": tokens, "meta_info": self.sglang_meta(tokens, logprobs, None)}
        if self.job.shape == "completion":
            prompt_ids = {"prompt_token_ids": self.job.prompt_tokens} if self.job.token_ids and first else {}
            choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(tokens, logprobs),
                      "finish_reason": None} | prompt_ids | ids  # fmt: skip
            return self.head("text_completion") | {"choices": [choice]}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": self.chat_logprobs(tokens, logprobs),
                  "finish_reason": None} | ids  # fmt: skip
        event = self.head("chat.completion.chunk") | {"choices": [choice]}
        if first and self.job.token_ids:
            event["prompt_token_ids"] = self.job.prompt_tokens
        return event

    def end_event(self, end: GenerateEnd, text: str) -> dict[str, Any]:
        reason = FINISH[end.finish_reason]
        if self.job.shape == "generate":
            return {"text": text, "output_ids": [], "meta_info": self.sglang_meta([], [], end)}
        if self.job.shape == "completion":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return (
                self.head("text_completion")
                | {"choices": [choice], "usage": self.usage(end)}
                | self.extras(end)
            )
        choice = {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": None,
            "finish_reason": reason,
        }
        return (
            self.head("chat.completion.chunk")
            | {"choices": [choice], "usage": self.usage(end)}
            | self.extras(end)
        )
