"""Trust finding 4: a checkpointer in a private cgroup namespace (Docker's default on cgroup v2
hosts, so under Compose there) reads a sandbox's cgroup as `/../docker-<id>.scope`. This machine
runs cgroup v1, so the layout a v2 host shows is laid out in files: /proc/self/mountinfo with the
v2 mount's root above the namespace, /proc/<pid>/cgroup of the checkpointer and of a sandbox's
process, and the host's hierarchy under the mount. The view must find the sandbox's cgroup.procs,
OOM counter and freezer there. Mutation check: the same files read as the old code did (the
namespace's root taken as the mount's) find none of them."""

from __future__ import annotations

from pathlib import Path

from belayer_rl.services.checkpointer.linux import CgroupView, read_oom_kills, thaw_cgroup

CHECKPOINTER, SANDBOX_PROCESS = 4242, 777


def v2_host(tmp_path: Path) -> tuple[Path, Path]:
    mount, proc = tmp_path / "sys-fs-cgroup", tmp_path / "proc"
    files = {
        mount / "system.slice/docker-ckpt.scope/cgroup.procs": f"{CHECKPOINTER}\n",
        mount / "system.slice/docker-sb.scope/cgroup.procs": f"{SANDBOX_PROCESS}\n778\n",
        mount / "system.slice/docker-sb.scope/memory.events": "low 0\nhigh 0\nmax 2\noom 1\noom_kill 3\n",
        mount / "system.slice/docker-sb.scope/cgroup.freeze": "1\n",
        mount / "user.slice/other.scope/cgroup.procs": "1\n",  # a decoy at the same depth
        proc / str(CHECKPOINTER) / "cgroup": "0::/\n",
        proc / str(CHECKPOINTER) / "mountinfo": (
            "22 1 0:21 / / rw - overlay overlay rw\n"
            f"35 22 0:29 /../.. {mount} rw,nosuid,nodev,noexec - cgroup2 cgroup2 rw\n"
        ),
        proc / str(SANDBOX_PROCESS) / "cgroup": "0::/../docker-sb.scope\n",
        proc / "99" / "cgroup": "0::/../../../escape.scope\n",  # climbs past the mount
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (proc / "self").symlink_to(str(CHECKPOINTER))
    return proc, mount


def test_a_sandbox_is_found_from_a_private_cgroup_namespace(tmp_path: Path) -> None:
    proc, mount = v2_host(tmp_path)
    sandbox = mount / "system.slice/docker-sb.scope"
    view = CgroupView.discover(proc, mount)
    assert view.ns_root == "/system.slice/docker-ckpt.scope"
    assert view.procs_file(SANDBOX_PROCESS) == sandbox / "cgroup.procs"
    assert view.oom_files(SANDBOX_PROCESS) == [sandbox / "memory.events"]
    assert read_oom_kills(view.oom_files(SANDBOX_PROCESS)) == 3
    control = view.frozen(SANDBOX_PROCESS)
    assert control == sandbox / "cgroup.freeze"
    thaw_cgroup(control)
    assert view.frozen(SANDBOX_PROCESS) is None and control.read_text() == "0"
    assert view.groups(99) == []  # past the mount: nothing, never another cgroup

    as_read = CgroupView(proc, mount)  # the old lookup: names taken as paths under the mount
    assert as_read.procs_file(SANDBOX_PROCESS) is None
    assert read_oom_kills(as_read.oom_files(SANDBOX_PROCESS)) == 0


def test_a_host_namespace_reads_names_as_they_are(tmp_path: Path) -> None:
    """Without a namespace of its own (the mount's root is `/`), names are paths under the mount."""
    proc, mount = v2_host(tmp_path)
    info = proc / str(CHECKPOINTER) / "mountinfo"
    info.write_text(info.read_text().replace("/../..", "/"))
    (proc / str(SANDBOX_PROCESS) / "cgroup").write_text("0::/system.slice/docker-sb.scope\n")
    view = CgroupView.discover(proc, mount)
    assert view.ns_root == ""
    assert view.procs_file(SANDBOX_PROCESS) == mount / "system.slice/docker-sb.scope/cgroup.procs"
