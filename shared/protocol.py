"""The wire contract: every message that crosses the bus, defined once.

Each message is a frozen, keyword-only msgspec Struct tagged by its `type` field and carrying the
schema version `v`. Decoders are built once per subject (`decoder_for`) and decoding happens first
thing in a handler (`decode`), so past the edge there are only Structs.

Schema evolution: new fields get defaults; field types never change; deprecated fields stay; the
high-rate token chunks are array_like and therefore append-only.

Versions are per message type: `v` defaults to the type's current version, and a change to a type's
shape bumps that type alone. The compatibility rule: every version decodes the one before it (a
record already stored, or a message from a service not yet upgraded), and refuses a newer one with
a clear error. So services are upgraded one at a time, readers of a type before its writers: the
workers before the router for `Dispatch`, the router before clients for `GenerateRequest`.
Version 2 of GenerateRequest, Dispatch and LogStart carries one SamplingParams instead of the
flat seed/temperature/stop of version 1; a version-1 message is read into the same Struct. Version 3
adds SamplingParams.min_tokens and GenerateRequest.prompt_tokens. Version 5 of Dispatch alone: the
worker answers with WorkerFrames that carry logprobs (one per engine step, for every sequence it
holds), where a worker of version 4 answered with per-request chunks that routers no longer read.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

SCHEMA_VERSION = 1  # of a message type that never changed
SAMPLING_VERSION = 2  # GenerateRequest, Dispatch, LogStart: sampling moved into SamplingParams
# GenerateRequest, Dispatch, LogStart: SamplingParams.min_tokens, GenerateRequest.prompt_tokens. A
# reader of version 2 would drop both silently (unknown fields are ignored), so it refuses version 3.
AGENT_TURNS_VERSION = 3
# The same three: SamplingParams.allowed_tokens, which a reader of version 3 would ignore and then
# sample outside the set a trainer's policy is defined over.
ALLOWED_TOKENS_VERSION = 4
# Dispatch alone: a worker of version 4 would answer in WorkerChunks, which routers no longer read.
FRAMES_VERSION = 5
MAX_MESSAGE_BYTES = 1 << 20  # larger payloads are rejected before decoding
MAX_BEAT_ATTEMPTS = 4096  # attempt ids one heartbeat lists

RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
ClientName = Annotated[str, Meta(max_length=128)]  # Access.client: a credential's name
EngineId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 16)]
MAX_PROMPT_BYTES = 1 << 16  # = the most tokens a Tokens list holds
Tokens = Annotated[list[TokenId], Meta(max_length=MAX_PROMPT_BYTES)]
# The log-probability of a generated token under the distribution it was drawn from (temperature
# and allowed tokens applied; services/worker/sampling.py). Finite: NaN and infinities are refused.
Logprob = Annotated[float, Meta(ge=-1e30, le=0.0)]
# Beside a Tokens list, one per token; empty where none were kept (a record older than logprobs).
Logprobs = Annotated[list[Logprob], Meta(max_length=MAX_PROMPT_BYTES)]
Position = Annotated[int, Meta(ge=0)]
Epoch = Annotated[int, Meta(ge=0)]
Incarnation = Annotated[int, Meta(ge=0, lt=1 << 31)]  # a router lease's; attempt ids start with it
Seed = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Temperature = Annotated[float, Meta(ge=0.0, le=10.0)]
StopStrings = Annotated[list[Annotated[str, Meta(min_length=1, max_length=64)]], Meta(max_length=8)]
Subject = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\s*>]+\Z")]
WeightVersion = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_:-]+\Z")]

FinishReason = Literal["eos", "stop", "length", "cancelled", "error"]

# Every error code that crosses the wire (ErrorReply, GenerateError, a log end), shared by the side
# that raises it (ServiceError) and the side that matches it. A new code is a schema change.
ErrorCode = Literal[
    # any service: the runtime's envelope and the bus
    "bad-request", "internal", "timeout", "no-responders", "unavailable",
    # router
    "duplicate-request", "unknown-request", "no-workers", "unknown-weight-version", "log-unavailable", "log-full",
    "engine-rejected", "too-many-attempts", "not-leader",
    # worker, and the token log: something from a router incarnation that lost its lease
    "stale-epoch", "stale-attempt", "wrong-engine", "weight-version", "fenced",
    # weight and KV servers
    "unknown-version", "bad-weights", "dead-holder", "unknown-engine", "unknown-preset", "shape-mismatch",
    "too-large", "no-space", "unknown-object", "holder-alive", "no-access", "pin-quota",
    # trainer groups, and the shadow supervisor's engine restarts
    "update-failed", "engine-quarantined", "restart-failed",
    # a stored record that does not decode (skipped, reported as record_skipped)
    "bad-record",
    # checkpointer
    "env-failure", "no-sandbox", "exists", "destroyed", "no-image", "create-failed", "wrong-step",
    "wrong-host", "wrong-trajectory", "stale", "no-checkpoint", "checkpoint-failed", "not-allowed",
    "host-full", "conflict", "daemon-unavailable", "store-full", "restore-failed",
]  # fmt: skip
# An ErrorCode as it crosses the wire: decoded as text, so a code that a newer version added is not
# a decode failure for an older reader (nor a stored log end unreadable); raised only from ErrorCode.
WireCode = Annotated[str, Meta(max_length=64)]


def check_logprobs(tokens: list[int], logprobs: list[float]) -> None:
    """Logprobs are one per token, or none at all (kept nowhere)."""
    if logprobs and len(logprobs) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = SCHEMA_VERSION


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How tokens are drawn: one struct from the client's request through the token log to every
    dispatch. Sampling is keyed by (seed, position), so a resume with the same params is exact."""

    seed: Seed = 0
    temperature: Temperature = 1.0
    stop: StopStrings = []
    # EOS cannot be drawn before this many generated tokens (a scripted agent's response length).
    min_tokens: Annotated[int, Meta(ge=0, le=65536)] = 0
    # Only these token ids can be drawn (empty: any). A trainer's task whose answers are digits
    # samples from the digits alone, and its policy is the softmax over the same set.
    allowed_tokens: Annotated[list[TokenId], Meta(max_length=512)] = []


class CarriesSampling(Message, frozen=True, kw_only=True):
    """A version-2 message with `sampling`. Version 1 had seed, temperature and stop as fields of
    its own; they stay, deprecated, so a version-1 message (or stored record) still decodes, and
    `__post_init__` (run by msgspec after decoding) moves them into `sampling`."""

    v: int = ALLOWED_TOKENS_VERSION
    sampling: SamplingParams = SamplingParams()
    seed: Seed | None = None  # deprecated: version 1
    temperature: Temperature | None = None  # deprecated: version 1
    stop: StopStrings | None = None  # deprecated: version 1

    def __post_init__(self) -> None:
        flat = (self.seed, self.temperature, self.stop)
        if self.v >= SAMPLING_VERSION and flat == (None, None, None):
            return
        legacy = SamplingParams(
            seed=self.seed if self.seed is not None else 0,
            temperature=self.temperature if self.temperature is not None else 1.0,
            stop=self.stop or [],
        )
        # Version 1, or a message that left `v` out (version 1 allowed that) and gave only the
        # flat fields: they are the sampling. Both, disagreeing, is refused, never guessed.
        if self.v < SAMPLING_VERSION or self.sampling == SamplingParams():
            msgspec.structs.force_setattr(self, "sampling", legacy)
        elif self.sampling != legacy:
            raise ValueError("give `sampling` or the deprecated seed/temperature/stop, not both")


# ---------------------------------------------------------------- client <-> router


