"""The shadow pipe: typed reports on a worker's stdout, typed commands on its stdin, engines.json.

No cluster here. The supervisor's side runs against a stand-in for the worker, a tiny python
script that writes lines (cheap: no torch, no NATS); the worker's side runs the real `stand_by`
in a child process that the test drives as the supervisor would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from belayer_rl.cli.status import read_shadows
from belayer_rl.services.shadow_supervisor.supervisor import (
    ShadowSupervisor,
    StartFailed,
    WorkerProcess,
    parse_report,
)
from belayer_rl.shared.config import ShadowSupervisorConfig
from belayer_rl.shared.protocol import (
    MainFailed,
    PromoteShadow,
    WorkerIdle,
    WorkerReady,
    WorkerReport,
    WorkerUnhealthy,
    encode,
)

TIMEOUT_S = 60.0  # generous: the test machine may be loaded

# Lines a worker could print by mistake: none of them is a report.
NOT_REPORTS = [
    b"\n",
    b"hello from a stray print\n",
    b"\xff\xfe\x00 not utf-8\n",
    b"idle weights=ab kv=cd\n",  # the old text protocol
    b"ready 7\n",
    b'{"type": "no_such_report"}\n',
    b'{"type": "worker_ready", "epoch": -1}\n',  # out of range
    b'{"type": "main_failed", "reason": "sneezed"}\n',  # not a reason
    b'{"type": "worker_ready", "epoch": 3, "v": 99}\n',  # a newer schema
    b"[1, 2, 3]\n",
]

# The stand-in for a worker: garbage all around each real report, an over-long line included.
STAND_IN = r"""
import sys
from belayer_rl.shared import protocol

out = sys.stdout.buffer
def garbage():
    for line in GARBAGE:
        out.write(line)
    out.write(b"x" * 200_000 + b"\n")  # over asyncio's 64 KiB line limit
    out.flush()
def send(message):
    out.write(protocol.encode(message) + b"\n")
    out.flush()

garbage()
send(protocol.WorkerIdle(weights_instance="ab", kv_instance="cd"))
commands = protocol.decoder_for(protocol.ShadowCommand)
for line in sys.stdin.buffer:
    try:
        command = protocol.decode(commands, line)
    except protocol.BadMessage:
        continue
    garbage()
    send(protocol.WorkerUnhealthy(why="told to fail") if FAIL else protocol.WorkerReady(epoch=7))
    break
garbage()
"""


@contextlib.asynccontextmanager
async def child(argv: list[str], tmp_path: Path) -> AsyncIterator[WorkerProcess]:
    """A child process read as the supervisor reads a worker; killed and closed at the end."""
    with (tmp_path / "child.stderr").open("ab") as err:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err
        )
    worker = WorkerProcess("shadow", process, tmp_path / "heartbeat")
    worker.reader = asyncio.create_task(worker.read_reports())
    try:
        yield worker
    finally:
        if process.returncode is None:
            process.kill()
        assert process.stdin is not None
        process.stdin.close()  # else its transport outlives the test's event loop
        await process.wait()
        await worker.reader


def stand_in(fail: bool = False) -> list[str]:
    return [sys.executable, "-c", f"GARBAGE = {NOT_REPORTS!r}\nFAIL = {fail!r}\n{STAND_IN}"]


@pytest.mark.parametrize(
    "report",
    [
        WorkerIdle(weights_instance="0a1b", kv_instance="ff"),
        WorkerIdle(),
        MainFailed(reason="exit"),
        MainFailed(reason="hang", heartbeat_age_s=3.25),
        WorkerReady(epoch=12),
        WorkerUnhealthy(why="device computed 0.0, expected 2080"),
    ],
)
def test_every_report_survives_the_pipe(report: WorkerReport) -> None:
    assert parse_report(encode(report) + b"\n", "test") == report


@pytest.mark.parametrize("line", NOT_REPORTS)
def test_a_line_that_is_not_a_report_is_logged_and_dropped(
    line: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="belayer.shadow_supervisor"):
        assert parse_report(line, "shadow pid 1") is None
    assert "shadow pid 1: ignored a stdout line that is not a report (" in caplog.text


async def test_a_worker_printing_garbage_does_not_break_the_supervisor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with child(stand_in(), tmp_path) as worker, asyncio.timeout(TIMEOUT_S):
        idle = await worker.expect(WorkerIdle, timeout_s=TIMEOUT_S)
        assert (idle.weights_instance, idle.kv_instance) == ("ab", "cd")
        await worker.tell(PromoteShadow())
        assert await worker.expect(WorkerReady, timeout_s=TIMEOUT_S) == WorkerReady(epoch=7)
        assert await worker.process.wait() == 0
        assert worker.reader is not None
        await worker.reader  # it read to the end: no line took it down
        assert worker.reports.get_nowait() is None  # the garbage after the last report was dropped
    assert "ignored an oversized stdout line" in caplog.text
    # Each garbage line, and the tail of each over-long one, which asyncio hands over as a line.
    assert caplog.text.count("not a report") >= 3 * len(NOT_REPORTS)


async def test_an_unhealthy_report_fails_the_start_with_its_reason(tmp_path: Path) -> None:
    async with child(stand_in(fail=True), tmp_path) as worker, asyncio.timeout(TIMEOUT_S):
        await worker.expect(WorkerIdle, timeout_s=TIMEOUT_S)
        await worker.tell(PromoteShadow())
        with pytest.raises(StartFailed, match="unhealthy told to fail"):
            await worker.expect(WorkerReady, timeout_s=TIMEOUT_S)
        with pytest.raises(StartFailed, match="exited"):  # its stdout closed after the garbage
            await worker.expect(WorkerReady, timeout_s=TIMEOUT_S)


# The real shadow's side: stand by behind a watched process, then report whether it was promoted.
STAND_BY = r"""
import asyncio, sys
from pathlib import Path
from belayer_rl.services.worker import shadow
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.protocol import WorkerIdle

