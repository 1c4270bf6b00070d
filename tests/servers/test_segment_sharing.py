"""Who may map a segment when the servers and engines run as uids of their own (compose.yaml).

Real processes under other uids and groups (root starts them, as CI runs), real /dev/shm files and
the kernel's own permission checks, read through `cat` run as those uids:
- an arena is shared with the asking worker's group only, and a server outside that group refuses
  to make one that the worker could not open (a typed `no-access`, not a worker that fails later);
- a worker of the server's own uid keeps a 0600 arena;
- weights are group-readable, so the engines, members of the weight server's group, map them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator

import pytest
import torch

from belayer_rl.services.kv_server.server import sharing_group
from belayer_rl.shared import segments
from belayer_rl.shared.bus import ServiceError

ENGINE_UID = 2100  # compose.yaml's first engine
OTHER_ENGINE_UID = 2101

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as other uids: root only")


@pytest.fixture
def sleeper() -> Iterator[Callable[[int, int], int]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(uid: int, gid: int) -> int:
        process = subprocess.Popen(["sleep", "60"], user=uid, group=gid, extra_groups=[])
        started.append(process)
        return process.pid

    yield start
    for process in started:
        process.kill()
        process.wait()


def readable_by(path: str, uid: int, gid: int) -> bool:
    done = subprocess.run(["cat", path], user=uid, group=gid, extra_groups=[], capture_output=True)
    return done.returncode == 0


def test_an_arena_is_shared_with_its_own_workers_group_only(sleeper: Callable[[int, int], int]) -> None:
    assert sharing_group(os.getpid()) is None  # the server's own uid: nothing to share
    assert ENGINE_UID not in os.getgroups()
    with pytest.raises(ServiceError) as refused:
        sharing_group(sleeper(ENGINE_UID, ENGINE_UID))  # a group this server does not hold
    assert refused.value.code == "no-access" and f"group {ENGINE_UID}" in str(refused.value)
    with pytest.raises(ServiceError) as gone:
        sharing_group((1 << 22) + 1)
    assert gone.value.code == "dead-holder"

    group = os.getegid()  # a worker in one of the server's groups: the arena goes to that group
    assert sharing_group(sleeper(ENGINE_UID, group)) == group
    manifest = segments.plan("kv", "e0", "test", [("arena", (4, 16), torch.float32)])
    name = f"belayer-test.kv.{os.getpid()}.e0"
    segment = segments.Segment(name, manifest, mode=0o660, group=group)
    try:
        stat = os.stat(segment.path)
        assert (stat.st_mode & 0o777, stat.st_gid) == (0o660, group)
        assert readable_by(str(segment.path), ENGINE_UID, group)
        # Mutation check: another engine, of another uid and group, is refused by the kernel.
        assert not readable_by(str(segment.path), OTHER_ENGINE_UID, OTHER_ENGINE_UID)
    finally:
        segment.close()
        segment.unlink()


def test_a_default_segment_is_private_and_weights_are_group_readable() -> None:
    manifest = segments.plan("weights", "v1", "test", [("w", (8,), torch.float32)])
    private = segments.Segment(f"belayer-test.w.{os.getpid()}.a", manifest)
    shared = segments.Segment(f"belayer-test.w.{os.getpid()}.b", manifest, mode=0o640)
    try:
        assert os.stat(private.path).st_mode & 0o777 == 0o600
        assert os.stat(shared.path).st_mode & 0o777 == 0o640
        group = os.stat(shared.path).st_gid
        assert readable_by(str(shared.path), ENGINE_UID, group)
        assert not readable_by(str(private.path), ENGINE_UID, group)
        assert not readable_by(str(shared.path), ENGINE_UID, OTHER_ENGINE_UID)
    finally:
        for segment in (private, shared):
            segment.close()
            segment.unlink()