class GenerateRequest(CarriesSampling, tag="generate", frozen=True, kw_only=True):
    request_id: RequestId
    prompt: Annotated[str, Meta(max_length=65536)]
    # The prompt as token ids, instead of `prompt` (which must then be empty): an agent's context,
    # whose generated bytes need not be UTF-8 and would not survive a round trip through text.
    prompt_tokens: Tokens | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=65536)]
    # The weights every token is generated with, across resumes. None: the newest version the
    # weight server holds when the router accepts the request.
    weight_version: WeightVersion | None = None
    reply_to: Subject  # the client's inbox; the stream of chunks goes there

    def __post_init__(self) -> None:
        super().__post_init__()
        # The prompt's UTF-8 bytes become its tokens (shared/tokenizer.py), which every record and
        # dispatch of the request carries: bounded like any Tokens list, so a LogStart always fits
        # a NATS payload and decodes again when the router restarts.
        if len(self.prompt) > MAX_PROMPT_BYTES // 4 and len(self.prompt.encode()) > MAX_PROMPT_BYTES:
            raise ValueError(
                f"the prompt is {len(self.prompt.encode())} bytes of UTF-8; at most {MAX_PROMPT_BYTES}"
            )


class AttachRequest(Message, tag="attach", frozen=True, kw_only=True):
    """Re-attach to a request: receive every token from `from_position` on, then its end."""

    request_id: RequestId
    from_position: Position = 0
    reply_to: Subject


class ClientKeepAlive(Message, tag="keepalive", frozen=True, kw_only=True):
    """A client still follows these requests (published while it streams; no reply). A request
    nobody has followed for the router's --client-timeout is cancelled: its client is gone."""

    request_ids: Annotated[list[RequestId], Meta(max_length=4096)]


class CancelRequest(Message, tag="cancel", frozen=True, kw_only=True):
    request_id: RequestId


class TokenChunk(Message, tag="chunk", frozen=True, kw_only=True):
    """Tokens [position, position + len(tokens)) of a request's generated sequence, with the
    logprob of each (empty: the token log kept none for them, a request older than logprobs)."""

    request_id: RequestId
    position: Position
    tokens: Tokens
    logprobs: Logprobs = []

    def __post_init__(self) -> None:
        check_logprobs(self.tokens, self.logprobs)


class GenerateEnd(Message, tag="end", frozen=True, kw_only=True):
    request_id: RequestId
    finish_reason: FinishReason
    num_tokens: Position
    resumes: Position = 0
    weight_version: WeightVersion | None = None  # the weights of every token; None: none was known


class GenerateError(Message, tag="error", frozen=True, kw_only=True):
    request_id: RequestId
    code: WireCode
    message: str
    num_tokens: Position = 0


ClientStream = TokenChunk | GenerateEnd | GenerateError


class Ack(Message, tag="ack", frozen=True, kw_only=True):
    detail: str = ""


class ErrorReply(Message, tag="error_reply", frozen=True, kw_only=True):
    code: WireCode
    message: str


Reply = Ack | ErrorReply


class StatsRequest(Message, tag="stats", frozen=True, kw_only=True):
    pass


class EndpointInfo(Message, tag="endpoint_info", frozen=True, kw_only=True):
    subject: str
    accepts: list[str]  # the message types decoded there
    reply: bool  # False: one-way (a bad message is dropped with a logged reason, not answered)


class ServiceStats(Message, tag="service_stats", frozen=True, kw_only=True):
    """A service process's own account (the runtime answers it on `belayer.<cluster>.svc.<name>.stats`)."""

    name: str
    pid: int
    ready: bool
    uptime_s: float
    handled: int  # messages taken off its endpoints
    errors: dict[str, int]  # error replies and dropped messages, by ErrorCode
    endpoints: list[EndpointInfo] = []  # what it serves, as declared
    metrics_port: int = 0  # where it serves /metrics and /healthz; 0: none (--metrics-port -1)


# ---------------------------------------------------------------- router <-> worker


class Dispatch(CarriesSampling, tag="dispatch", frozen=True, kw_only=True):
    """One attempt at a request on one engine. Resumes carry the tokens generated so far."""

    v: int = FRAMES_VERSION
    request_id: RequestId
    attempt: Annotated[int, Meta(ge=1)]
    epoch: Epoch
    engine_id: EngineId
    prompt_tokens: Tokens
    prefix_tokens: Tokens = []
    # Their logprobs, for the worker to hand back with the attempt (AdoptRequest); [] when the
    # router sends none (a prefix too long for one message): such an attempt is resumed, not adopted.
    prefix_logprobs: Logprobs = []
    max_tokens: Annotated[int, Meta(ge=1, le=65536)]  # what is left of the request's budget
    weight_version: WeightVersion | None = None  # None: whatever the engine serves now
    reply_to: Subject  # unused: a worker publishes its WorkerFrames on its engine's own stream
    # The lease incarnation of the router that sent it (services/router/lease.py). A worker refuses
    # any dispatch or cancel from an incarnation below the highest it has seen.
    incarnation: Incarnation = 0
    # Which router of that incarnation sent it (its lease's `holder`): if a lease revision is lost
    # (a power cut) two routers may hold one incarnation, and a worker takes only the first it saw.
    holder: Annotated[str, Meta(max_length=64)] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_logprobs(self.prefix_tokens, self.prefix_logprobs)


class CancelDispatch(Message, tag="cancel_dispatch", frozen=True, kw_only=True):
    request_id: RequestId
    attempt: Annotated[int, Meta(ge=0)] = 0  # 0 cancels every attempt of the request
    incarnation: Incarnation = 0
    holder: Annotated[str, Meta(max_length=64)] = ""  # as in Dispatch


class AdoptRequest(Message, tag="adopt", frozen=True, kw_only=True):
    """A router that just took the lease asks a worker what it holds, to carry those sequences on
    instead of generating their tokens again. The worker fences off every lower incarnation."""

    incarnation: Incarnation
    # The requests it asks about: those the token log shows running. The answer holds only these.
    request_ids: Annotated[list[RequestId], Meta(max_length=MAX_BEAT_ATTEMPTS)] = []
    holder: Annotated[str, Meta(max_length=64)] = ""  # as in Dispatch


class HeldAttempt(Message, tag="held_attempt", frozen=True, kw_only=True):
    request_id: RequestId
    attempt: int
    incarnation: Incarnation  # of the router that dispatched it
    tokens: Tokens  # every generated token of the request so far: the dispatch's prefix and its own
    finish_reason: FinishReason | None = None  # ended while no router listened: its end unheard
    # The logprobs of tokens[logprobs_from:]: every token's (0) when its dispatch carried the prefix's
    # logprobs, else those this attempt generated.
    logprobs: Logprobs = []
    logprobs_from: Position = 0

    def __post_init__(self) -> None:
        check_logprobs(self.tokens[self.logprobs_from :], self.logprobs)


class AdoptReply(Message, tag="adopt_reply", frozen=True, kw_only=True):
    engine_id: EngineId
    epoch: Epoch
    pid: int
    attempts: Annotated[list[HeldAttempt], Meta(max_length=MAX_BEAT_ATTEMPTS)]


