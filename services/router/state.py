"""What the router knows, as plain data: a request (its tokens so far, its attempt, who follows it)
and an engine (its epoch, pid, last heartbeat). router.py acts on them; takeover.py rebuilds them
from the token log."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.metrics import ResumeCause
from belayer_rl.shared.protocol import GenerateEnd, GenerateError, LogEnd, LogStart

ATTEMPT_BITS = 32  # an attempt id is incarnation << ATTEMPT_BITS | its number in the incarnation


@dataclass
class Request:
    start: LogStart
    tokens: list[int] = field(default_factory=list)
    # The logprobs of tokens[:len(logprobs)]: every token, unless the request began in a token log
    # written before logprobs were kept; then they stop where the first record without them is.
    logprobs: list[float] = field(default_factory=list)
    attempt: int = 0  # 0: not dispatched by this router
    engine_id: str | None = None
    epoch: int = 0
    resumes: int = 0
    dispatches: int = 0
    logged_chunks: int = 0  # full chunks queued for the token log
    dispatching: bool = False
    prefer_engine: str | None = None  # only this engine until prefer_until (grace, spreading)
    prefer_until: float = 0.0
    waiting_since: float | None = None  # monotonic time it started waiting for an engine
    progress_at: float = 0.0  # monotonic time of its attempt's dispatch or last new token
    end: GenerateEnd | GenerateError | None = None
    ended_at: float = 0.0
    # Client inboxes, oldest first (a dict keeps order): at most router.MAX_WATCHERS, the newest.
    watchers: dict[str, None] = field(default_factory=dict)
    followed_at: float = field(default_factory=time.monotonic)  # a client's last sign of interest
    refused_by: dict[tuple[str, int], str] = field(default_factory=dict)  # (engine, epoch) -> why
    last_dispatch_error: str = ""  # why its latest unacknowledged dispatch failed (a no-workers error says)
    # Since when, and why first, it waits for the first token of a resumed attempt (metrics).
    interrupted: tuple[float, ResumeCause] | None = None
    # A request rebuilt from the token log: positions from here up to what a re-attaching client
    # says it had were relayed by the previous router, so producing them again is regeneration.
    # None for a request this router started: its clients have only what it relayed.
    replayed_to: int | None = None
    client_had: int = 0  # the most tokens a client re-attaching to a rebuilt request reported
    end_record: LogEnd | None = None  # once ended: its log record,
    end_logged: asyncio.Future[ServiceError | None] | None = (
        None  # and whether it is durable (None: read from the log)
    )
    # Where its last accepted token came from: (engine, epoch, attempt); what a chunk records.
    source: tuple[str, int, int] = ("", 0, 0)

    @property
    def request_id(self) -> str:
        return self.start.request_id

    @property
    def remaining(self) -> int:
        return self.start.max_tokens - len(self.tokens)

    def extend(self, tokens: list[int], logprobs: list[float]) -> None:
        if len(self.logprobs) == len(self.tokens):
            self.logprobs.extend(logprobs)
        self.tokens.extend(tokens)

    def logprobs_of(self, start: int, end: int) -> list[float]:
        """The logprobs of tokens [start, end), or [] where some of them are not kept."""
        return self.logprobs[start:end] if end <= len(self.logprobs) else []


@dataclass
class EngineState:
    engine_id: str
    epoch: int
    pid: int
    last_beat: float
    alive: bool = True
    quarantined: bool = False
    failed_reason: str = ""  # why it is not alive: "exit" is final, "heartbeat-timeout" may end
    requests: set[str] = field(default_factory=set)
    weight_version: str | None = None  # its current version, from its heartbeats


def end_message(start: LogStart, record: LogEnd) -> GenerateEnd | GenerateError:
    if record.finish_reason == "error":
        return GenerateError(
            request_id=record.request_id,
            code=record.error_code,
            message=record.error,
            num_tokens=record.num_tokens,
        )
    return GenerateEnd(
        request_id=record.request_id,
        finish_reason=record.finish_reason,
        num_tokens=record.num_tokens,
        resumes=record.resumes,
        weight_version=start.weight_version,
    )
