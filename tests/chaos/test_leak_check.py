"""The campaign's leak check names a process that outlived the cluster, and only that process:
over a long campaign pids are handed out again, and a new process under an old pid is not a leak
(the release run of 1,000 faults reported one such)."""

from __future__ import annotations

import subprocess

from belayer_rl.cli.chaos.oracle import outliving, start_ticks


def test_a_process_still_running_is_named_and_a_reused_pid_is_not() -> None:
    """Pid reuse cannot be forced, so a reused pid is shown by a start time other than the one
    recorded. Mutation check, run by hand: ignoring the start time names it too."""
    alive = subprocess.Popen(["sleep", "60"])
    ended = subprocess.Popen(["true"])
    ended.wait()
    try:
        started = start_ticks(alive.pid)
        assert started is not None and start_ticks(ended.pid) is None
        assert outliving({alive.pid: started, ended.pid: None}) == [alive.pid]
        assert outliving({alive.pid: started - 1}) == []  # the pid, handed out again
        assert outliving({alive.pid: None}) == [alive.pid]  # seen with no start time: counted
    finally:
        alive.kill()
        alive.wait()
    assert outliving({alive.pid: started}) == []