class FrameSeq(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a WorkerFrame: its tokens [position, position + len(tokens)) and
    their logprobs, and its end if it ended in this step. An array on the wire (the hot path):
    fields are only ever appended."""

    request_id: RequestId
    attempt: int
    position: Position
    tokens: Tokens
    logprobs: Logprobs
    finish_reason: FinishReason | None = None
    num_tokens: Position = 0  # at an end: the generated tokens in all, prefix included
    error: Annotated[str, Meta(max_length=1024)] = ""  # at an "error" end: why the engine refused

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} logprobs")


class WorkerFrame(Message, tag="wframe", frozen=True, kw_only=True):
    """What one engine step produced, for every sequence that moved: a worker publishes one frame
    per step instead of a message per token per request. The router checks each sequence's
    attempt against the request's current one, and the frame's (engine, epoch) against the
    engine's."""

    epoch: Epoch
    engine_id: EngineId
    seqs: Annotated[list[FrameSeq], Meta(max_length=MAX_BEAT_ATTEMPTS)]


WorkerStream = WorkerFrame


class WorkerRegistration(Message, tag="register", frozen=True, kw_only=True):
    engine_id: EngineId
    epoch: Epoch
    pid: int
    preset: str
    weight_version: str


# ---------------------------------------------------------------- events (belayer.<cluster>.evt.>)


class Heartbeat(Message, tag="heartbeat", frozen=True, kw_only=True):
    engine_id: EngineId
    epoch: Epoch
    pid: int
    running: int
    waiting: int
    outstanding_tokens: int
    weight_version: WeightVersion | None = None  # what a request naming no version runs on here
    # The attempts it holds, queued or running (at most MAX_BEAT_ATTEMPTS of them): the router
    # counts an attempt's progress deadline only once its worker no longer holds it.
    attempts: Annotated[list[int], Meta(max_length=MAX_BEAT_ATTEMPTS)] = []


EngineFailure = Literal["exit", "heartbeat-timeout"]  # why the router gave an engine up


class WorkerFailed(Message, tag="worker_failed", frozen=True, kw_only=True):
    engine_id: EngineId
    epoch: Epoch
    pid: int
    reason: EngineFailure
    detail: str = ""


class RequestResumed(Message, tag="request_resumed", frozen=True, kw_only=True):
    request_id: RequestId
    attempt: int
    engine_id: EngineId
    epoch: Epoch
    from_position: Position
    reason: str


class RequestFailed(Message, tag="request_failed", frozen=True, kw_only=True):
    request_id: RequestId
    code: WireCode
    message: str


class ProcessEvent(Message, tag="process", frozen=True, kw_only=True):
    """A process supervised by `belayer up` started, exited or was restarted. "exited" is sent
    once the supervisor has reaped it: its death is confirmed."""

    name: str
    pid: int
    # The token the supervisor gave this start of the process ($BELAYER_INSTANCE): unlike a pid, it
    # names one process on one host, once.
    instance: Annotated[str, Meta(max_length=64)] = ""
    state: Literal["started", "exited", "restarting", "gave-up", "stopped"]
    exit_code: int | None = None
    backoff_s: float = 0.0


class RouterStarted(Message, tag="router_started", frozen=True, kw_only=True):
    router_pid: int
    rebuilt_requests: int
    resumed_requests: int
    incarnation: Incarnation = 0  # its lease's: workers refuse anything from a lower one after this


class RouterLease(Message, tag="router_lease", frozen=True, kw_only=True):
    """The router lease's value in its bucket (services/router/lease.py). Whoever wrote the key's
    current revision leads; a revision that stands still for `ttl_s` is a lease that expired."""

    incarnation: Incarnation
    pid: int
    host: Annotated[str, Meta(max_length=256)]
    ttl_s: Annotated[float, Meta(gt=0)]
    released: bool = False  # its holder stopped (a drain): a standby takes it at once
    instance: Annotated[str, Meta(max_length=64)] = ""  # its supervisor's token for it; "" if none
    holder: Annotated[str, Meta(max_length=64)] = ""  # a token of this router process, on its dispatches


class Handover(Message, tag="handover", frozen=True, kw_only=True):
    """An engine's worker was replaced. `path` is "shadow" (the pre-initialised shadow took over,
    reusing weights and arena) or "cold" (a worker from scratch; `cold_reason` says why)."""

    engine_id: EngineId
    reason: str  # what failed: "exit" or "hang"
    path: Literal["shadow", "cold"]
    cold_reason: str = ""
    old_pid: int
    new_pid: int
    epoch: Epoch
    detected_at: float  # wall-clock time the failure was noticed
    phases_ms: dict[str, float]  # kill confirmed, servers checked, arena flushed, promoted


class EngineQuarantined(Message, tag="engine_quarantined", frozen=True, kw_only=True):
    """An alert: the engine's workers failed `failures` times in a row, each within `window_s` of
    taking over; its device is treated as unhealthy until `belayer engines unquarantine`."""

    engine_id: EngineId
    failures: int
    window_s: float


class EngineUnstable(Message, tag="engine_unstable", frozen=True, kw_only=True):
    """An alert: the engine failed as often as a quarantine needs, but it is the last healthy one,
    so it is not quarantined on timing alone; it takes the cold path after `backoff_s`."""

    engine_id: EngineId
    failures: int
    window_s: float
    backoff_s: float


class WeightsPublished(Message, tag="weights_published", frozen=True, kw_only=True):
    """Event `belayer.<cluster>.evt.weights_published.<version>`: a new newest version is mapped and ready."""

    version: WeightVersion
    segment: SegmentName
    size: ByteCount
    previous: str  # the version that was newest before


# ---------------------------------------------------------------- JetStream records


class LogStart(CarriesSampling, tag="log_start", frozen=True, kw_only=True):
    """First record of a request's token log: everything needed to resume it."""

    request_id: RequestId
    prompt_tokens: Tokens
    max_tokens: int
    weight_version: WeightVersion | None = None  # as resolved at acceptance; a resume uses it too
    chunk_tokens: int  # k: chunk i of this log covers positions [i*k, (i+1)*k)
    # The client that started it (Access.client, from the subject it called on): only it may follow
    # or cancel it. "" in a log written before requests had owners: any client may.
    owner: ClientName = ""


class LogDispatch(Message, tag="log_dispatch", frozen=True, kw_only=True):
    """A router placed the request on an engine as `attempt`, from `position` (or, adopting it,
    carries on that engine's attempt): from here until the next LogDispatch, whole chunks come
    from this attempt alone. The record an oracle checks chunks against."""

    request_id: RequestId
    attempt: int
    engine_id: Annotated[str, Meta(max_length=64)]
    epoch: Epoch
    position: Position
    incarnation: Incarnation


class LogChunk(Message, tag="log_chunk", frozen=True, kw_only=True):
    request_id: RequestId
    index: Position
    position: Position
    tokens: Tokens
    # The attempt whose message completed the chunk (after an adoption, the adopted one), the
    # engine and epoch that ran it, and the router incarnation that accepted it (0 and "" in
    # records written before these were kept).
    attempt: int
    engine_id: Annotated[str, Meta(max_length=64)] = ""
    epoch: Epoch = 0
    incarnation: Incarnation = 0
    logprobs: Logprobs = []  # of each token ([] in records written before logprobs were kept)

    def __post_init__(self) -> None:
        check_logprobs(self.tokens, self.logprobs)


class LogEnd(Message, tag="log_end", frozen=True, kw_only=True):
    request_id: RequestId
    finish_reason: FinishReason
    num_tokens: Position
    resumes: Position = 0
    error_code: WireCode = ""  # "" when the request did not end in an error
    error: str = ""
    incarnation: Incarnation = 0  # the router that ended it


class LogTakeover(Message, tag="log_takeover", frozen=True, kw_only=True):
    """A router that took the lease claims a request still running: written with the subject's
    last sequence expected, so any append its predecessor still tries afterwards is refused."""

    request_id: RequestId
    incarnation: Incarnation
    position: Position  # the tokens the log held when it was claimed


LogRecord = LogStart | LogDispatch | LogChunk | LogEnd | LogTakeover


class LogOpen(Message, tag="log_open", frozen=True, kw_only=True):
    """The request index (services/router/retention.py): the request's records may be in the token
    log and it has not ended. Written before its LogStart, so a successor router finds every running
    request here without reading the log of every request ever made."""

    request_id: RequestId
    owner: ClientName


class LogClosed(Message, tag="log_closed", frozen=True, kw_only=True):
    """The request index: the request ended, and its records up to `end_sequence` leave the token
    log once it has been over for the router's --ended-keep. `size` (bytes) counts against its
    owner's share of the log until then."""

    request_id: RequestId
    owner: ClientName
    end_sequence: int
    size: ByteCount
    ended_at: float  # unix seconds


class IndexComplete(Message, tag="index_complete", frozen=True, kw_only=True):
    """The request index covers every request in the token log (a log older than the index has been
    read whole once, and indexed)."""

    since: float  # unix seconds


IndexEntry = LogOpen | LogClosed


class EngineEntry(Message, tag="engine", frozen=True, kw_only=True):
    """Engine registry value: who serves the engine now. `epoch` changes only by compare-and-set."""

    engine_id: EngineId
    epoch: Epoch
    pid: int
    health: Literal["serving", "quarantined"] = "serving"


class EngineStatus(Message, tag="engine_status", frozen=True, kw_only=True):
    engine_id: EngineId
    epoch: Epoch
    pid: int
    alive: bool
    outstanding_tokens: int
    weight_version: WeightVersion | None = None  # what its worker last reported serving


class RequestStatus(Message, tag="request_status", frozen=True, kw_only=True):
    request_id: RequestId
    engine_id: str
    attempt: int
    num_tokens: int
    max_tokens: int
    resumes: int


class RouterStatus(Message, tag="router_status", frozen=True, kw_only=True):
    engines: list[EngineStatus]
    requests: list[RequestStatus]
    incarnation: Incarnation = 0  # the answering router's lease incarnation


class StatusRequest(Message, tag="status", frozen=True, kw_only=True):
    pass


# ---------------------------------------------------------------- decoding at the edge


class BadMessage(ValueError):
    """A payload that is not a valid message for its subject. The text says why."""


StoreName = Literal["token-log", "request-index", "engine-registry", "prefix-pointers"]


class PoisonedRecord(BadMessage):
    """A record read back from a store does not decode. It is left where it is, for a person to
    look at; the reader skips it (the runtime reports it: RecordSkipped) and goes on."""

    def __init__(self, store: StoreName, key: str, sequence: int, reason: str) -> None:
        super().__init__(f"{store} record {key!r} (sequence {sequence}) does not decode: {reason}")
        self.store: StoreName = store
        self.key = key
        self.sequence = sequence
        self.reason = reason


class RecordSkipped(Message, tag="record_skipped", frozen=True, kw_only=True):
    """An alert: a stored record that does not decode was skipped (once per record and process).
    On `belayer.<cluster>.evt.record_skipped.<service>`."""

    service: Annotated[str, Meta(max_length=64)]
    store: StoreName
    key: Annotated[str, Meta(max_length=512)]  # the token log's subject, or the bucket's key
    sequence: int  # the stream sequence, or the key's revision
    reason: Annotated[str, Meta(max_length=1024)]


T = TypeVar("T")


@typing.overload
def decoder_for(kind: type[T]) -> msgspec.json.Decoder[T]: ...
@typing.overload
def decoder_for(kind: types.UnionType) -> msgspec.json.Decoder[Any]: ...
def decoder_for(kind: Any) -> msgspec.json.Decoder[Any]:
    """A decoder of one Struct, or of a union of tagged ones (what a subject may carry)."""
    return msgspec.json.Decoder(kind)


_encoder = msgspec.json.Encoder()


@functools.cache
def current_version(kind: type[Message]) -> int:
    """The version this code writes for `kind`: the default of its `v` field."""
    version: int = next(f.default for f in msgspec.structs.fields(kind) if f.name == "v")
    return version


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(decoder: msgspec.json.Decoder[T], payload: bytes) -> T:
    """Decode `payload` or raise BadMessage; also refuses oversized payloads and newer schemas."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"payload of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise BadMessage(str(exc)) from None
    except RecursionError:  # nesting deeper than the decoder's recursion can follow
        raise BadMessage("payload nested too deeply") from None
    if isinstance(message, Message) and message.v > (current := current_version(type(message))):
        raise BadMessage(f"{type(message).__name__} version {message.v} is newer than {current}")
    return message


def encoded_text(data: bytes, max_bytes: int) -> tuple[str, bool]:
    """`data` as text (UTF-8, undecodable bytes replaced) cut to the longest prefix whose encoding
    on the wire takes at most `max_bytes`, and whether it was cut. A byte can take six on the wire
    (a NUL is written \\u0000) and an undecodable one three (U+FFFD), so capping the bytes read is
    not enough to bound a reply."""
    text = data.decode(errors="replace")
    if len(_encoder.encode(text)) <= max_bytes:
        return text, False
    low, high = 0, min(len(text), max_bytes)  # every kept character takes one byte at least
    while low < high:  # the longest prefix that fits: its encoded size grows with its length
        middle = (low + high + 1) // 2
        if len(_encoder.encode(text[:middle])) <= max_bytes:
            low = middle
        else:
            high = middle - 1
    return text[:low], True


# ---------------------------------------------------------------- sandboxes
# The checkpointer's contract: RPC on `belayer.<cluster>.sandbox.<host>.<verb>.<client>`, events under
# `belayer.<cluster>.evt.`, prefix pointers in a JetStream KV bucket. Outputs of actions are text (UTF-8,
# undecodable bytes replaced) and capped; a cap that was hit is flagged, never silent.

SandboxId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
TrajectoryId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
HostId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
# A checkpoint's id becomes a folder name (and an object's): letters, digits, "_" and "-" only, so
# no stored pointer or manifest can name a path outside the store. Empty: the base image.
CheckpointId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,96}\Z")]
Step = Annotated[int, Meta(ge=0)]  # k: the number of actions completed in the sandbox
ImageRef = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]*\Z")]
Capability = Annotated[str, Meta(pattern=r"^[A-Z_]{2,32}\Z")]
Digest = Annotated[str, Meta(pattern=r"^(sha256:[0-9a-f]{64})?\Z")]
RestoreSource = Literal["latest", "previous", "base"]
# interrupted: the checkpointer stopped during an action, whose effect on the sandbox is unknown
EnvFailureReason = Literal[
    "dead", "oom-killed", "daemon-error", "exec-stream", "missing", "interrupted", "dump-stuck"
]


# Who every action of a sandbox runs as, and its init when the spec names its own `cmd`: `name`,
# `uid` or `uid:gid`, as Docker's `User`; empty: the image's USER (root when it names none), which
# the checkpointer then writes into the spec. The checkpointer's own idle init runs as root.
SandboxUser = Annotated[
    str,
    Meta(
        max_length=65, pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,31})?)?\Z"
    ),
]


class SandboxSpec(Message, tag="sandbox_spec", frozen=True, kw_only=True):
    """How a sandbox container is created; kept in every checkpoint so a restore recreates it.

    Safe by default: no network, every capability dropped, no-new-privileges, bounded memory and
    pids, no host mounts (there is no field for one). An empty `cmd` runs a shell that idles."""

    image: ImageRef
    cmd: Annotated[list[Annotated[str, Meta(max_length=4096)]], Meta(max_length=64)] = []
    env: Annotated[
        dict[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*\Z")], str], Meta(max_length=64)
    ] = {}
    workdir: Annotated[str, Meta(max_length=256, pattern=r"^(/.*)?\Z")] = ""
    memory_mb: Annotated[int, Meta(ge=16, le=1 << 20)] = 1024
    pids_limit: Annotated[int, Meta(ge=8, le=1 << 16)] = 512
    cpus: Annotated[float, Meta(gt=0.0, le=256.0)] = 1.0
    network: bool = False
    cap_add: Annotated[list[Capability], Meta(max_length=64)] = []
    user: SandboxUser = ""


class SandboxCreate(Message, tag="sandbox_create", frozen=True, kw_only=True):
    spec: SandboxSpec
    sandbox: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{0,64}\Z")] = ""  # empty: the checkpointer names it


class SandboxExec(Message, tag="sandbox_exec", frozen=True, kw_only=True):
    """Run one action, `/bin/sh -c command`, as the sandbox's action `step` + 1. The whole process
    group is SIGKILLed past `timeout_s`. `expect_step`, when given, refuses the action unless the
    sandbox has completed exactly that many actions."""

    sandbox: SandboxId
    command: Annotated[str, Meta(min_length=1, max_length=65536)]
    timeout_s: Annotated[float, Meta(gt=0.0, le=86400.0)] = 60.0
    expect_step: Step | None = None


class SandboxCheckpoint(Message, tag="sandbox_checkpoint", frozen=True, kw_only=True):
    """Checkpoint the sandbox at action boundary k for a trajectory, with the LLM context L_k:
    its tokens, or `context_ref`, a reference that lives as long as the checkpoint."""

    sandbox: SandboxId
    trajectory: TrajectoryId
    k: Step
    context_tokens: Tokens = []
    context_ref: Annotated[str, Meta(max_length=1024)] = ""
    timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 120.0


class SandboxRestore(Message, tag="sandbox_restore", frozen=True, kw_only=True):
    trajectory: TrajectoryId
    timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 300.0


class SandboxDestroy(Message, tag="sandbox_destroy", frozen=True, kw_only=True):
    sandbox: SandboxId


class SandboxList(Message, tag="sandbox_list", frozen=True, kw_only=True):
    pass


class TrajectoryEnd(Message, tag="trajectory_end", frozen=True, kw_only=True):
    """The trajectory is over: its checkpoints and its prefix pointer are deleted."""

    trajectory: TrajectoryId


SandboxRequest = (
    SandboxCreate
    | SandboxExec
    | SandboxCheckpoint
    | SandboxRestore
    | SandboxDestroy
    | SandboxList
    | TrajectoryEnd
)


class SandboxInfo(Message, tag="sandbox_info", frozen=True, kw_only=True):
    sandbox: SandboxId
    host_id: HostId
    container_id: str
    image: str
    state: Literal["running", "failed", "destroyed"]
    step: Step
    trajectory: str = ""
    incarnation: Annotated[int, Meta(ge=0)] = 0


class SandboxListing(Message, tag="sandbox_listing", frozen=True, kw_only=True):
    host_id: HostId
    sandboxes: list[SandboxInfo]


class ExecResult(Message, tag="exec_result", frozen=True, kw_only=True):
    """An observation. An exit code of 137 or a timeout is still an observation; an environment
    failure never is one (it is the ServiceError "env-failure" and an EnvFailure event)."""

    sandbox: SandboxId
    step: Step  # the action's number: the sandbox has now completed `step` actions
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


class CheckpointResult(Message, tag="checkpoint_result", frozen=True, kw_only=True):
    trajectory: TrajectoryId
    sandbox: SandboxId
    checkpoint_id: CheckpointId
    incarnation: Annotated[int, Meta(ge=0)]
    k: Step
    context_digest: Digest
    bytes_written: int
    freeze_s: float
    total_s: float


class RestoreResult(Message, tag="restore_result", frozen=True, kw_only=True):
    """Where the trajectory resumes: `source` says whether the newest checkpoint, an older one or the
    base image was used; `rejected` says why newer checkpoints were not."""

    trajectory: TrajectoryId
    sandbox: SandboxId
    container_id: str
    source: RestoreSource
    checkpoint_id: CheckpointId  # empty for the base image
    incarnation: Annotated[int, Meta(ge=0)]
    k: Step
    context_tokens: Tokens = []
    context_ref: str = ""
    context_digest: Digest = ""
    rejected: list[str] = []
    restore_s: float = 0.0


class CheckpointReady(Message, tag="checkpoint_ready", frozen=True, kw_only=True):
    trajectory: TrajectoryId
    sandbox: SandboxId
    host_id: HostId
    checkpoint_id: CheckpointId
    incarnation: Annotated[int, Meta(ge=0)]
    k: Step
    context_digest: Digest
    bytes_written: int
    freeze_s: float
    total_s: float


class EnvFailure(Message, tag="env_failure", frozen=True, kw_only=True):
    """The sandbox's environment failed (judged from the container's state, not an exit code)."""

    sandbox: SandboxId
    host_id: HostId
    container_id: str
    reason: EnvFailureReason
    detail: str = ""
    step: Step = 0


class TrajectoryEnded(Message, tag="trajectory_ended", frozen=True, kw_only=True):
    """Event `belayer.<cluster>.evt.trajectory_ended.<trajectory>`: `host_id` ended the
    trajectory and deleted its pointer and shared copies; every other host deletes its own."""

    trajectory: TrajectoryId
    host_id: HostId


class SandboxRestored(Message, tag="sandbox_restored", frozen=True, kw_only=True):
    trajectory: TrajectoryId
    sandbox: SandboxId
    host_id: HostId
    source: RestoreSource
    checkpoint_id: CheckpointId
    incarnation: Annotated[int, Meta(ge=0)]
    k: Step
    rejected: list[str] = []
    restore_s: float = 0.0


SandboxEvent = CheckpointReady | EnvFailure | SandboxRestored


class PrefixPointer(Message, tag="prefix_pointer", frozen=True, kw_only=True):
    """Prefix-pointer bucket value: a trajectory's latest ready checkpoint. Moves only forward in
    (incarnation, k), by compare-and-set; an empty `checkpoint_id` means the base image."""

    trajectory: TrajectoryId
    host_id: HostId
    sandbox: SandboxId
    checkpoint_id: CheckpointId
    incarnation: Annotated[int, Meta(ge=0)]
    k: Step
    context_digest: Digest = ""
    context_len: Annotated[int, Meta(ge=0)] = 0
    # The client that owns the trajectory (the last token of its sandbox calls): every host reads
    # it here, and only checkpointers write this bucket. "" in a pointer written before owners.
    owner: ClientName = ""


# ---------------------------------------------------------------- checkpoint policy
# The policy service (services/policy) answers PolicyDecide on `belayer.<cluster>.policy.decide`
# and learns from the rollout driver's EnvStep, LlmResponse and CheckpointTimeout events and from
# the checkpointer's CheckpointReady. Decision inputs are plain floats: the decision defines an
# answer for negatives and huge values (JSON has no NaN or infinity: a message with one is refused).

# A named checkpoint policy: the one spelling the wire, the service's flag and the parser accept.
POLICY_PATTERN = r"adaptive|never|always|every-[1-9][0-9]{0,5}"
PolicyName = Annotated[str, Meta(max_length=32, pattern=rf"^({POLICY_PATTERN})?\Z")]


class PolicyDecide(Message, tag="policy_decide", frozen=True, kw_only=True):
    """Should trajectory `trajectory` checkpoint its sandbox now, having completed `step` actions?"""

    trajectory: TrajectoryId
    host_id: HostId  # the checkpointer's host: its cooldown applies
    step: Step
    step_duration_s: float  # d: the last action's environment time
    # The work a failure would make the trajectory redo, the running response counted for the x
    # seconds it has run: C less the rest of that response, which the service expects.
    exposure_s: float
    env_work_s: float  # environment seconds since the last ready checkpoint
    elapsed_s: float  # x: seconds already waited for the current LLM response
    in_flight: bool = False  # a checkpoint of this trajectory is still running
    policy: PolicyName = ""  # empty: the service's --policy


class PolicyDecision(Message, tag="policy_decision", frozen=True, kw_only=True):
    """The answer, and the `policy_decision` event: the verdict with every input and term."""

    trajectory: TrajectoryId
    host_id: HostId
    step: Step
    policy: str
    checkpoint: bool
    reason: str
    p: float
    rate_per_s: float  # λ
    step_duration_s: float
    exposure_s: float  # C: the request's, and the rest of the running response the service expects
    elapsed_s: float
    cost_s: float  # c
    samples: int  # response times the distribution holds
    expected_visible_cost_s: float
    survival: float  # q(x; c)
    benefit_s: float  # p·C
    busy_s: float = 0.0  # > 0: refused as busy, the host's cooldown has this long left
    source: Literal["service", "fallback"] = "service"  # fallback: the driver decided alone
    contention: float = 0.0  # K: LLM seconds lost per second a checkpoint runs
    contention_cost_s: float = 0.0  # K·c


class EnvStep(Message, tag="env_step", frozen=True, kw_only=True):
    """An action of a trajectory ended: its environment time, and whether the environment failed."""

    trajectory: TrajectoryId
    host_id: HostId
    step: Step
    duration_s: Annotated[float, Meta(ge=0.0, le=86400.0)]
    failed: bool = False


class LlmResponse(Message, tag="llm_response", frozen=True, kw_only=True):
    """An LLM turn of a trajectory completed: how long the response took (a sample of T)."""

    trajectory: TrajectoryId
    seconds: Annotated[float, Meta(ge=0.0, le=86400.0)]
    tokens: Annotated[int, Meta(ge=0)] = 0


class CheckpointTimeout(Message, tag="checkpoint_timeout", frozen=True, kw_only=True):
    """A checkpoint did not answer in time: the host cools down (no checkpoints for a while)."""

    trajectory: TrajectoryId
    host_id: HostId
    k: Step
    waited_s: Annotated[float, Meta(ge=0.0)]


class ChaosKill(Message, tag="chaos_kill", frozen=True, kw_only=True):
    """The chaos injector killed a trajectory's sandbox container (through the Docker API)."""

    trajectory: TrajectoryId
    sandbox: SandboxId
    host_id: HostId
    container_id: str
    step: Step  # the action whose step the kill fell in
    delay_s: float  # after that action started


