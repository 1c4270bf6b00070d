"""The async Python client: generate, attach, cancel, status.

    async with await Client.connect(url) as client:
        async for chunk in client.generate("hello", max_tokens=64, seed=1):
            print(chunk.tokens)

The stream a caller sees is exact and unbroken across failures: chunks are placed by position (a
repeat is dropped), and when the stream goes quiet, the bus reconnects or a gap shows, the client
re-attaches with (request id, last position seen) and the router sends exactly the rest. A router
restart therefore costs the caller nothing but a short pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from belayer_rl.shared import bus, protocol, tokenizer
from belayer_rl.shared.bus import ServiceError, Target
from belayer_rl.shared.protocol import (
    AttachRequest,
    CancelRequest,
    ClientKeepAlive,
    ClientStream,
    GenerateEnd,
    GenerateError,
    GenerateRequest,
    RouterStatus,
    SamplingParams,
    StatusRequest,
    TokenChunk,
)
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.client")

# Answers after which a call is made again: nobody serves yet (a router restarting), or a router
# that lost its lease answered before its successor did.
RETRYABLE = ("no-responders", "timeout", "not-leader", "log-unavailable")

_stream_decoder: msgspec.json.Decoder[ClientStream] = protocol.decoder_for(ClientStream)


class GenerationError(Exception):
    """The router ended the request with an error (for example no healthy engine in time)."""

    def __init__(self, error: GenerateError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


@dataclass(frozen=True)
class Generation:
    request_id: str
    tokens: list[int]
    finish_reason: str
    resumes: int
    weight_version: str | None
    # The logprob of each token (services/worker/sampling.py); [] if the router kept none for some
    # of them (a request begun in a token log written before logprobs were kept).
    logprobs: list[float] = field(default_factory=list)

    @property
    def text(self) -> str:
        return tokenizer.decode(self.tokens)


class Client:
    def __init__(
        self,
        nc: NATS,
        *,
        subjects: Subjects = Subjects(),
        client: str = "cli",
        rpc_timeout_s: float = 5.0,
        stall_s: float = 1.0,
        keepalive_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.subjects = subjects  # the cluster it talks to
        self.client = client  # who it is to the router (Access.client): it owns what it starts
        self.rpc_timeout_s = rpc_timeout_s
        self.stall_s = stall_s  # silence after which the stream re-attaches
        # How often a followed request is declared alive; the router cancels a request nobody
        # follows for its --client-timeout (60 s by default).
        self.keepalive_s = keepalive_s
        self.reconnects = 0
        self.streams: set[asyncio.Queue[Msg | None]] = set()  # None in a queue: re-attach now
        self.watching_router = False

    async def _watch_router(self) -> None:
        """A restarted router has forgotten our inboxes: tell every open stream to re-attach."""
        if self.watching_router:
            return
        self.watching_router = True

        async def on_router_started(_: Msg) -> None:
            for queue in self.streams:
                queue.put_nowait(None)

        await self.nc.subscribe(self.subjects.event("router_started", "*"), cb=on_router_started)

    @classmethod
    async def connect(cls, target: Target | str, name: str = "client", **kwargs: float) -> Client:
        """A client of the cluster `target` names (a bare URL: the default cluster, no credentials)."""
        if isinstance(target, str):
            target = Target(target)
        holder: list[Client] = []

        async def on_reconnect() -> None:
            if holder:
                holder[0].reconnects += 1

        nc = await target.connect(name, on_reconnect=on_reconnect)
        client = cls(nc, subjects=target.subjects, client=target.access.client, **kwargs)
        holder.append(client)
        return client

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.nc.close()

    # ------------------------------------------------------------ RPC with patience for restarts

    async def _call(self, subject: str, message: protocol.Message, *, patience_s: float) -> protocol.Ack:
        """Retry while nobody answers (the router restarting), or a router that lost its lease
        answers first (`not-leader`: its successor serves), up to `patience_s`."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return await bus.request(self.nc, subject, message, self.rpc_timeout_s)
            except ServiceError as exc:
                if exc.code not in RETRYABLE or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def cancel(self, request_id: str, *, patience_s: float = 10.0) -> None:
        await self._call(
            self.subjects.router_cancel(self.client),
            CancelRequest(request_id=request_id),
            patience_s=patience_s,
        )

    async def status(self, *, patience_s: float = 5.0) -> RouterStatus:
        """The router's view; a `not-leader` answer (a router that lost its lease and has not
        stopped yet) is asked again, up to `patience_s`."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return await bus.request_struct(
                    self.nc, self.subjects.router_status, StatusRequest(), RouterStatus, self.rpc_timeout_s
                )
            except ServiceError as exc:
                if exc.code != "not-leader" or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def wait_for_engines(self, count: int, timeout_s: float) -> RouterStatus:
        """Wait until the router answers and sees `count` live engines."""
        deadline = time.monotonic() + timeout_s
        seen = "the router never answered"
        while True:
            try:
                status = await self.status()
                if sum(e.alive for e in status.engines) >= count:
                    return status
                engines = [
                    f"{e.engine_id} epoch {e.epoch} pid {e.pid} alive={e.alive}" for e in status.engines
                ]
                seen = "the router sees " + (", ".join(engines) or "no engine")
            except ServiceError as exc:
                seen = f"the router did not answer: {exc}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} live engine(s) after {timeout_s:.0f}s ({seen})")
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------ streams

    async def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int,
        seed: int = 0,
        temperature: float = 1.0,
        stop: list[str] | None = None,
        min_tokens: int = 0,
        allowed_tokens: list[int] | None = None,
        request_id: str | None = None,
        weight_version: str | None = None,
        patience_s: float = 30.0,
    ) -> AsyncIterator[TokenChunk | GenerateEnd]:
        """Stream a new generation; ends with its GenerateEnd, raises GenerationError on an error end.
        `prompt` is text, or token ids (an agent's context). `weight_version` names the weights
        (None: the newest the weight server holds when the router accepts the request)."""
        request_id = request_id or uuid.uuid4().hex
        inbox = self.nc.new_inbox()
        request = GenerateRequest(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else "",
            prompt_tokens=None if isinstance(prompt, str) else list(prompt),
            max_tokens=max_tokens,
            sampling=SamplingParams(
                seed=seed,
                temperature=temperature,
                stop=stop or [],
                min_tokens=min_tokens,
                allowed_tokens=allowed_tokens or [],
            ),
            weight_version=weight_version,
            reply_to=inbox,
        )
        async with self._subscription(inbox) as queue:
            try:
                await self._call(self.subjects.router_generate(self.client), request, patience_s=patience_s)
            except ServiceError as exc:
                if exc.code != "duplicate-request":  # an earlier try did get through
                    raise
            async for item in self._follow(request_id, inbox, queue, 0, patience_s):
                yield item

    async def attach(
        self, request_id: str, from_position: int = 0, *, patience_s: float = 30.0
    ) -> AsyncIterator[TokenChunk | GenerateEnd]:
        """Follow an existing request from `from_position` to its end."""
        inbox = self.nc.new_inbox()
        async with self._subscription(inbox) as queue:
            await self._attach(request_id, from_position, inbox, patience_s)
            async for item in self._follow(request_id, inbox, queue, from_position, patience_s):
                yield item

    async def generate_all(self, prompt: str | list[int], **kwargs: Any) -> Generation:
        """Run a generation to its end and return every token."""
        tokens: list[int] = []
        logprobs: list[float] = []
        request_id = ""
        async for item in self.generate(prompt, **kwargs):
            request_id = item.request_id
            if isinstance(item, TokenChunk):
                tokens.extend(item.tokens)
                logprobs.extend(item.logprobs)
            else:
                whole = logprobs if len(logprobs) == len(tokens) else []
                return Generation(
                    request_id, tokens, item.finish_reason, item.resumes, item.weight_version, whole
                )
        raise AssertionError(f"stream of {request_id} ended without an end message")

    @contextlib.asynccontextmanager
    async def _subscription(self, inbox: str) -> AsyncIterator[asyncio.Queue[Msg | None]]:
        await self._watch_router()
        queue: asyncio.Queue[Msg | None] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            queue.put_nowait(msg)

        sub = await self.nc.subscribe(inbox, cb=on_message)
        self.streams.add(queue)
        try:
            yield queue
        finally:
            self.streams.discard(queue)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _attach(self, request_id: str, position: int, inbox: str, patience_s: float) -> None:
        attach = AttachRequest(request_id=request_id, from_position=position, reply_to=inbox)
        await self._call(self.subjects.router_attach(self.client), attach, patience_s=patience_s)

    async def _follow(
        self, request_id: str, inbox: str, queue: asyncio.Queue[Msg | None], position: int, patience_s: float
    ) -> AsyncIterator[TokenChunk | GenerateEnd]:
        """Yield chunks in position order, each token once; re-attach on silence, gap, reconnect
        or router restart."""
        reconnects = self.reconnects
        heard_at = kept_alive_at = time.monotonic()
        while True:
            if time.monotonic() - kept_alive_at >= self.keepalive_s:
                kept_alive_at = time.monotonic()
                with contextlib.suppress(Exception):  # reconnecting: the next one goes out
                    await bus.publish(
                        self.nc,
                        self.subjects.router_keepalive(self.client),
                        ClientKeepAlive(request_ids=[request_id]),
                    )
            try:
                msg = await asyncio.wait_for(queue.get(), min(self.stall_s, self.keepalive_s))
            except TimeoutError:
                if time.monotonic() - heard_at < self.stall_s:
                    continue  # quiet, not yet stalled: time for a keepalive
                msg = None
            heard_at = time.monotonic()
            if msg is None:
                await self._attach(request_id, position, inbox, patience_s)
                continue
            if self.reconnects != reconnects:
                reconnects = self.reconnects
                await self._attach(request_id, position, inbox, patience_s)
            try:
                item = protocol.decode(_stream_decoder, msg.data)
            except protocol.BadMessage as exc:
                log.warning("dropped an unreadable message on %s's stream: %s", request_id, exc)
                continue
            if item.request_id != request_id:  # not this stream's: whoever sent it, it is no token of ours
                log.warning("dropped a message of request %s on %s's stream", item.request_id, request_id)
                continue
            if isinstance(item, GenerateError):
                raise GenerationError(item)
            if isinstance(item, GenerateEnd):
                if item.num_tokens > position:  # the end overtook chunks: fetch them first
                    await self._attach(request_id, position, inbox, patience_s)
                    continue
                yield item
                return
            if item.position > position:
                await self._attach(request_id, position, inbox, patience_s)
                continue
            fresh = item.tokens[position - item.position :]
            if fresh:
                logprobs = item.logprobs[position - item.position :]
                yield TokenChunk(request_id=request_id, position=position, tokens=fresh, logprobs=logprobs)
                position += len(fresh)
