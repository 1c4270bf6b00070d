"""`belayer status`, global flags after the subcommand, --version, and which commands stay clear of
torch: the real command as a subprocess, with no cluster (at most a nats-server and a fake router)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from belayer_rl.cli.cluster import ClusterFile, ProcessRecord
from belayer_rl.cli.main import build_parser
from belayer_rl.cli.status import CLEAR_SCREEN
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.subjects import Subjects
from tests.cli.helpers import BELAYER, belayer, clean_env, events_process
from tests.support import NatsServer

NAMES = Subjects()  # the default cluster's names

PROCESS_HEADER = ["PROCESS", "PID", "STATE"]
ENGINE_HEADER = ["ENGINE", "WORKER PID", "EPOCH", "ALIVE", "SHADOW PID", "WEIGHTS"]


def columns(header_line: str, names: list[str]) -> list[int]:
    return [header_line.index(name) for name in names]


def test_status_on_an_empty_state_dir_prints_the_tables_and_says_why_the_router_is_unknown(
    tmp_path: Path,
) -> None:
    done = belayer("status", "--state-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no traceback, no reconnect noise, no torch warning
    lines = done.stdout.splitlines()
    assert lines[0].split() == PROCESS_HEADER
    assert lines[1] == "(none: no local cluster is running in this state dir)"
    engine_header = next(line for line in lines if line.startswith("ENGINE"))
    assert [cell for cell in engine_header.split("  ") if cell] == ENGINE_HEADER
    assert "requests in flight: -" in lines
    error = next(line for line in lines if line.startswith("router error: "))
    assert "no NATS server" in error and str(tmp_path / "nats.url") in error


@pytest.mark.parametrize("before", [False, True], ids=["flag-after", "flag-before"])
def test_status_json_takes_the_global_flag_on_either_side_of_the_subcommand(
    tmp_path: Path, before: bool
) -> None:
    flags = ["--state-dir", str(tmp_path)]
    done = belayer(*flags, "status", "--json") if before else belayer("status", *flags, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["processes"] == [] and report["engines"] == [] and report["requests_in_flight"] == 0
    assert str(tmp_path / "nats.url") in report["router_error"]


async def test_status_table_with_a_cluster_file_and_a_router_lines_up_its_columns(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    cluster = ClusterFile(
        supervisor_pid=os.getpid(),  # alive for as long as the test runs
        nats_url=nats_server.url,
        processes=[ProcessRecord(name="router", pid=4242, state="running", restarts=1)],
    )
    (tmp_path / "cluster.json").write_bytes(msgspec.json.encode(cluster))
    status = protocol.RouterStatus(
        engines=[
            protocol.EngineStatus(engine_id="e0", epoch=3, pid=111, alive=True, outstanding_tokens=0),
            protocol.EngineStatus(
                engine_id="engine-long-name",
                epoch=12,
                pid=22222,
                alive=False,
                outstanding_tokens=5,
                weight_version="v7",
            ),
        ],
        requests=[
            protocol.RequestStatus(
                request_id="r1", engine_id="e0", attempt=1, num_tokens=3, max_tokens=9, resumes=0
            )
        ],
    )
    nc = await bus.connect(nats_server.url, "fake-router")

    async def answer(msg: Msg) -> None:
        await msg.respond(protocol.encode(status))

    await nc.subscribe(NAMES.router_status, cb=answer)
    await nc.flush()
    try:
        done = await asyncio.to_thread(
            belayer, "status", "--state-dir", str(tmp_path), "--nats", nats_server.url
        )
    finally:
        await nc.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    starts = columns(lines[0], PROCESS_HEADER)
    for line, row in zip(
        lines[1:3], [["supervisor", str(os.getpid()), "running"], ["router", "4242", "running"]], strict=True
    ):
        assert [line.index(cell) for cell in row] == starts, line
    at = lines.index(next(line for line in lines if line.startswith("ENGINE")))
    starts = columns(lines[at], ENGINE_HEADER)
    expected = [["e0", "111", "3", "yes", "-", "-"], ["engine-long-name", "22222", "12", "NO", "-", "v7"]]
    for line, row in zip(lines[at + 1 : at + 3], expected, strict=True):
        cells = [cell for cell in line.split("  ") if cell.strip()]
        assert [cell.strip() for cell in cells] == row, line
        assert [line.index(cell, start) for cell, start in zip(row, starts, strict=True)] == starts, line
    assert "requests in flight: 1" in lines
    assert not any(line.startswith("router error") for line in lines)


async def test_status_reports_a_bus_without_a_router_readably(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    done = await asyncio.to_thread(
        belayer, "status", "--json", "--state-dir", str(tmp_path), "--nats", nats_server.url
    )
    assert done.returncode == 0, done.stderr
    assert "no-responders" in json.loads(done.stdout)["router_error"]


@pytest.mark.timeout(60)  # a frame that never comes would block readline
def test_status_watch_json_prints_one_line_per_refresh_until_interrupted(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [*BELAYER, "status", "--watch", "0.1", "--json", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert all(lines), f"belayer status --watch ended early after {lines!r}"
        frames = [json.loads(line) for line in lines]
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=30) == 0, process.stderr.read() if process.stderr else ""
    finally:
        process.kill()
        process.wait()
    assert all(frame["processes"] == [] and "router_error" in frame for frame in frames)


@pytest.mark.timeout(60)
def test_status_watch_clears_the_screen_between_frames_and_refuses_a_bad_period(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [*BELAYER, "status", "--state-dir", str(tmp_path), "--watch", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=clean_env(),
    )  # fmt: skip
    try:
        assert process.stdout is not None
        seen = ""
        while seen.count(CLEAR_SCREEN) < 2:
            line = process.stdout.readline()
            assert line, f"belayer status --watch ended early after {seen!r}"
            seen += line
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
        process.wait()
    first_frame = seen.split(CLEAR_SCREEN)[1]
    assert first_frame.splitlines()[0].split() == PROCESS_HEADER and "Ctrl-C to stop" in first_frame
    refused = belayer("status", "--state-dir", str(tmp_path), "--watch", "0")
    assert refused.returncode == 2 and "--watch" in refused.stderr


async def test_events_takes_global_flags_after_the_subcommand(nats_server: NatsServer) -> None:
    ident, message = "e3", protocol.EngineQuarantined(engine_id="e3", failures=2, window_s=5.0)
    async with events_process("--count", "1", "--nats", nats_server.url) as events:
        nc = await bus.connect(nats_server.url, "test-publisher")
        await bus.publish(nc, NAMES.event("engine_quarantined", ident), message)
        await nc.close()
        (line,) = await events.output()
    assert "engine_quarantined" in line and "engine_id=e3" in line and "failures=2" in line


def test_flags_after_a_nested_subcommand_do_not_lose_the_ones_given_before_it() -> None:
    parse = build_parser(benchmarks=False).parse_args
    args = parse(["sandbox", "exec", "s1", "echo hi", "--json", "--host", "h1", "--nats", "nats://x:1"])
    assert (args.verb, args.sandbox, args.json, args.host, args.nats) == (
        "exec",
        "s1",
        True,
        "h1",
        "nats://x:1",
    )
    args = parse(["--nats", "nats://a:1", "--state-dir", "/s", "sandbox", "--json", "--host", "h0", "ls"])
    assert (args.nats, args.state_dir, args.json, args.host) == ("nats://a:1", Path("/s"), True, "h0")
    args = parse(["sandbox", "ls"])
    assert args.json is False and args.host and args.nats is None
    assert parse(["--state-dir", "/s", "status"]).state_dir == Path("/s")
    assert parse(["status", "--state-dir", "/t"]).state_dir == Path("/t")


def test_version_prints_the_installed_distribution_version() -> None:
    done = belayer("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"belayer {importlib.metadata.version('belayer-rl')}"


@pytest.mark.parametrize(
    "argv", [["--version"], ["status", "--json"], ["down"], ["events", "--help"], ["generate", "--help"]]
)
def test_commands_that_need_no_model_do_not_import_torch(tmp_path: Path, argv: list[str]) -> None:
    command = argv if argv == ["--version"] else [*argv, "--state-dir", str(tmp_path)]
    probe = (
        "import sys\n"
        "from belayer_rl.cli.main import main\n"
        "try:\n"
        f"    main({command!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


def test_bench_still_has_its_subcommands() -> None:
    done = belayer("bench", "--help", timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert all(kind in done.stdout for kind in ("rollout", "handover", "checkpoint"))