class ChaosFault(Message, tag="chaos_fault", frozen=True, kw_only=True):
    """`belayer chaos` injected a fault (cli/chaos/injector.py): its kind, what it struck, and how many
    requests or trajectories were in flight there."""

    kind: Annotated[str, Meta(max_length=32)]
    target: Annotated[str, Meta(max_length=256)]
    hits: Annotated[int, Meta(ge=0)]
    at_s: float  # seconds into the campaign


class PolicyFallback(Message, tag="policy_fallback", frozen=True, kw_only=True):
    """The policy service did not answer, so the driver decided with a named policy of its own."""

    trajectory: TrajectoryId
    policy: str
    why: str


# ---------------------------------------------------------------- event kinds
# What a listener decodes follows from the subject: `belayer.<cluster>.evt.<kind>.<id>...` carries exactly
# EVENT_TYPES[kind], declared here once for every event the project publishes. The rule for a kind:
# it is the name the publisher puts after `belayer.<cluster>.evt.` (subjects.event(kind, ...), which refuses
# a kind missing here). That name equals the Struct's tag for every kind but `worker_registered`,
# whose WorkerRegistration keeps its older tag "register" (tags and subjects are wire contract).
# Placed after the sandbox section because the table names its Structs at import time.


class TrainerStep(Message, tag="trainer_step", frozen=True, kw_only=True):
    """Event `belayer.<cluster>.evt.trainer_step.<run>`: one GRPO step done and its weights published."""

    run: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}\Z")]
    step: Annotated[int, Meta(ge=0)]
    weight_version: WeightVersion  # published after this step
    generated_with: list[WeightVersion]  # the versions that generated this step's samples
    reward_mean: float
    loss: float
    kl: float
    clipped_fraction: float
    samples: int
    response_tokens: int
    tokens_per_s: float  # response tokens generated per second of this step's rollout
    resumes: int  # resumes of this step's generations (worker crashes, handovers, router restarts)
    rollout_s: float
    update_s: float
    publish_s: float


