"""The supervision helpers (shared/processes.py) on real child processes: a polite stop that turns
firm past its grace, a kill whose death is confirmed (one process, or its whole process group),
and the backoff between restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from belayer_rl.shared.processes import Backoff, kill_process, stop_process

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


async def child(code: str, **options: object) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdout=asyncio.subprocess.PIPE,
        **options,  # type: ignore[arg-type]  # test helper: options are subprocess's
    )
    assert process.stdout is not None
    assert await process.stdout.readline() == b"up\n"  # its handlers are in place
    return process


async def test_stop_process_asks_then_kills_past_its_grace() -> None:
    polite = await child("import time; print('up', flush=True); time.sleep(60)")
    await stop_process(polite, grace_s=5.0)
    assert polite.returncode == -signal.SIGTERM
    stubborn = await child(IGNORES_TERM)
    started = time.monotonic()
    await stop_process(stubborn, grace_s=0.5)
    assert stubborn.returncode == -signal.SIGKILL and time.monotonic() - started >= 0.5


async def test_kill_process_confirms_the_death_of_a_child_or_of_its_whole_group() -> None:
    alone = await child(IGNORES_TERM)
    assert await kill_process(alone, timeout_s=5.0)
    assert alone.returncode == -signal.SIGKILL
    # A leader that started a grandchild in its own session: the group kill ends the grandchild too.
    leader = await child(
        "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " print('up', flush=True); print(g.pid, flush=True); time.sleep(60)",
        start_new_session=True,
    )
    assert leader.stdout is not None
    grandchild = int(await leader.stdout.readline())
    assert await kill_process(leader, timeout_s=5.0, group=True)
    for _ in range(100):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"the grandchild {grandchild} outlived its group's kill")
    assert await kill_process(leader, timeout_s=1.0)  # already reaped: nothing to do


def test_backoff_doubles_while_exits_come_soon_and_starts_over_after_a_stable_run() -> None:
    backoff = Backoff(first_s=0.2, max_s=1.0, stable_after_s=10.0)
    waits = [backoff.after_exit(ran_s=1.0) for _ in range(5)]
    assert waits == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert backoff.after_exit(ran_s=11.0) == 0.2
