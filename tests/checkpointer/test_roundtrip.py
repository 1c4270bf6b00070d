"""Round trip through a real container: checkpoint, change further, kill, restore into a fresh one."""

from __future__ import annotations

import asyncio

import aiodocker
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import ROOT

# Files of every kind in the writable layer; a counter that lives only in a shell's memory and
# answers SIGUSR1 by writing its value to /tmp/probe; a process holding a file open; a background job.
SETUP = r"""
mkdir -p /data/sub && cd /data
echo original > keep.txt && echo doomed > gone.txt && echo old > modify.txt
chmod 640 keep.txt && ln -s keep.txt link && ln -s /data/sub abslink && ln keep.txt hard.txt
(i=0; trap 'echo $i > /tmp/probe' USR1; while :; do i=$((i+1)); sleep 0.05; done) >/dev/null 2>&1 </dev/null &
echo $! > /data/counter.pid
(exec 3</data/keep.txt; exec sleep 100000) >/dev/null 2>&1 </dev/null &
echo $! > /data/reader.pid
sleep 100000 >/dev/null 2>&1 </dev/null &
echo $! > /data/job.pid
"""
CHANGE = r"""
cd /data && rm gone.txt && echo changed >> modify.txt && mkdir newdir && echo new > newdir/f
chmod 600 newdir/f && rm /bin/vi && rm -rf /home && mkdir /var/fresh && rm -rf /var && mkdir /var && echo y > /var/y
"""
PROBE = "kill -USR1 $(cat /data/counter.pid); sleep 0.3; cat /tmp/probe"
SNAPSHOT = r"""
find /data /var | sort | while read f; do
  stat -c '%n %F %a %s %u %g %Y' "$f"
  [ -f "$f" ] && [ ! -L "$f" ] && md5sum "$f"
  [ -L "$f" ] && readlink "$f"
done
ls /bin/vi /home 2>&1
for p in $(cat /data/counter.pid /data/reader.pid /data/job.pid); do echo "pid $p $(cat /proc/$p/cmdline | tr '\0' ' ')"; done
readlink /proc/$(cat /data/reader.pid)/fd/3
"""


async def kill_container(container_id: str) -> None:
    docker = aiodocker.Docker()
    try:
        await docker.containers.container(container_id).kill()
    finally:
        await docker.close()


async def test_round_trip_restores_processes_files_and_context(client: SandboxClient, image: str) -> None:
    info = await client.create(SandboxSpec(image=image, user=ROOT, memory_mb=256), sandbox="rt")
    assert (await client.exec("rt", SETUP)).exit_code == 0
    assert (await client.exec("rt", CHANGE)).exit_code == 0
    await asyncio.sleep(0.5)
    at_checkpoint = int((await client.exec("rt", PROBE)).stdout)
    snapshot = await client.exec("rt", SNAPSHOT)
    assert snapshot.exit_code != 0 or "No such file" in snapshot.stdout  # ls of the deleted paths fails
    assert "/data/gone.txt" not in snapshot.stdout and "/var/y" in snapshot.stdout
    tokens = [5, 6, 7, 8]
    result = await client.checkpoint("rt", "traj-rt", k=4, context_tokens=tokens)
    assert (result.k, result.incarnation) == (4, 0)

    changed = await client.exec(
        "rt", "echo after > /data/after.txt; echo more >> /data/modify.txt; rm /data/link"
    )
    assert changed.exit_code == 0 and changed.step == 5
    await asyncio.sleep(2.0)
    at_kill = int((await client.exec("rt", PROBE)).stdout)
    assert at_kill > at_checkpoint + 10
    await kill_container(info.container_id)
    with pytest.raises(ServiceError) as failed:
        await client.exec("rt", "echo hi")
    assert failed.value.code == "env-failure"

    restored = await client.restore("traj-rt")
    assert (restored.source, restored.k, restored.incarnation) == ("latest", 4, 0)
    assert restored.context_tokens == tokens and restored.rejected == []
    assert restored.container_id != info.container_id
    after = int((await client.exec("rt", PROBE, expect_step=4)).stdout)
    assert at_checkpoint <= after < at_kill
    again = await client.exec("rt", SNAPSHOT)
    assert again.stdout == snapshot.stdout  # same files, modes, owners, times, links, pids, open fd
    assert (await client.exec("rt", "ls /data/after.txt")).exit_code != 0
    # restoring used the artifact without changing it: it verifies and restores again
    await kill_container(restored.container_id)
    twice = await client.restore("traj-rt")
    assert (twice.source, twice.k, twice.rejected) == ("latest", 4, [])


async def test_checkpoint_refused_unless_last_action_is_k(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="k")
    await client.exec("k", "true")
    with pytest.raises(ServiceError) as refused:
        await client.checkpoint("k", "traj-k", k=0)
    assert refused.value.code == "wrong-step"
    ok = await client.checkpoint("k", "traj-k", k=1)
    assert ok.k == 1
    with pytest.raises(ServiceError) as stale:
        await client.checkpoint("k", "traj-k", k=1)
    assert stale.value.code == "stale"