# ---------------------------------------------------------------- trainer worker groups
# The trainer drives each worker of a group by request on
# `belayer.<cluster>.trainer.<run>.<group>.<rank>.<verb>`; workers publish `group_heartbeat`.

RunId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,40}\Z")]
# "rollout": the rollout engines, as the trainer's fault manager rebuilds them (engine restarts).
GroupName = Literal["actor", "reference", "reward", "rollout"]


class ActorUpdate(Message, tag="actor_update", frozen=True, kw_only=True):
    """One GRPO step on the whole batch; each rank takes rows rank, rank + world, ... of it. A
    rank whose state already holds `step` answers that step's result again and changes nothing,
    so a call re-run after a fault never trains a sample twice."""

    step: Annotated[int, Meta(ge=0)]  # updates applied before this one
    tokens: Annotated[list[Tokens], Meta(max_length=4096)]  # prompt + response per sample
    prompt_lens: list[Annotated[int, Meta(ge=1)]]
    # Over each sample's tokens after its prompt: 1 where the model chose the token (trained on),
    # 0 on an observation's; and the 1-based allowed set of the group's `allowed` it was drawn from
    # (0: any token).
    loss_masks: list[list[Annotated[int, Meta(ge=0, le=1)]]]
    token_sets: list[list[Annotated[int, Meta(ge=0, le=64)]]]
    advantages: list[float]
    versions: list[WeightVersion]  # the version that generated each sample: old log-probs
    publish: bool = True  # rank 0 publishes the new weights to the weight server
    # The reference policy's log-prob of each response token (the KL term); empty: no KL.
    ref_logp: list[list[float]] = []


