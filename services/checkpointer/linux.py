"""What the checkpointer reads of Linux about a sandbox's processes: cgroups as this process sees
them, /proc (a container's processes, their parents, sessions, time namespaces, liveness) and the
command lines of every process, read where a stuck read cannot hold the service up.

Knows nothing about Docker, checkpoints or NATS: sandbox.py asks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("belayer.checkpointer")

PROC_SCAN_S = 5.0  # a read of every process's command line that takes longer is stuck


# ---------------------------------------------------------------- cgroups, as this process sees them


@dataclass(frozen=True)
class CgroupView:
    """Where the cgroups named in /proc/<pid>/cgroup lie under this process's /sys/fs/cgroup.

    Those names are relative to the reader's cgroup namespace. A checkpointer in a container with
    a namespace of its own (Docker's default on cgroup v2 hosts, and so under Compose there) reads
    a sandbox's cgroup as `/../docker-<id>.scope`, which names nothing under the host's hierarchy
    mounted at /sys/fs/cgroup. `ns_root` is the namespace's root as a path under that mount
    ("": the mount's root is it, as on a host without one); v2 names are resolved against it.
    (cgroup v1 hosts run containers in the host's cgroup namespace: their names are taken as read.)"""

    proc: Path = Path("/proc")
    mount: Path = Path("/sys/fs/cgroup")
    ns_root: str = ""

    @classmethod
    def discover(cls, proc: Path = Path("/proc"), mount: Path = Path("/sys/fs/cgroup")) -> CgroupView:
        """The view of this process: where its cgroup namespace's root is under the v2 mount. The
        mount's root, as /proc/self/mountinfo gives it, is relative to the namespace too: `/../..`
        is two levels above it, and the namespace's root is the directory that many levels down
        that holds this process's own cgroup."""
        try:
            mountinfo = (proc / "self" / "mountinfo").read_text().splitlines()
            own = next((path for controllers, path in parse_cgroups(proc, "self") if not controllers), None)
        except OSError:
            return cls(proc, mount)
        roots = [  # the last mount at that path is the one in sight
            line.split()[3]
            for line in mountinfo
            if len(line.split()) > 4 and line.split()[4] == str(mount) and " - cgroup2 " in line
        ]
        root = roots[-1] if roots else "/"
        climbs = [part for part in root.split("/") if part]
        if own is None or not climbs or any(part != ".." for part in climbs):
            return cls(proc, mount)  # the namespace is the mount's root (or a subtree: as read)
        me = str(os.getpid()) if proc == Path("/proc") else (proc / "self").resolve().name
        for candidate in sorted(mount.glob("/".join(["*"] * len(climbs)))):
            holder = candidate / own.lstrip("/") / "cgroup.procs"
            with contextlib.suppress(OSError):
                if me in holder.read_text().split():
                    return cls(proc, mount, "/" + str(candidate.relative_to(mount)))
        log.warning("the cgroup namespace's root is not found under %s: cgroups taken as read", mount)
        return cls(proc, mount)

    def groups(self, pid: int) -> list[tuple[list[str], Path]]:
        """The cgroups holding `pid`: (controllers, directory) per hierarchy; controllers [] is
        v2's. A v2 name that climbs out of the namespace past the mount is left out."""
        found: list[tuple[list[str], Path]] = []
        for controllers, path in parse_cgroups(self.proc, str(pid)) if pid > 0 else []:
            if controllers:
                found.append((controllers, Path(path)))
                continue
            parts: list[str] = [part for part in self.ns_root.split("/") if part]
            for part in path.split("/"):
                if part == "..":
                    if not parts:
                        break
                    parts.pop()
                elif part not in ("", "."):
                    parts.append(part)
            else:
                found.append(([], self.mount.joinpath(*parts)))
        return found

    def procs_file(self, pid: int) -> Path | None:
        """The cgroup.procs of the cgroup holding `pid` (the pids controller on cgroup v1)."""
        for controllers, path in self.groups(pid):
            if not controllers:
                candidate = path / "cgroup.procs"
            elif "pids" in controllers:
                candidate = self.mount / "pids" / path.relative_to("/") / "cgroup.procs"
            else:
                continue
            if candidate.exists():
                return candidate
        return None

    def oom_files(self, pid: int) -> list[Path]:
        """Where the kernel counts OOM kills for the memory cgroup holding `pid` (v1 or v2)."""
        files: list[Path] = []
        for controllers, path in self.groups(pid):
            if "memory" in controllers:
                files.append(self.mount / "memory" / path.relative_to("/") / "memory.oom_control")
            elif not controllers:
                files.append(path / "memory.events")
        return files

    def freezer(self, pid: int) -> Path | None:
        """The freezer control of the cgroup holding `pid`: v1's freezer.state (THAWED, FREEZING,
        FROZEN), or else v2's cgroup.freeze (0 or 1); None when neither holds it."""
        groups = self.groups(pid)
        for controllers, path in groups:
            if "freezer" in controllers:
                return self.mount / "freezer" / path.relative_to("/") / "freezer.state"
        for controllers, path in groups:
            if not controllers:
                return path / "cgroup.freeze"
        return None

    def frozen(self, pid: int) -> Path | None:
        """The freezer control of the cgroup holding `pid` when that cgroup is frozen or
        freezing, else None."""
        control = self.freezer(pid)
        if control is None:
            return None
        try:
            value = control.read_text().strip()
        except OSError:
            return None
        frozen = value != "THAWED" if control.name == "freezer.state" else value == "1"
        return control if frozen else None


HOST_CGROUPS = CgroupView()  # a process in the host's cgroup namespace; immutable


def parse_cgroups(proc: Path, pid: str) -> list[tuple[list[str], str]]:
    """/proc/<pid>/cgroup as (controllers, name) per hierarchy; [] when it cannot be read."""
    try:
        lines = (proc / pid / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[list[str], str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        found.append(([c for c in controllers.split(",") if c], path))
    return found


# ---------------------------------------------------------------- /proc


def container_processes(init_pid: int, cgroups: CgroupView = HOST_CGROUPS) -> set[tuple[int, int]]:
    """Every process in the cgroup of the container whose init is `init_pid`, as (host pid, start
    time in clock ticks): the start time tells a reused pid from the process that had it."""
    procs = cgroups.procs_file(init_pid)
    if procs is None:
        return set()
    found = set()
    with contextlib.suppress(OSError, ValueError):
        for line in procs.read_text().split():
            pid = int(line)
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                found.add((pid, int(stat.rsplit(")", 1)[1].split()[19])))  # field 22: starttime
    return found


def has_capability(bit: int) -> bool:
    """Whether this process holds the capability (its effective set, /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def time_namespace(pid: int) -> str | None:
    """The time namespace of a live process; None for one gone or a zombie (it has none)."""
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/time")
    return None


def outside_time_namespace(init_pid: int, cgroups: CgroupView = HOST_CGROUPS) -> list[str]:
    """The container's live processes that are not in its init's time namespace, as "pid (comm)".

    A restore puts the container's processes in a new time namespace; a process Docker execs
    into the container later stays in the host's (runc does not enter time namespaces). Such a
    process that is alive at a dump makes the checkpoint one that CRIU refuses to restore ("Can't
    restore sub-task in NS"). Zombies are restored with their parent's namespaces: not counted."""
    own = time_namespace(init_pid)
    if own is None:
        return []
    strays = []
    for pid, _ in container_processes(init_pid, cgroups):
        if (ns := time_namespace(pid)) is not None and ns != own:
            comm = ""
            with contextlib.suppress(OSError):  # (comm is cut at 15 bytes: maybe mid-character)
                comm = Path(f"/proc/{pid}/comm").read_bytes().decode(errors="replace").strip()
            strays.append(f"{pid} ({comm})")
    return strays


def started_by_the_action(
    init_pid: int, before: set[tuple[int, int]], cgroups: CgroupView = HOST_CGROUPS
) -> list[int]:
    """The container's processes that were not there before the action and do not descend from a
    process that was (an earlier action's server forking a worker is that server's business). The
    action's own processes descend from its exec, from outside the container, or were orphaned to
    the container's init: those go."""
    now = container_processes(init_pid, cgroups)
    old = {pid for pid, _ in before & now} - {init_pid}  # the same processes, not reused pids
    parents = {pid: parent_of(pid) for pid, _ in now}
    doomed = []
    for pid, _ in now - before:
        ancestor, hops = parents.get(pid, 0), 0
        while ancestor in parents and ancestor not in old and ancestor != init_pid and hops < 4096:
            ancestor, hops = parents[ancestor], hops + 1
        if pid != init_pid and ancestor not in old:
            doomed.append(pid)
    return doomed


def parent_of(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # field 4: ppid
    return 0


def session_stats(sid: int) -> Iterator[list[str]]:
    """/proc/<pid>/stat of every process of the session `sid`, from field 3 (the state) on, with
    the pid appended."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:  # gone meanwhile
            continue
        if len(fields) > 12 and fields[3] == str(sid):  # field 6: the session
            yield [*fields, entry.name]


def kill_session(sid: int) -> None:
    """SIGKILL every process of the session `sid`, its leader included: a runc and the CRIU it
    started, whatever process group CRIU is in."""
    for fields in session_stats(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(fields[-1]), signal.SIGKILL)


def thaw_cgroup(control: Path) -> None:
    """Thaw the cgroup whose freezer control `CgroupView.frozen` returned."""
    control.write_text("THAWED" if control.name == "freezer.state" else "0")


def read_oom_kills(files: list[Path]) -> int:
    for candidate in files:
        with contextlib.suppress(OSError, ValueError):
            for row in candidate.read_text().splitlines():
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


PF_EXITING = 0x4
SIGKILL_BIT = 1 << 8


def process_alive(pid: int) -> bool:
    """Whether `pid` runs and is not on its way out: gone, a zombie, exiting (PF_EXITING, set
    before a dying init tears its pid namespace down) or with a SIGKILL pending all count as dead."""
    if pid <= 0:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()  # fields[0] is the state, fields[6] the flags
    if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING:
        return False
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("SigPnd", "ShdPnd") and int(value.strip(), 16) & SIGKILL_BIT:
            return False
    return True


def dump_progress(folders: tuple[Path, ...], sid: int) -> tuple[int, int]:
    """(the bytes of the files under `folders`, the CPU ticks of the processes that session `sid`'s
    leader started): a dump that moves neither is stuck. Files and processes that vanish meanwhile
    are left out."""
    written = 0
    for folder in folders:
        for parent, _, names in os.walk(folder):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    written += os.stat(os.path.join(parent, name)).st_size
    ticks = 0
    for fields in session_stats(sid):
        if fields[-1] != str(sid):  # CRIU's; runc's Go runtime ticks over while it only waits
            ticks += int(fields[11]) + int(fields[12])  # fields 14 and 15: utime and stime
    return written, ticks


def command_lines() -> list[list[bytes]]:
    """Every process's argv. A read can block for good on a process stuck in the kernel: call it
    through a ProcScanner."""
    found: list[list[bytes]] = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            found.append(cmdline.read_bytes().split(b"\0"))
    return found


class ProcScanner:
    """Reads every process's command line in a daemon thread of its own, one read at a time, and
    waits at most PROC_SCAN_S for it. A read stuck on a process must hold up neither the event loop,
    nor the default executor (whose few threads the file work needs), nor the service's exit; while
    one is stuck, a later scan waits on that same read, as bounded, and starts no thread."""

    def __init__(self) -> None:
        self.pending: asyncio.Future[list[list[bytes]]] | None = None

    async def scan(self) -> list[list[bytes]] | None:
        """Every process's argv, or None when they cannot be read in time."""
        if self.pending is None or self.pending.done():
            loop = asyncio.get_running_loop()
            pending: asyncio.Future[list[list[bytes]]] = loop.create_future()

            def settle(argvs: list[list[bytes]]) -> None:
                if not pending.done():
                    pending.set_result(argvs)

            def read() -> None:
                argvs = command_lines()
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(settle, argvs)

            threading.Thread(target=read, name="proc-scan", daemon=True).start()
            self.pending = pending
        try:
            async with asyncio.timeout(PROC_SCAN_S):
                return await asyncio.shield(self.pending)
        except TimeoutError:
            log.warning("reading /proc took over %.0f s; a process may be stuck in the kernel", PROC_SCAN_S)
            return None

    async def dumps_in_flight(self) -> dict[str, Path] | None:
        """The `runc checkpoint`s running now (say, orphaned by a checkpointer crash): container id
        -> the folder its CRIU images are written to. None when /proc cannot be read in time."""
        argvs = await self.scan()
        if argvs is None:
            return None
        dumps = {}
        for argv in argvs:
            args = [arg for arg in argv if arg]  # a command line ends with a NUL
            if args and args[0].endswith(b"runc") and b"checkpoint" in args and b"--image-path" in args[:-2]:
                dumps[args[-1].decode(errors="replace")] = Path(
                    args[args.index(b"--image-path") + 1].decode()
                )
        return dumps

    async def runc_root(self, container_id: str) -> Path | None:
        """The runc state root holding the container, read from its containerd shim's command line
        (`-namespace NS -address <exec-root>/containerd/containerd.sock` ->
        <exec-root>/runtime-runc/NS); None when not found, or /proc cannot be read in time."""
        for argv in await self.scan() or []:
            if not argv or b"containerd-shim" not in argv[0] or container_id.encode() not in argv:
                continue
            args = dict(zip(argv[1::2], argv[2::2], strict=False))
            namespace, address = args.get(b"-namespace"), args.get(b"-address")
            if namespace is None or address is None:
                continue
            root = Path(address.decode()).parent.parent / "runtime-runc" / namespace.decode()
            if (root / container_id / "state.json").is_file():
                return root
        return None