config = WorkerConfig(
    nats_url="nats://unused", engine_id="e0", role="shadow",
    watch_pid=int(sys.argv[1]), watch_file=Path(sys.argv[2]), hang_timeout_s=600.0,
)
if asyncio.run(shadow.stand_by(config, asyncio.Event(), WorkerIdle(weights_instance="ab", kv_instance="cd"))):
    shadow.report_ready(1)
else:
    shadow.report_unhealthy("not promoted")
"""


async def test_the_shadow_ignores_garbage_commands_and_reports_the_mains_exit(tmp_path: Path) -> None:
    main = await asyncio.create_subprocess_exec("sleep", "600")
    heartbeat = tmp_path / "main.heartbeat"
    heartbeat.touch()
    argv = [sys.executable, "-c", STAND_BY, str(main.pid), str(heartbeat)]
    try:
        async with child(argv, tmp_path) as shadow, asyncio.timeout(TIMEOUT_S):
            idle = await shadow.expect(WorkerIdle, timeout_s=TIMEOUT_S)
            assert idle == WorkerIdle(weights_instance="ab", kv_instance="cd")
            stdin = shadow.process.stdin
            assert stdin is not None
            for line in (b"promote\n", b"\xff\xfe\n", b'{"type": "no_such_command"}\n', b"\n"):
                stdin.write(line)  # none of them is a command: it keeps standing by
            stdin.write(b"y" * 200_000 + b"\n")
            await stdin.drain()
            main.kill()
            assert await shadow.reports.get() == MainFailed(reason="exit")
            await shadow.tell(PromoteShadow())
            assert await shadow.expect(WorkerReady, timeout_s=TIMEOUT_S) == WorkerReady(epoch=1)
            assert await shadow.process.wait() == 0
    finally:
        if main.returncode is None:
            main.kill()
        await main.wait()
    log = (tmp_path / "child.stderr").read_text()
    assert log.count("ignored a line on stdin that is not a command") >= 4, log
    assert "ignored an oversized line on stdin" in log, log


def test_engines_json_is_written_and_read_as_a_struct(tmp_path: Path) -> None:
    config = ShadowSupervisorConfig(
        nats_url="nats://unused", engines=("e0", "e1"), state_dir=tmp_path / "workers"
    )
    supervisor = ShadowSupervisor(config, nc=None, kv=None, skipped=None)  # type: ignore[arg-type]  # writes no bus

    def worker(pid: int) -> WorkerProcess:
        return WorkerProcess("main", SimpleNamespace(pid=pid), tmp_path / "hb")  # type: ignore[arg-type]

    supervisor.slots["e0"].main, supervisor.slots["e0"].shadow = worker(101), worker(102)
    supervisor.slots["e1"].main, supervisor.slots["e1"].quarantined = worker(201), True
    supervisor.write_state()

    assert read_shadows(tmp_path) == {"e0": 102, "e1": 0}
    # Readers that index the file by hand (benchmarks, scripts, test_handover) still find the pids.
    raw = json.loads((tmp_path / "workers" / "engines.json").read_text())
    assert (raw["e0"]["main"], raw["e0"]["shadow"], raw["e0"]["quarantined"]) == (101, 102, False)
    assert (raw["e1"]["main"], raw["e1"]["shadow"], raw["e1"]["quarantined"]) == (201, 0, True)