class ActorUpdated(Message, tag="actor_updated", frozen=True, kw_only=True):
    step: int  # updates applied, this one included
    weight_version: WeightVersion  # of the weights after it
    loss: float
    kl: float
    clipped_fraction: float
    grad_norm: float
    ratio_max: float
    tokens: int


class RewardRequest(Message, tag="reward_request", frozen=True, kw_only=True):
    """The reward group scores each (prompt item, answer tokens) pair of a step."""

    step: Annotated[int, Meta(ge=0)]
    items: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=4096)]
    answers: Annotated[list[Tokens], Meta(max_length=4096)]


class Rewards(Message, tag="rewards", frozen=True, kw_only=True):
    rewards: list[float]


class RefLogprobsRequest(Message, tag="ref_logprobs_request", frozen=True, kw_only=True):
    """The reference group's log-probs of every trained token (prompt + response per sample)."""

    step: Annotated[int, Meta(ge=0)]
    tokens: Annotated[list[Tokens], Meta(max_length=4096)]
    prompt_lens: list[Annotated[int, Meta(ge=1)]]
    loss_masks: list[list[Annotated[int, Meta(ge=0, le=1)]]]  # as ActorUpdate's
    token_sets: list[list[Annotated[int, Meta(ge=0, le=64)]]]


class RefLogprobs(Message, tag="ref_logprobs", frozen=True, kw_only=True):
    logp: list[list[float]]  # per sample, one per response token


class GroupHeartbeat(Message, tag="group_heartbeat", frozen=True, kw_only=True):
    """Event `belayer.<cluster>.evt.group_heartbeat.<run>`: a group worker is alive; `progress`
    counts units of work done (forward/backward passes), `cpu_s` its process CPU time. A worker
    whose heartbeats stop, or whose progress and CPU time both stand still, is hung."""

    run: RunId
    group: GroupName
    rank: Annotated[int, Meta(ge=0)]
    pid: int
    step: int
    progress: int
    cpu_s: float


