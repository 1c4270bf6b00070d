"""The local backend's fork server, a real process with torch loaded, forking real ranks that join a
real nats-server. Faults are real: SIGKILL of a forked rank's process group, and of the server."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from belayer_rl.services.trainer.groups import ForkServer
from belayer_rl.shared import bus
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.protocol import ForkRefused, GroupHeartbeat
from belayer_rl.shared.subjects import Subjects
from tests.support import NatsServer

pytestmark = pytest.mark.timeout(300)


def reward_rank(nats: NatsServer) -> TrainerGroupConfig:
    return TrainerGroupConfig(
        nats_url=nats.url, metrics_port=-1, run="forks", group="reward", heartbeat_s=0.2
    )


async def heartbeat_of(nats: NatsServer, pid: int) -> GroupHeartbeat:
    """The first heartbeat a rank with `pid` publishes: it really runs as a rank."""
    nc = await bus.connect(nats.url, "test-forks")
    seen: asyncio.Future[GroupHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(beat: GroupHeartbeat) -> None:
        if beat.pid == pid and not seen.done():
            seen.set_result(beat)

    try:
        await bus.listen(nc, Subjects().event("group_heartbeat", "forks"), GroupHeartbeat, on_beat)
        return await asyncio.wait_for(seen, 120)
    finally:
        await nc.close()


@pytest.fixture
async def forks(tmp_path: Path) -> AsyncIterator[ForkServer]:
    server = ForkServer(tmp_path, start_timeout_s=120)
    try:
        yield server
    finally:
        await server.close()


async def gone(pid: int) -> None:
    """Until `pid` is dead: no such process, or a zombie its new parent has not reaped yet."""
    while True:
        try:
            status = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return
        if status.rsplit(")", 1)[1].split()[0] == "Z":
            return
        await asyncio.sleep(0.05)


async def test_a_forked_rank_is_a_rank_in_a_session_of_its_own_and_its_death_is_reported(
    nats_server: NatsServer, tmp_path: Path, forks: ForkServer
) -> None:
    rank = await forks.fork(reward_rank(nats_server), tmp_path / "rank.log")
    beat = await heartbeat_of(nats_server, rank.pid)
    assert (beat.group, beat.rank) == ("reward", 0)
    assert os.getsid(rank.pid) == rank.pid  # the group kills it whole, as a cold rank
    assert forks.process is not None and os.getppid() != rank.pid

    os.killpg(rank.pid, signal.SIGKILL)
    assert await asyncio.wait_for(rank.wait(), 10) == -signal.SIGKILL


async def test_a_line_that_is_not_a_command_is_refused_and_the_next_fork_pairs_with_its_answer(
    nats_server: NatsServer, tmp_path: Path, forks: ForkServer
) -> None:
    first = await forks.fork(reward_rank(nats_server), tmp_path / "first.log")
    assert forks.process is not None and forks.process.stdin is not None
    async with forks.one_at_a_time:
        forks.process.stdin.write(b'{"type": "fork_rank", "argv": "not a list"}\n\xff\xfe\n')
        answers = [await asyncio.wait_for(forks.answers.get(), 10) for _ in range(2)]
    assert all(isinstance(a, ForkRefused) for a in answers), answers
    second = await forks.fork(reward_rank(nats_server), tmp_path / "second.log")
    assert second.pid != first.pid
    await heartbeat_of(nats_server, second.pid)


async def test_ranks_die_with_a_killed_fork_server_and_the_next_fork_starts_a_new_one(
    nats_server: NatsServer, tmp_path: Path, forks: ForkServer
) -> None:
    rank = await forks.fork(reward_rank(nats_server), tmp_path / "rank.log")
    await heartbeat_of(nats_server, rank.pid)
    assert forks.process is not None
    server = forks.process.pid
    os.killpg(server, signal.SIGKILL)
    assert await asyncio.wait_for(rank.wait(), 10) == -signal.SIGKILL
    await asyncio.wait_for(gone(rank.pid), 10)  # the kernel's SIGKILL (PR_SET_PDEATHSIG)

    again = await forks.fork(reward_rank(nats_server), tmp_path / "again.log")
    assert forks.process is not None and forks.process.pid != server
    await heartbeat_of(nats_server, again.pid)
