"""Prometheus metrics: every metric the project exports, defined here once, and the HTTP endpoint
that serves them.

Each process has one `Metrics`, owned by its runtime (shared/runtime.py) and built from
`--metrics-port`. It holds a `CollectorRegistry` of its own, never prometheus_client's global
REGISTRY, so nothing here is module-global and two runtimes in one process (tests) do not collide.
A service builds the group of metrics it updates (RouterMetrics, ...) on it in its setup and hands
the group to its state. With `--metrics-port -1` every metric of a group is NULL, which accepts
every update and does nothing, so metrics that are off cost a method call and nothing else.

Names follow Prometheus conventions: the `belayer_` prefix, base units (seconds, bytes), `_total`
on counters. A label takes a handful of known values (a resume cause, a handover phase, an engine
id), never a request id or a pid. The errors by code and the messages handled are not counted
here: the runtime counts them once, for its stats reply too, and `export_service` reads its
counts at each scrape.

The HTTP endpoint (`MetricsServer`) is an asyncio server on the service's own loop, not
prometheus_client's threaded one: it reads the runtime's state (readiness, error counts) on the
thread that writes it, so nothing needs a lock; it has no thread waking up to poll while idle
(which the router's CPU cost benchmark would count); and it is closed with the rest of the
runtime. A scrape renders about a hundred series, well under a millisecond of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("belayer.metrics")

REQUEST_TIMEOUT_S = 5.0  # a scraper that sends no complete request head in this time is dropped
MAX_REQUEST_HEAD = 8 << 10  # bytes of request line and headers; longer is refused

# Bucket bounds, in seconds, for the latencies measured below.
FAST_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECOVERY_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SANDBOX_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ---------------------------------------------------------------- one registry per process


class NullMetric:
    """Every metric when metrics are off: takes the calls a Counter or Histogram takes."""

    def labels(self, *values: str) -> NullMetric:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


NULL = NullMetric()  # stateless, so one instance serves every metric of every process


class ServiceCounts(NamedTuple):
    """What the runtime counts for every service, read at each scrape."""

    errors: Mapping[str, int]  # error replies and dropped messages, by ErrorCode
    handled: int  # messages taken off its endpoints
    ready: bool
    records_skipped: Mapping[str, int]  # stored records that did not decode, by store


class ServiceCollector(Collector):
    """belayer_errors_total{code}, belayer_messages_handled_total, belayer_records_skipped_total{store}
    and belayer_service_ready,
    rendered from the runtime's own counts (one way of counting, read here)."""

    def __init__(self, read: Callable[[], ServiceCounts]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        counts = self.read()
        errors = CounterMetricFamily(
            "belayer_errors", "Error replies and dropped messages, by error code.", labels=["code"]
        )
        for code, count in sorted(counts.errors.items()):
            errors.add_metric([code], count)
        yield errors
        yield CounterMetricFamily(
            "belayer_messages_handled", "Messages taken off the service's endpoints.", value=counts.handled
        )
        skipped = CounterMetricFamily(
            "belayer_records_skipped",
            "Stored records that did not decode and were skipped, by store.",
            labels=["store"],
        )
        for store, count in sorted(counts.records_skipped.items()):
            skipped.add_metric([store], count)
        yield skipped
        yield GaugeMetricFamily(
            "belayer_service_ready",
            "1 once the service serves, 0 before and while draining.",
            float(counts.ready),
        )


class Metrics:
    """One process's registry, or none when metrics are off; makes the metrics of the groups."""

    def __init__(self, *, enabled: bool) -> None:
        self.registry = CollectorRegistry() if enabled else None
        if self.registry is not None:
            ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, open fds

    def export_service(self, read: Callable[[], ServiceCounts]) -> None:
        if self.registry is not None:
            self.registry.register(ServiceCollector(read))

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        if self.registry is None:
            return cast(Counter, NULL)  # takes every call the group makes on a Counter
        return Counter(name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        if self.registry is None:
            return cast(Histogram, NULL)
        return Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        if self.registry is None:
            return cast(Gauge, NULL)
        return Gauge(name, doc, labels, registry=self.registry)


# ---------------------------------------------------------------- the project's metrics, by service

# Why the router resumed a request: each a value of belayer_router_resumes_total's `cause`.
ResumeCause = Literal[
    "worker-exit",  # its engine's worker exited (or the registry moved to a new epoch)
    "heartbeat-timeout",  # its engine's worker went silent
    "quarantine",  # its engine was quarantined: moved to a healthy one
    "lost-tokens",  # the worker ended at another count than the tokens the router holds
    "gap",  # a chunk started past the tokens the router holds
    "orphaned",  # placed on an engine that does not hold it (a bug, recovered)
    "reconnect",  # the bus reconnected: messages in flight may be lost
    "router-restart",  # rebuilt from the token log by a new router
    "stalled",  # no token for --progress-deadline: the attempt's end may have been lost
    "distrusted",  # its engine answered what no honest worker would (a `fenced` the lease denies)
]


class RouterMetrics:
    def __init__(self, m: Metrics) -> None:
        self.requests = m.counter("belayer_router_requests_total", "Generate requests accepted.")
        self.ends = m.counter(
            "belayer_router_request_ends_total", "Requests ended, by finish reason.", ["finish_reason"]
        )
        self.tokens_accepted = m.counter(
            "belayer_router_tokens_accepted_total",
            "Tokens of worker chunks taken from a request's current attempt (overlap included).",
        )
        self.tokens_generated = m.counter(
            "belayer_router_tokens_generated_total",
            "New positions of requests' sequences, each relayed once to the clients following it.",
        )
        self.tokens_regenerated = m.counter(
            "belayer_router_tokens_regenerated_total",
            "Accepted tokens at positions produced before: held already, or (after a router"
            " restart) reported received by a re-attaching client.",
        )
        self.fenced = m.counter(
            "belayer_router_fenced_messages_total",
            "Worker chunks and ends dropped: a stale attempt, epoch or engine.",
        )
        self.resumes = m.counter("belayer_router_resumes_total", "Requests resumed, by cause.", ["cause"])
        self.distrusted = m.counter(
            "belayer_router_distrusted_engines_total",
            "Engine epochs the router stopped using: they answered what no honest worker would.",
        )
        self.adopt_refused = m.counter(
            "belayer_router_adopt_refused_total",
            "Attempts a worker offered at a router takeover that were not carried on, by why:"
            " another engine's name, no LogDispatch names it, or not a continuation of the log.",
            ["reason"],
        )
        self.log_client_bytes = m.gauge(
            "belayer_router_log_client_bytes",
            "Bytes of the token log each client's requests hold, as of its latest request's end.",
            ["client"],
        )
        self.log_share_refused = m.counter(
            "belayer_router_log_share_refused_total",
            "New requests refused because their client held its share of the token log.",
            ["client"],
        )
        self.log_purged = m.counter(
            "belayer_router_log_purged_total", "Ended requests whose records left the token log."
        )
        self.next_token = m.histogram(
            "belayer_router_resume_next_token_seconds",
            "From a failure being noticed to the first token of the resumed attempt, by first cause.",
            RECOVERY_S,
            ["cause"],
        )


# Why a handover took the cold path: each a value of belayer_handover_cold_paths_total's `reason`.
ColdReason = Literal[
    "kill-unconfirmed",  # the old main's death was not confirmed
    "weight-server-down",
    "kv-server-down",
    "weight-server-restarted",  # a new instance does not own what the shadow mapped
    "kv-server-restarted",
    "flush-failed",  # the arena flush failed
    "no-shadow",
    "promotion-failed",  # the shadow failed its device check, exited or timed out
    "restart-requested",  # EngineRestart: the cold path on purpose
    "unstable",  # the last healthy engine failing again and again: from scratch, after a backoff
]


class SupervisorMetrics:
    def __init__(self, m: Metrics) -> None:
        self.handovers = m.counter(
            "belayer_handovers_total",
            "Worker replacements, by engine, failure (exit, hang) and path (shadow, cold).",
            ["engine", "failure", "path"],
        )
        self.phase = m.histogram(
            "belayer_handover_phase_seconds",
            "Duration of each phase of a handover (kill_confirmed, servers_checked, arena_flushed,"
            " promoted, cold_started).",
            FAST_S,
            ["phase"],
        )
        self.duration = m.histogram(
            "belayer_handover_duration_seconds",
            "From a failure being noticed to its replacement serving, by path.",
            RECOVERY_S,
            ["path"],
        )
        self.cold_paths = m.counter(
            "belayer_handover_cold_paths_total",
            "Handovers sent down the cold path, by each reason that did so.",
            ["reason"],
        )
        self.quarantines = m.counter(
            "belayer_engine_quarantines_total", "Engines quarantined after repeated failures.", ["engine"]
        )


class CheckpointerMetrics:
    def __init__(self, m: Metrics) -> None:
        self.checkpoints = m.counter("belayer_checkpoints_total", "Full checkpoints completed.")
        self.checkpoint_bytes = m.counter(
            "belayer_checkpoint_written_bytes_total", "Bytes written by completed checkpoints."
        )
        self.freeze = m.histogram(
            "belayer_checkpoint_freeze_seconds", "Time a sandbox stayed frozen for a checkpoint.", SANDBOX_S
        )
        self.checkpoint_duration = m.histogram(
            "belayer_checkpoint_duration_seconds", "Whole time of a completed checkpoint.", SANDBOX_S
        )
        self.restores = m.counter(
            "belayer_restores_total",
            "Restores, by source (latest, previous, base) and store (local, object-store: fetched first).",
            ["source", "store"],
        )
        self.restore_duration = m.histogram(
            "belayer_restore_duration_seconds", "Whole time of a restore.", SANDBOX_S
        )
        self.env_failures = m.counter(
            "belayer_environment_failures_total",
            "Sandbox environment failures, by reason (dead, oom-killed, daemon-error, ...).",
            ["reason"],
        )


class WorkerMetrics:
    def __init__(self, m: Metrics, engine_id: str) -> None:
        tokens = m.counter("belayer_worker_tokens_total", "Tokens published by the worker.", ["engine"])
        self.tokens = tokens.labels(engine_id)  # bound once: the scheduling loop is hot
        self.step = m.histogram("belayer_worker_step_seconds", "Time of one engine step.", STEP_S)
        self.fenced = m.counter(
            "belayer_worker_fenced_total",
            "Dispatches and cancels refused: from a router that lost its lease.",
            ["engine"],
        ).labels(engine_id)


# ---------------------------------------------------------------- /metrics and /healthz

Health = Callable[[], tuple[bool, str]]  # (healthy, what to say): the runtime's readiness


class MetricsServer:
    """`GET /metrics` (Prometheus text, or OpenMetrics if the scraper asks) and `GET /healthz`
    (200 "ok", or 503 with why not), one request per connection, on the running loop."""

    def __init__(self, registry: CollectorRegistry, health: Health) -> None:
        self.registry = registry
        self.health = health
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: a free port); returns the port. OSError if it is taken."""
        loop = asyncio.get_running_loop()
        # One address only: with port 0, each address of a name would get its own port.
        family, _, _, _, address = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        self.server = await asyncio.start_server(
            self.handle, str(address[0]), port, family=family, limit=MAX_REQUEST_HEAD
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for task in list(self.connections):  # a scraper that hangs must not hold up the exit
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                status, content_type, body = self.answer(await reader.readuntil(b"\r\n\r\n"))
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away, stalled or sent too much: nothing to answer
        finally:
            self.connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def answer(self, head: bytes) -> tuple[str, str, bytes]:
        """(status, content type, body) for one request head."""
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, _, rest = request_line.partition(" ")
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        path = urlsplit(rest.partition(" ")[0]).path
        if path == "/healthz":
            healthy, why = self.health()
            return ("200 OK" if healthy else "503 Service Unavailable"), "text/plain", f"{why}\n".encode()
        if path != "/metrics":
            return "404 Not Found", "text/plain", b"/metrics or /healthz\n"
        accept = next(
            (
                value
                for name, _, value in (line.partition(":") for line in header_lines)
                if name.lower() == "accept"
            ),
            "",
        )
        encoder, content_type = choose_encoder(accept.strip())
        return "200 OK", content_type, encoder(self.registry)


def url(host: str, port: int, path: str = "/metrics") -> str:
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


class PolicyMetrics:
    def __init__(self, m: Metrics) -> None:
        self.decisions = m.counter(
            "belayer_policy_decisions_total",
            "Checkpoint decisions, by policy and verdict (checkpoint, skip, busy: the host cools down).",
            ["policy", "verdict"],
        )
        self.observations = m.counter(
            "belayer_policy_observations_total",
            "What the policy learnt from: env steps, env failures, LLM responses, checkpoints, timeouts.",
            ["kind"],
        )
        self.contention = m.gauge(
            "belayer_policy_contention_ratio",
            "K: seconds of LLM work lost per second a checkpoint runs, as the last decision used it.",
        )
        self.visible_cost = m.histogram(
            "belayer_policy_expected_visible_cost_seconds",
            "The expected visible checkpoint cost of the adaptive decisions.",
            SANDBOX_S,
        )


class GatewayMetrics:
    """The HTTP gateway's: its requests, its errors by code and the tokens it streamed."""

    def __init__(self, m: Metrics) -> None:
        self.requests = m.counter(
            "belayer_gateway_requests_total",
            "HTTP requests, by endpoint and status code.",
            ["endpoint", "status"],
        )
        self.errors = m.counter(
            "belayer_gateway_errors_total",
            "Requests answered with an error, by its code (invalid_json, model_not_found, ...).",
            ["code"],
        )
        self.tokens = m.counter("belayer_gateway_tokens_total", "Generated tokens sent to HTTP clients.")
        self.resumed_streams = m.counter(
            "belayer_gateway_resumed_streams_total",
            "Streams a client took up again (Last-Event-ID, or a request id and position).",
        )
        self.running = m.gauge("belayer_gateway_running_requests", "Requests the gateway follows now.")
        self.first_token = m.histogram(
            "belayer_gateway_time_to_first_token_seconds",
            "From a generation's arrival to its first token sent.",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )


class TrainerMetrics:
    """The trainer's (`belayer train --metrics-port`): its steps and the fault manager's work."""

    def __init__(self, m: Metrics) -> None:
        self.steps = m.counter("belayer_trainer_steps_total", "Training steps done (a replayed step again).")
        self.samples = m.counter("belayer_trainer_samples_total", "Samples trained on.")
        self.reward = m.gauge("belayer_trainer_reward_mean", "The mean reward of the last step's samples.")
        self.phase_seconds = m.histogram(
            "belayer_trainer_phase_seconds",
            "Seconds of each step's phases: rollout (with the reward), update, publish (with worker"
            " groups the publication is part of the update, and publish is 0).",
            SANDBOX_S,
            ["phase"],
        )
        self.group_failures = m.counter(
            "belayer_trainer_group_failures_total",
            "Worker group failures seen by the fault manager, by group and kind (exit, hang, ...).",
            ["group", "kind"],
        )
        self.group_rebuilds = m.counter(
            "belayer_trainer_group_rebuilds_total", "Targeted rebuilds, by the group counted.", ["group"]
        )
        self.rebuild_seconds = m.histogram(
            "belayer_trainer_group_rebuild_seconds", "Seconds a targeted rebuild took.", RECOVERY_S, ["group"]
        )
        self.reschedules = m.counter(
            "belayer_trainer_reschedules_total", "Whole-workflow restarts from the last trainer checkpoint."
        )