class GroupFailed(Message, tag="group_failed", frozen=True, kw_only=True):
    run: RunId
    group: GroupName
    rank: int  # -1: the group as a whole (a call timeout)
    kind: Literal["exit", "exception", "hang", "timeout", "start"]
    cause: str
    step: int
    attempt: int  # calls of this step so far, this one included
    detected_s: float  # from the call's start to the detection


class GroupRebuilt(Message, tag="group_rebuilt", frozen=True, kw_only=True):
    run: RunId
    group: GroupName
    rebuild: int  # this group's rebuilds so far, this one included
    step: int
    stop_s: float  # killing the old processes and confirming they are gone
    start_s: float  # new processes up, the process group formed, weights and state loaded
    total_s: float


class Reschedule(Message, tag="reschedule", frozen=True, kw_only=True):
    run: RunId
    attempt: int
    from_step: int  # the checkpoint's step the run goes on from
    failed_step: int
    cause: str


class ModelPublished(Message, tag="model_published", frozen=True, kw_only=True):
    """Event `belayer.<cluster>.evt.model_published.<version>`: a model folder of new weights for the
    vLLM engines (`belayer model publish`). `path` is on the engines' host; `version` names the
    folder's weights (the SHA-256 of its safetensors files, as the workers compute it)."""

    version: WeightVersion
    path: Annotated[str, Meta(min_length=2, max_length=4096, pattern=r"^/[^\x00]*\Z")]  # absolute


EVENT_TYPES: dict[str, type[Message]] = {
    "heartbeat": Heartbeat,
    "worker_registered": WorkerRegistration,
    "worker_failed": WorkerFailed,
    "request_resumed": RequestResumed,
    "request_failed": RequestFailed,
    "process": ProcessEvent,
    "router_started": RouterStarted,
    "handover": Handover,
    "engine_quarantined": EngineQuarantined,
    "engine_unstable": EngineUnstable,
    "record_skipped": RecordSkipped,
    "trajectory_ended": TrajectoryEnded,
    "weights_published": WeightsPublished,
    "model_published": ModelPublished,
    "checkpoint_ready": CheckpointReady,
    "env_failure": EnvFailure,
    "sandbox_restored": SandboxRestored,
    "policy_decision": PolicyDecision,
    "env_step": EnvStep,
    "llm_response": LlmResponse,
    "checkpoint_timeout": CheckpointTimeout,
    "policy_fallback": PolicyFallback,
    "chaos_kill": ChaosKill,
    "chaos_fault": ChaosFault,
    "trainer_step": TrainerStep,
    "group_heartbeat": GroupHeartbeat,
    "group_failed": GroupFailed,
    "group_rebuilt": GroupRebuilt,
    "reschedule": Reschedule,
}

# Events about one engine: the engine id follows the kind in the subject (`...evt.heartbeat.e0`), and
# the bus lets an engine's credential publish only its own. A payload naming another engine is forged.
ENGINE_EVENTS = frozenset(
    {"heartbeat", "worker_registered", "worker_failed", "handover", "engine_quarantined", "engine_unstable"}
)

# Every event of EVENT_TYPES, for a listener that takes any kind on one decoder (the tags are distinct).
AnyEvent = (
    Heartbeat
    | WorkerRegistration
    | WorkerFailed
    | RequestResumed
    | RequestFailed
    | ProcessEvent
    | RouterStarted
    | Handover
    | EngineQuarantined
    | EngineUnstable
    | RecordSkipped
    | WeightsPublished
    | ModelPublished
    | CheckpointReady
    | EnvFailure
    | SandboxRestored
    | TrajectoryEnded
    | PolicyDecision
    | EnvStep
    | LlmResponse
    | CheckpointTimeout
    | PolicyFallback
    | ChaosKill
    | ChaosFault
    | TrainerStep
    | GroupHeartbeat
    | GroupFailed
    | GroupRebuilt
    | Reschedule
)


# ---------------------------------------------------------------- weight and KV servers
# The weight server owns the model weights, one shared-memory segment per version; the kv-server
# owns each engine's KV arena, one segment per engine. Both reply with handles a worker maps
# without copying (shared/segments.py): a segment name and a byte layout, plus a CUDA IPC
# handle when the data lives on a GPU. `instance` changes whenever a server restarts, so a handle
# from a dead instance is recognisable (its segments were removed by the restarted server).

HolderId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_:-]{1,128}\Z")]
# A pin's holder as the weight server lists it: <engine>:<holder>, the engine that pinned it first.
PinHolder = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}:[A-Za-z0-9_:-]{1,128}\Z")]
SegmentName = Annotated[str, Meta(max_length=200, pattern=r"^[A-Za-z0-9_.-]*\Z")]
InstanceId = Annotated[str, Meta(pattern=r"^[0-9a-f]{1,32}\Z")]
TensorDType = Literal["float32", "float16", "bfloat16", "uint8", "int64"]
ByteCount = Annotated[int, Meta(ge=0, le=1 << 46)]


class TensorLayout(Message, tag="tensor_layout", frozen=True, kw_only=True):
    """One tensor inside a segment: C-contiguous `shape` of `dtype` at byte `offset` (64-aligned)."""

    name: Annotated[str, Meta(min_length=1, max_length=256)]
    shape: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=8)]
    dtype: TensorDType
    offset: ByteCount
    nbytes: ByteCount


class CudaIpcHandle(Message, tag="cuda_ipc", frozen=True, kw_only=True):
    """torch's CUDA IPC export of one uint8 buffer laid out like the segment (same offsets)."""

    device: Annotated[int, Meta(ge=0)]
    handle: bytes
    storage_size_bytes: ByteCount
    storage_offset_bytes: ByteCount
    ref_counter_handle: bytes
    ref_counter_offset: ByteCount
    event_handle: bytes = b""
    event_sync_required: bool = False


class SegmentManifest(Message, tag="segment_manifest", frozen=True, kw_only=True):
    """Written at the head of every segment and repeated in the handles: a mapper checks both agree."""

    owner: Literal["weights", "kv"]
    key: str  # the weight version, or the engine id
    instance: InstanceId
    size: ByteCount  # bytes of the whole segment
    tensors: Annotated[list[TensorLayout], Meta(max_length=4096)]


class WeightHandles(Message, tag="weight_handles", frozen=True, kw_only=True):
    version: WeightVersion
    segment: SegmentName  # a file name under /dev/shm
    manifest: SegmentManifest
    cuda: CudaIpcHandle | None = None  # set when the server holds the weights on a GPU


class ArenaHandle(Message, tag="arena_handle", frozen=True, kw_only=True):
    engine_id: EngineId
    preset: Annotated[str, Meta(min_length=1, max_length=64)]
    num_blocks: Annotated[int, Meta(ge=1)]
    block_size: Annotated[int, Meta(ge=1)]
    segment: SegmentName
    manifest: SegmentManifest  # one tensor, "arena", shaped as presets.arena_shape
    cuda: CudaIpcHandle | None = None


class WeightsList(Message, tag="weights_list", frozen=True, kw_only=True):
    pass


class WeightsHandlesRequest(Message, tag="weights_handles", frozen=True, kw_only=True):
    version: WeightVersion | None = None  # None: the newest


class WeightsPin(Message, tag="weights_pin", frozen=True, kw_only=True):
    """Pin a version for `holder`, a process `pid` on this host; the reply is its handles, so a
    holder that pins first and then maps can never map a freed version."""

    version: WeightVersion | None = None  # None: the newest
    holder: HolderId
    pid: Annotated[int, Meta(ge=1, le=(1 << 31) - 1)]


class WeightsUnpin(Message, tag="weights_unpin", frozen=True, kw_only=True):
    version: WeightVersion
    holder: HolderId


class WeightsPublish(Message, tag="weights_publish", frozen=True, kw_only=True):
    """Load a weights file (written by params.save_params) as a new version and make it the newest:
    a path on the weight server's host, or an object in the cluster's weights bucket (a trainer on
    another host puts it there first). Exactly one of the two."""

    path: Annotated[str, Meta(max_length=4096)] = ""
    object_name: Annotated[str, Meta(max_length=256, pattern=r"^[A-Za-z0-9_.-]*\Z")] = ""

    def __post_init__(self) -> None:
        if bool(self.path) == bool(self.object_name):
            raise ValueError("give exactly one of `path` and `object_name`")


class ServerPing(Message, tag="server_ping", frozen=True, kw_only=True):
    pass


class WeightVersionInfo(Message, tag="weight_version_info", frozen=True, kw_only=True):
    version: WeightVersion
    segment: SegmentName
    size: ByteCount
    holders: list[PinHolder]


class WeightVersions(Message, tag="weight_versions", frozen=True, kw_only=True):
    newest: WeightVersion
    versions: list[WeightVersionInfo]


class WeightServerAlive(Message, tag="weight_server_alive", frozen=True, kw_only=True):
    pid: int
    instance: InstanceId
    newest: WeightVersion
    versions: list[WeightVersion]
    device: Literal["cpu", "cuda"] = "cpu"
    segments: dict[WeightVersion, SegmentName] = {}  # each held version's current segment


class KvArenaRequest(Message, tag="kv_arena", frozen=True, kw_only=True):
    """The engine's arena: created zeroed on the first call, the same segment after; a different
    shape for an existing engine is refused ("shape-mismatch")."""

    engine_id: EngineId
    preset: Annotated[str, Meta(min_length=1, max_length=64)]
    num_blocks: Annotated[int, Meta(ge=1, le=1 << 24)]
    block_size: Annotated[int, Meta(ge=1, le=1 << 12)]
    # The process that will map it, tracked as a holder until its death is confirmed; and the main
    # a shadow stands behind (0: the asker is a main). See services/kv_server/server.py.
    pid: Annotated[int, Meta(ge=1)]
    watch_pid: Annotated[int, Meta(ge=0)] = 0


class EngineRestart(Message, tag="engine_restart", frozen=True, kw_only=True):
    """Replace the engine's workers by the cold path: main and shadow killed and their deaths
    confirmed, a worker started from scratch (its own weights and arena), a new shadow behind it.
    Sent on `belayer.<cluster>.engines.<engine>.restart` to the supervisor that runs the engine."""

    reason: Annotated[str, Meta(max_length=200)]  # why, for the handover event and the logs


class EngineUnquarantine(Message, tag="engine_unquarantine", frozen=True, kw_only=True):
    """The operator's way back: clear the engine's quarantine and start its workers again. Sent on
    `belayer.<cluster>.engines.<engine>.unquarantine`; answered with EngineRestarted (old_pid 0)."""


class EngineRestarted(Message, tag="engine_restarted", frozen=True, kw_only=True):
    engine_id: EngineId
    old_pid: int
    new_pid: int
    epoch: Epoch  # the new worker's
    took_s: float  # from the request's arrival to the new worker serving


class KvFlush(Message, tag="kv_flush", frozen=True, kw_only=True):
    """Zero the engine's arena (a real write of every byte) after the main of `epoch` died: refused
    unless `epoch` is the engine's current one in the registry and its worker is not a live
    holder, so a flush that arrives late or is forged cannot zero a serving main's arena."""

    engine_id: EngineId
    epoch: Epoch


class KvRelease(Message, tag="kv_release", frozen=True, kw_only=True):
    """Free the engine's arena (its segment is unlinked; existing mappings stay valid)."""

    engine_id: EngineId


class KvServerAlive(Message, tag="kv_server_alive", frozen=True, kw_only=True):
    pid: int
    instance: InstanceId
    engines: list[EngineId]
    device: Literal["cpu", "cuda"] = "cpu"
    segments: dict[EngineId, SegmentName] = {}  # each engine's current arena segment


# ---------------------------------------------------------------- shadow pipe
# The shadow supervisor and each worker it starts talk over the worker's stdin and stdout, one
# encoded message per line: the worker reports (WorkerReport) on stdout, the supervisor commands
# (ShadowCommand) on stdin. Each side decodes a line with decode(decoder_for(...)); a line that does
# not decode is logged and dropped, so a stray print on either side cannot take an engine down.


class WorkerIdle(Message, tag="worker_idle", frozen=True, kw_only=True):
    """A shadow has built everything it needs to serve and stands by. The instances are those of
    the weight and KV servers that own what it mapped (None: nothing mapped from that server): a
    restarted server owns none of it, and the supervisor must see that before a handover."""

    weights_instance: InstanceId | None = None
    kv_instance: InstanceId | None = None


class MainFailed(Message, tag="main_failed", frozen=True, kw_only=True):
    """A shadow saw its main fail: it exited (its pidfd), or it hangs (its heartbeat file is stale)."""

    reason: Literal["exit", "hang"]
    heartbeat_age_s: Annotated[float, Meta(ge=0.0)] = 0.0  # a hang's staleness; 0 for an exit


class WorkerReady(Message, tag="worker_ready", frozen=True, kw_only=True):
    """The worker serves: it installed itself in the engine registry under `epoch`."""

    epoch: Epoch


class WorkerUnhealthy(Message, tag="worker_unhealthy", frozen=True, kw_only=True):
    """The worker will not serve (a promoted shadow failed its device check) and exits."""

    why: str


WorkerReport = WorkerIdle | MainFailed | WorkerReady | WorkerUnhealthy


class PromoteShadow(Message, tag="promote_shadow", frozen=True, kw_only=True):
    """Take over: the main is confirmed dead, both servers answer and the arena is flushed."""


ShadowCommand = PromoteShadow  # a union of one so far; a new command joins it here


class EngineWorkers(Message, tag="engine_workers", frozen=True, kw_only=True):
    """One engine in the shadow supervisor's state file: its worker pids (0: none now)."""

    main: Annotated[int, Meta(ge=0)] = 0
    shadow: Annotated[int, Meta(ge=0)] = 0
    quarantined: bool = False


# `<state>/workers/engines.json`, written by the shadow supervisor, read by `belayer status` and
# tests. A mapping keyed by engine id rather than one Struct, so that readers indexing
# `[engine]["main"]` (benchmarks, scripts) keep working.
ShadowState = dict[EngineId, EngineWorkers]


# ---------------------------------------------------------------- fork-server pipe
# The trainer's local backend and its fork server (services/trainer_group/fork_server.py) talk over
# the server's stdin and stdout, one encoded message per line, as on the shadow pipe. The server
# answers each ForkRank, in order, with RankForked or ForkRefused; RankExited comes whenever it
# reaps a rank, always after that rank's RankForked.


class ForkServerReady(Message, tag="fork_server_ready", frozen=True, kw_only=True):
    """The server has imported torch and the rank code, and takes ForkRank commands."""

    pid: int


class ForkRank(Message, tag="fork_rank", frozen=True, kw_only=True):
    """Fork a rank that runs `python -m belayer_rl.services.trainer_group` with `argv`, its
    stdout and stderr appended to `log_path`."""

    argv: list[str]
    log_path: str


class RankForked(Message, tag="rank_forked", frozen=True, kw_only=True):
    pid: Annotated[int, Meta(gt=0)]


class ForkRefused(Message, tag="fork_refused", frozen=True, kw_only=True):
    why: str


class RankExited(Message, tag="rank_exited", frozen=True, kw_only=True):
    """A forked rank was reaped; `returncode` as subprocess gives it (-N: killed by signal N)."""

    pid: Annotated[int, Meta(gt=0)]
    returncode: int


ForkServerReport = ForkServerReady | RankForked | ForkRefused | RankExited
