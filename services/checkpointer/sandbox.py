"""Sandbox containers on one Docker engine: create with safe defaults, run an action, judge health.

Knows nothing about checkpoints or NATS. An action runs as `/bin/sh -c command` in a new session
under a small shell wrapper inside the container: Docker has no API to kill an exec, so the
wrapper's watcher SIGKILLs the action's whole process group when its time is up. A process can
leave that group (setsid, job control) or kill the watcher, so the deadline is also enforced from
the host: the container is frozen, every process of its cgroup that was not there before the
action is SIGKILLed, and it is thawed. Whether the
environment failed is judged from the container's state (running, the kernel's OOM-kill counter
of its memory cgroup, the daemon's answer), never from an exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import io
import logging
import os
import shutil
import signal
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import aiodocker
import aiohttp
import msgspec

from belayer_rl.services.checkpointer.client import container_name
from belayer_rl.services.checkpointer.linux import (
    HOST_CGROUPS,
    CgroupView,
    ProcScanner,
    container_processes,
    dump_progress,
    has_capability,
    kill_session,
    outside_time_namespace,
    process_alive,
    read_oom_kills,
    started_by_the_action,
    thaw_cgroup,
)
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import EnvFailureReason, SandboxSpec

log = logging.getLogger("belayer.checkpointer")

LABEL_HOST = "belayer.host"
LABEL_SANDBOX = "belayer.sandbox"
LABEL_SPEC = "belayer.spec"

# PID 1 when the spec names no command: a shell that idles and reaps orphans.
IDLE_CMD = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]

# $1 command, $2 timeout in seconds, $3 the line written to stderr when the watcher fired.
# The action and the watcher each lead their own process group (setsid in a non-interactive
# shell's background child keeps the pid), so one `kill -KILL -pgid` ends either whole. A quick
# action can end before the watcher has called setsid: its pid is killed first, then its group.
# (Reaped with stderr closed: the shell reports a killed job as "Killed" on its stderr.)
EXEC_WRAPPER = r"""
setsid /bin/sh -c "$1" </dev/null &
p=$!
setsid /bin/sh -c 'sleep "$1"; kill -0 -"$2" 2>/dev/null && echo "$3" >&2 && kill -KILL -"$2"' watcher "$2" "$p" "$3" \
  </dev/null >/dev/null &
w=$!
wait "$p"
rc=$?
kill -KILL "$w" -"$w" 2>/dev/null
wait "$w" 2>/dev/null
exit "$rc"
"""
# The watcher's stdout goes nowhere, only its marker line reaches stderr; see run_action.

OUTPUT_CAP = 256 << 10  # bytes kept per stream, and again per stream as encoded in the reply
EXEC_GRACE_S = 10.0  # past timeout + grace, the wrapper itself is presumed stuck
SWEEP_GRACE_S = 1.0  # past timeout + this, the host kills what the action started
FREEZE_TRIES = 4  # runc's freeze can time out under load; see `pause`
STRAY_GRACE_S = 2.0  # for the last action's processes to finish dying before a dump; see `strays`
FREEZE_RETRY_S = 0.2
SIGKILLED = 137  # a container's exit code when its init was SIGKILLed (128 + 9)
OOM_REPORT_S = 0.5  # how long after a SIGKILLed init Docker may still report its OOM kill


DOCKER_UNREACHABLE = 900  # aiodocker's status for a daemon it could not connect to
USER_FILE_MAX_BYTES = 1 << 20  # /etc/passwd and /etc/group read from an image to pin a user's numbers
DOCKER_SILENT = 504  # ours, for a call the daemon did not answer within the engine's bound
REMOVAL_UNDER_WAY = "is already in progress"  # the daemon's 409 for a second removal of a container
REMOVAL_WAIT_S = 10.0  # how long a removal under way is waited for
CAP_SYS_RESOURCE = 24  # prlimit() on another user's process needs it; CRIU reads every process's limits
CRIU_NO_LIMITS = "Can't get rlimit"  # CRIU's log when prlimit() was refused
DUMP_POLL_S = 1.0  # how often a dump's progress is measured (see `DockerEngine.watch_dump`)
KILLED_DUMP_S = 10.0  # for a stuck dump's runc to be reaped once killed
CRIU_CALL_S = 600.0  # the bound of a call that dumps or restores processes (their memory may be large)
UNREACHABLE_TEXT = "Cannot connect to Docker Engine"  # aiodocker's message for that status
SILENT_TEXT = "the Docker daemon did not answer"  # ours, for DOCKER_SILENT
NO_SPACE_TEXT = "No space left on device"  # strerror(ENOSPC), as it appears in gathered errors


def host_trouble(exc: BaseException) -> ServiceError | None:
    """The error to answer when `exc` is this host's trouble rather than the sandbox's or a
    checkpoint's: Docker out of reach or a full disk. Both pass; the caller may ask again."""
    if isinstance(exc, aiodocker.DockerError) and exc.status in (DOCKER_UNREACHABLE, DOCKER_SILENT):
        return ServiceError("daemon-unavailable", exc.message)
    if (
        isinstance(exc, EnvironmentFailure)
        and exc.reason == "daemon-error"
        and (UNREACHABLE_TEXT in exc.detail or SILENT_TEXT in exc.detail)
    ):
        return ServiceError("daemon-unavailable", exc.detail)
    full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    # shutil.copytree gathers its failures into one shutil.Error; the daemon reports its own disk
    if full or (isinstance(exc, (shutil.Error, aiodocker.DockerError)) and NO_SPACE_TEXT in str(exc)):
        return ServiceError("store-full", f"a disk of this host is full: {exc}")
    return None


class EnvironmentFailure(Exception):
    """The sandbox's environment failed; never an observation."""

    def __init__(self, reason: EnvFailureReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: EnvFailureReason = reason
        self.detail = detail

    @classmethod
    def interrupted(cls, step: int) -> EnvironmentFailure:
        """Action `step + 1` was marked started and never counted (the service stopped, or the
        action ended in an unexpected error): whether it changed the sandbox is unknown."""
        return cls("interrupted", f"action {step + 1} started and has no outcome: it may have run")


@dataclass(frozen=True)
class ActionOutput:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration_s: float


def labels(host_id: str, sandbox: str, spec: SandboxSpec) -> dict[str, str]:
    return {
        LABEL_HOST: host_id,
        LABEL_SANDBOX: sandbox,
        LABEL_SPEC: msgspec.json.encode(spec).decode(),
    }


# Docker's own default set: what a process in a container has unless told otherwise. Anything past
# it (SYS_ADMIN, SYS_MODULE, DAC_READ_SEARCH, SYS_PTRACE, NET_ADMIN, ALL...) reaches into the host.
ALLOWED_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
        "NET_RAW", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
    }
)  # fmt: skip


@dataclass(frozen=True)
class SandboxPolicy:
    """What this host lets a sandbox ask for: checked on every container it makes, a restore's
    (from a manifest's settings) as well as a create's."""

    allow_network: bool
    max_memory_mb: int
    max_cpus: float
    max_pids: int
    allow_root_user: bool = False

    def user_refusal(self, user: str) -> str:
        """Why actions may not run as `user`, the spec's user once pinned to numbers ("" runs them as
        the container's root); "" when they may."""
        if (not user or is_root(user)) and not self.allow_root_user:
            shown = repr(user) if user else "the container's default, root"
            return (
                f"actions would run as uid 0 ({shown}): name an unprivileged `user` in the spec or"
                " the image's USER, or allow root on this host (the checkpointer's --allow-root-user)"
            )
        return ""

    def refusal(self, spec: SandboxSpec) -> str:
        """Why `spec` may not run here; "" when it may."""
        beyond = sorted(set(spec.cap_add) - ALLOWED_CAPABILITIES)
        if beyond:
            return f"capabilities {beyond} are not allowed (allowed: {sorted(ALLOWED_CAPABILITIES)})"
        if spec.network and not self.allow_network:
            return "network is not allowed on this host (the checkpointer's --allow-network)"
        # An image that names an unprivileged user chose it; only the host may let a spec undo that.
        if is_root(spec.user) and not self.allow_root_user:
            return f"user {spec.user!r} is not allowed on this host (the checkpointer's --allow-root-user)"
        if spec.memory_mb > self.max_memory_mb:
            return f"memory_mb {spec.memory_mb} is over this host's {self.max_memory_mb} per sandbox"
        if spec.cpus > self.max_cpus:
            return f"cpus {spec.cpus:g} is over this host's {self.max_cpus:g} per sandbox"
        if spec.pids_limit > self.max_pids:
            return f"pids_limit {spec.pids_limit} is over this host's {self.max_pids} per sandbox"
        return ""


def is_root(user: str) -> bool:
    """Whether a Docker `User` names root: by name, or as uid 0 however written ("00" too)."""
    name = user.partition(":")[0]
    return name == "root" or (name.isdigit() and int(name) == 0)


def numeric_user(user: str, passwd: bytes | None, group: bytes | None) -> str:
    """`user` ("name", "uid", "name:group", ...) as "uid:gid" (or "uid" for a uid the image's
    /etc/passwd does not list, with no group named), looked up in the image's /etc/passwd and
    /etc/group; ValueError saying why when a name is not there. Actions run under these numbers:
    a name, and the group of a user named without one, are resolved by the daemon at every exec
    from the container's files as they are then, which an earlier action may have rewritten.
    (Numbers alone carry no supplementary groups.)"""
    entries = [
        fields
        for line in (passwd or b"").decode(errors="replace").splitlines()
        if len(fields := line.split(":")) >= 4 and fields[2].isdigit() and fields[3].isdigit()
    ]

    def group_id(name: str) -> str:
        if name.isdigit():
            return str(int(name))
        for line in (group or b"").decode(errors="replace").splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[0] == name and fields[2].isdigit():
                return str(int(fields[2]))
        raise ValueError(f"{name!r} is not in the image's /etc/group")

    name, _, group_name = user.partition(":")
    key = 2 if name.isdigit() else 0
    wanted = str(int(name)) if name.isdigit() else name
    entry = next((f for f in entries if (str(int(f[2])) if key == 2 else f[0]) == wanted), None)
    if entry is None and not name.isdigit():
        raise ValueError(f"{name!r} is not in the image's /etc/passwd")
    uid = str(int(name)) if entry is None else str(int(entry[2]))
    if group_name:
        return f"{uid}:{group_id(group_name)}"
    return uid if entry is None else f"{uid}:{int(entry[3])}"


def with_user(spec: SandboxSpec, user: str) -> SandboxSpec:
    """`spec` naming `user`; msgspec.ValidationError when `user` is no name a spec may hold."""
    return msgspec.convert({**msgspec.to_builtins(spec), "user": user}, type=SandboxSpec)


def host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


def create_config(spec: SandboxSpec, host_id: str, sandbox: str) -> dict[str, Any]:
    """The Engine API body for a sandbox: safe defaults, and no field through which to mount the host."""
    memory = spec.memory_mb << 20
    return {
        "Image": spec.image,
        "Cmd": list(spec.cmd) or IDLE_CMD,
        "Env": [f"{k}={v}" for k, v in sorted(spec.env.items())],
        "WorkingDir": spec.workdir,
        # The checkpointer's idle init runs as root, the actions as `spec.user` (run_action). CRIU
        # reads the limits of every process it dumps, and prlimit() on another user's process needs
        # CAP_SYS_RESOURCE, which root lacks on some hosts: a root init can be dumped everywhere. A
        # spec's own `cmd` is the image's program and runs as `spec.user` too.
        "User": spec.user if spec.cmd else "0",
        "Labels": labels(host_id, sandbox, spec),
        "AttachStdin": False,
        "OpenStdin": False,
        "Tty": False,
        "HostConfig": {
            "NetworkMode": "bridge" if spec.network else "none",
            "CapDrop": ["ALL"],
            "CapAdd": list(spec.cap_add),
            "SecurityOpt": ["no-new-privileges"],
            "Memory": memory,
            "MemorySwap": memory,  # no swap: the memory limit is the limit
            "PidsLimit": spec.pids_limit,
            "NanoCpus": int(spec.cpus * 1e9),
            "Privileged": False,
            "Binds": [],
            "Mounts": [],
            "RestartPolicy": {"Name": "no"},
            "IpcMode": "private",
        },
    }


# ---------------------------------------------------------------- the engine's replies
# Each reply is decoded once, here, into the fields the checkpointer reads; every other field is
# ignored. A reply that does not fit raises msgspec.ValidationError, naming the field and its path.


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /info."""

    docker_root_dir: str
    experimental_build: bool


class ContainerState(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    running: bool
    paused: bool
    status: str
    oom_killed: bool = msgspec.field(name="OOMKilled")
    exit_code: int
    pid: int  # 0 when the container does not run


class ContainerInspect(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /containers/{id}/json, the part that judges health."""

    state: ContainerState


class GraphDriverData(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    upper_dir: str  # overlay2's writable layer on the host


class GraphDriver(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    data: GraphDriverData


class ContainerStorage(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /containers/{id}/json, the part that locates the writable layer. Decoded apart from
    ContainerInspect so that health stays judged on a storage driver without an upper dir."""

    graph_driver: GraphDriver


class ContainerSummary(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """One entry of GET /containers/json."""

    id: str
    state: str  # "running", "paused", "exited", ...


class ExecInspect(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /exec/{id}/json."""

    running: bool
    exit_code: int | None = None  # null until the exec has ended
    pid: int = 0  # 0: its process was never started (the daemon wrote why into the output)


class ImageRunConfig(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    user: str = ""  # the image's USER; "" when it names none


class ImageInspect(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /images/{name}/json."""

    id: str
    config: ImageRunConfig | None = None  # the engine answers null for an image without one

    @property
    def user(self) -> str:
        return self.config.user if self.config is not None else ""


class EventActor(msgspec.Struct, frozen=True, kw_only=True):
    id: str = msgspec.field(name="ID")


class EngineEvent(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """One line of GET /events."""

    action: str
    actor: EventActor


# ---------------------------------------------------------------- the engine

P = ParamSpec("P")
R = TypeVar("R")


def daemon_call(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Raise a call the daemon did not answer within the client's bound as aiodocker.DockerError
    (DOCKER_SILENT), the error every caller handles: aiohttp raises a bare TimeoutError. A daemon
    can stay silent for good (an exec that starts as its container freezes holds the container's
    lock, and every later call on it waits); without the bound the caller would wait with it."""

    @functools.wraps(method)
    async def bounded(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await method(*args, **kwargs)
        except TimeoutError:
            raise aiodocker.DockerError(DOCKER_SILENT, f"{SILENT_TEXT} {method.__name__} in time") from None

    return bounded


class DockerEngine:
    """One Docker engine: its client, its data root, and the calls the checkpointer makes."""

    def __init__(
        self,
        docker: aiodocker.Docker,
        data_root: Path,
        call_timeout_s: float,
        dump_stall_s: float,
        cgroups: CgroupView = HOST_CGROUPS,
    ) -> None:
        self.docker = docker
        self.cgroups = cgroups  # where its containers' cgroups are, seen from this process
        self.data_root = data_root
        self.call_timeout_s = call_timeout_s
        self.dump_stall_s = dump_stall_s
        self.oom_files: dict[str, list[Path]] = {}  # container id -> its memory cgroup's counters
        self.procs = ProcScanner()

    @classmethod
    async def connect(cls, url: str | None, call_timeout_s: float, dump_stall_s: float) -> DockerEngine:
        """Every call is bounded by `call_timeout_s`, except an exec's output stream, the event
        stream (aiodocker leaves both unbounded) and a dump or restore (CRIU_CALL_S; a dump by runc
        is killed once it makes no progress for `dump_stall_s`)."""
        docker = aiodocker.Docker(url=url, timeout=aiohttp.ClientTimeout(total=call_timeout_s))
        try:
            info = msgspec.convert(await docker.system.info(), type=EngineInfo)
        except BaseException:
            await docker.close()
            raise
        cgroups = await asyncio.to_thread(CgroupView.discover)
        return cls(docker, Path(info.docker_root_dir), call_timeout_s, dump_stall_s, cgroups)

    async def close(self) -> None:
        await self.docker.close()

    @daemon_call
    async def create(self, spec: SandboxSpec, host_id: str, sandbox: str) -> str:
        container = await self.docker.containers.create(
            create_config(spec, host_id, sandbox), name=container_name(host_id, sandbox)
        )
        return container.id

    @daemon_call
    async def recreate(self, old: str, spec: SandboxSpec, host_id: str, sandbox: str) -> str:
        """Remove the sandbox's container `old` (if any) and create a new one. A container that
        holds the sandbox's name without being `old` (a crash between create and record) goes too."""
        if old:
            await self.remove(old)
        try:
            return await self.create(spec, host_id, sandbox)
        except aiodocker.DockerError as exc:
            if exc.status != 409:
                raise
        await self.remove(container_name(host_id, sandbox))
        return await self.create(spec, host_id, sandbox)

    @daemon_call
    async def state(self, container_id: str) -> ContainerState:
        """Raise aiodocker.DockerError, or msgspec.ValidationError for a reply that does not fit."""
        reply = await self.docker._query_json(f"containers/{container_id}/json")
        return msgspec.convert(reply, type=ContainerInspect).state

    @daemon_call
    async def upper_dir(self, container_id: str) -> Path:
        """The container's writable layer on the host; raises as `state` does."""
        reply = await self.docker._query_json(f"containers/{container_id}/json")
        return Path(msgspec.convert(reply, type=ContainerStorage).graph_driver.data.upper_dir)

    @daemon_call
    async def small_file(self, container_id: str, path: str) -> bytes | None:
        """A regular file of a created container's filesystem, through the daemon's archive call;
        None when it is missing, not a regular file or over USER_FILE_MAX_BYTES (the image is
        untrusted: nothing larger is read)."""
        body = bytearray()
        try:
            async with self.docker._query(
                f"containers/{container_id}/archive", params={"path": path}
            ) as response:
                async for piece in response.content.iter_chunked(1 << 16):
                    body += piece
                    if len(body) > USER_FILE_MAX_BYTES + 4 * tarfile.BLOCKSIZE:
                        return None
        except aiodocker.DockerError as exc:
            if exc.status == 404:
                return None
            raise
        try:
            with tarfile.open(fileobj=io.BytesIO(bytes(body)), mode="r:") as tar:
                member = tar.next()
                if member is None or not member.isfile() or member.size > USER_FILE_MAX_BYTES:
                    return None
                data = tar.extractfile(member)
                return data.read() if data is not None else None
        except tarfile.TarError:
            return None

    @daemon_call
    async def inspect_image(self, name: str) -> ImageInspect:
        """Raise aiodocker.DockerError (404: no such image), or msgspec.ValidationError."""
        return msgspec.convert(await self.docker.images.inspect(name), type=ImageInspect)

    @daemon_call
    async def start(self, container_id: str, checkpoint: str | None = None) -> None:
        params = {"checkpoint": checkpoint} if checkpoint else None
        bound = aiohttp.ClientTimeout(total=CRIU_CALL_S if checkpoint else self.call_timeout_s)
        async with self.docker._query(
            f"containers/{container_id}/start", method="POST", params=params, timeout=bound
        ):
            pass
        with contextlib.suppress(aiodocker.DockerError, msgspec.ValidationError):
            self.oom_files[container_id] = self.cgroups.oom_files((await self.state(container_id)).pid)

    @daemon_call
    async def remove(self, container_id: str) -> None:
        """Kill and remove; a container that is already gone is fine, and one whose removal is
        under way (a sandbox made again by name while its last container goes) is waited for."""
        self.oom_files.pop(container_id, None)
        try:
            async with self.docker._query(
                f"containers/{container_id}", method="DELETE", params={"force": "1", "v": "1"}
            ):
                pass
        except aiodocker.DockerError as exc:
            if exc.status == 409 and REMOVAL_UNDER_WAY in str(exc):
                await self.gone(container_id)
            elif exc.status != 404:
                raise

    async def gone(self, container_id: str) -> None:
        """Wait until the engine no longer knows the container (at most REMOVAL_WAIT_S)."""
        async with asyncio.timeout(REMOVAL_WAIT_S):
            while True:
                try:
                    await self.docker._query_json(f"containers/{container_id}/json")
                except aiodocker.DockerError as exc:
                    if exc.status == 404:
                        return
                    raise
                await asyncio.sleep(0.1)

    async def thaw_behind_dockers_back(self, container_id: str, state: ContainerState) -> bool:
        """Thaw the container's cgroup when it is frozen while Docker holds the container running
        (`state`), and say whether it was. The campaign saw a sandbox so after a dockerd restart:
        Docker's unpause answered "not paused", its kill "did not receive an exit event", and every
        action waited until its timeout. The caller holds the sandbox's lock, so this is never a
        checkpoint's own freeze."""
        if not state.running or state.paused:
            return False
        control = await asyncio.to_thread(self.cgroups.frozen, state.pid)
        if control is None:
            return False
        log.warning("container %s is frozen though Docker holds it running: thawing it", container_id[:12])
        try:
            await asyncio.to_thread(thaw_cgroup, control)
        except OSError as exc:
            log.error("could not thaw container %s (%s): %s", container_id[:12], control, exc)
            return False
        return True

    @daemon_call
    async def pause(self, container_id: str) -> None:
        """Freeze the container. runc gives up when the cgroup's tasks do not settle within its
        own deadline ("unable to freeze"), which many sandboxes busy at once can cause; it thaws
        the cgroup again before it answers, so asking again is safe."""
        for attempt in range(FREEZE_TRIES):
            try:
                async with self.docker._query(f"containers/{container_id}/pause", method="POST"):
                    return
            except aiodocker.DockerError as exc:
                if "unable to freeze" not in exc.message or attempt == FREEZE_TRIES - 1:
                    raise
                log.warning(
                    "freezing %s failed (try %d), trying again: %s",
                    container_id[:12],
                    attempt + 1,
                    exc.message,
                )
                await asyncio.sleep(FREEZE_RETRY_S * 2**attempt)

    @daemon_call
    async def unpause(self, container_id: str) -> None:
        async with self.docker._query(f"containers/{container_id}/unpause", method="POST"):
            pass

    async def strays(self, init_pid: int, grace_s: float = STRAY_GRACE_S) -> list[str]:
        """Processes that would make a dump of the container whose init is `init_pid`
        unrestorable (see `outside_time_namespace`), after `grace_s` for those of the last action
        that are still dying."""
        deadline = time.monotonic() + grace_s
        found = await asyncio.to_thread(outside_time_namespace, init_pid, self.cgroups)
        while found and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            found = await asyncio.to_thread(outside_time_namespace, init_pid, self.cgroups)
        return found

    @daemon_call
    async def checkpoint(self, container_id: str, images: Path) -> str:
        """CRIU-dump the container's processes into `images`, leaving them running (or paused).

        Runs the engine's own runc directly when its state is found: Docker 20.10 routes a
        checkpoint through containerd's content store (tar, digest, extract), which is ~15x slower
        for large memory and so keeps the container frozen longer. Otherwise asks the Engine API.
        The images are the same either way, and restore goes through the engine. Returns the path
        taken ("runc" or "engine")."""
        root = await self.procs.runc_root(container_id)
        runc = shutil.which("runc")
        if root is not None and runc is not None:
            work = images.parent / (images.name + ".work")
            process = await asyncio.create_subprocess_exec(
                runc, "--root", str(root), "checkpoint", "--image-path", str(images), "--work-path", str(work),
                "--leave-running", container_id,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # runc and its CRIU, killed together when stuck
            )  # fmt: skip
            out, stuck = await self.watch_dump(process, (images, work))
            dump_log = ""
            with contextlib.suppress(OSError):
                dump_log = (work / "dump.log").read_text(errors="replace")
            shutil.rmtree(work, ignore_errors=True)
            if stuck:  # CRIU may have left its parasite code in a process it held: not to be trusted
                raise EnvironmentFailure(
                    "dump-stuck",
                    f"the dump made no progress for {self.dump_stall_s:g}s; runc and CRIU were killed,"
                    f" and the processes they held may be damaged. CRIU's log ends: {dump_log[-600:]}",
                )
            if process.returncode != 0:
                why = ""
                if CRIU_NO_LIMITS in dump_log and not has_capability(CAP_SYS_RESOURCE):
                    why = (
                        "CRIU may not read the limits of another user's processes: this host's root lacks"
                        " CAP_SYS_RESOURCE (run the sandbox as root, or give the checkpointer that capability); "
                    )
                raise OSError(
                    f"{why}runc checkpoint failed ({process.returncode}):"
                    f" {out.decode(errors='replace')[-400:]} {dump_log[-600:]}"
                )
            return "runc"
        await self.docker._query_json(
            f"containers/{container_id}/checkpoints",
            method="POST",
            data={"CheckpointID": images.name, "CheckpointDir": str(images.parent), "Exit": False},
            timeout=aiohttp.ClientTimeout(total=CRIU_CALL_S),
        )
        return "engine"

    async def watch_dump(
        self, process: asyncio.subprocess.Process, folders: tuple[Path, ...]
    ) -> tuple[bytes, bool]:
        """runc's output once it exits, and whether it was killed as stuck: its session (runc and
        the CRIU it started) made no progress for `dump_stall_s`, neither its files in `folders`
        nor CRIU's CPU time. CRIU was seen waiting in wait4 for good after a kill
        of the container mid-dump, holding the sandbox's lock, and Docker could no longer kill the
        container. A watch that is cancelled leaves the dump running, as a crash of the
        checkpointer would: the orphaned-dump check of the next start waits for it."""
        output = asyncio.ensure_future(process.communicate())
        progress, moved_at = (-1, -1), time.monotonic()
        try:
            while not output.done():
                await asyncio.wait({output}, timeout=DUMP_POLL_S)
                now = await asyncio.to_thread(dump_progress, folders, process.pid)
                if now != progress:
                    progress, moved_at = now, time.monotonic()
                elif not output.done() and time.monotonic() - moved_at > self.dump_stall_s:
                    kill_session(process.pid)  # a short /proc walk, not queued behind other file work
                    with contextlib.suppress(TimeoutError):  # a runc stuck in the kernel stays a zombie
                        async with asyncio.timeout(KILLED_DUMP_S):
                            await asyncio.shield(output)
                    return (output.result()[0] if output.done() else b""), True
            return output.result()[0], False
        finally:
            output.cancel()  # nothing once it is done

    @daemon_call
    async def ours(self, host_id: str) -> list[ContainerSummary]:
        reply = await self.docker._query_json(
            "containers/json",
            params={
                "all": "1",
                "filters": msgspec.json.encode({"label": [f"{LABEL_HOST}={host_id}"]}).decode(),
            },
        )
        return msgspec.convert(reply, type=list[ContainerSummary])

    async def deaths(self, host_id: str) -> AsyncIterator[tuple[str, str]]:
        """(container id, "die" or "oom") for the host's sandbox containers, as the engine reports
        them, until the stream breaks (a daemon restart)."""
        filters = {"type": ["container"], "event": ["die", "oom"], "label": [f"{LABEL_HOST}={host_id}"]}
        async with self.docker._query(
            "events",
            params={"filters": msgspec.json.encode(filters).decode()},
            timeout=aiohttp.ClientTimeout(),
        ) as response:
            async for line in response.content:
                try:
                    event = msgspec.json.decode(line, type=EngineEvent)
                except msgspec.DecodeError:  # not JSON, or not an event (ValidationError): skip it
                    continue
                yield event.actor.id, event.action

    def container_dir(self, container_id: str) -> Path:
        return self.data_root / "containers" / container_id

    # ------------------------------------------------------------ health

    async def health(self, container_id: str, oom_seen: int) -> tuple[EnvironmentFailure | None, int]:
        """(failure or None, OOM kills so far), from the container's state and its memory cgroup."""
        try:
            state = await self.state(container_id)
        except aiodocker.DockerError as exc:
            if exc.status == 404:
                return EnvironmentFailure("missing", f"container {container_id[:12]} is gone"), oom_seen
            return EnvironmentFailure("daemon-error", f"inspect failed: {exc}"), oom_seen
        except msgspec.ValidationError as exc:
            return EnvironmentFailure("daemon-error", f"inspect reply: {exc}"), oom_seen
        if not state.running and state.exit_code == SIGKILLED and not state.oom_killed:
            # The OOM killer's SIGKILL of the init: Docker reports the exit ("die") before the OOM
            # ("oom"), and the init's cgroup is gone with it, so ask once more a moment later.
            await asyncio.sleep(OOM_REPORT_S)
            with contextlib.suppress(aiodocker.DockerError, msgspec.ValidationError):
                state = await self.state(container_id)
        if state.oom_killed:
            return EnvironmentFailure("oom-killed", "the container was OOM-killed"), oom_seen
        pid = state.pid
        if container_id not in self.oom_files and pid > 0:  # found while the init lives, kept after
            self.oom_files[container_id] = self.cgroups.oom_files(pid)
        kills = read_oom_kills(self.oom_files.get(container_id, []))
        if kills > oom_seen:  # the more specific verdict first: an OOM kill may also end the init
            return EnvironmentFailure("oom-killed", f"{kills - oom_seen} process(es) OOM-killed"), kills
        if not state.running:
            detail = f"container is {state.status}, exit code {state.exit_code}"
            return EnvironmentFailure("dead", detail), kills
        await self.thaw_behind_dockers_back(container_id, state)  # a kill waiting for it lands then
        if not process_alive(pid):  # the kernel knows before the daemon has processed the exit
            return EnvironmentFailure("dead", f"the container's init process {pid} is gone"), kills
        return None, kills

    # ------------------------------------------------------------ actions

    async def run_action(self, container_id: str, command: str, timeout_s: float, user: str) -> ActionOutput:
        """Run one action as `user` ("": the container's); raise EnvironmentFailure("exec-stream"/
        "daemon-error") when the exec itself breaks. The caller still judges the container's health
        afterwards."""
        marker = f"belayer: action killed after {timeout_s:g}s"
        start = time.monotonic()
        try:
            init_pid = (await self.state(container_id)).pid
        except aiodocker.DockerError as exc:
            raise EnvironmentFailure("daemon-error", f"inspect failed: {exc.message}") from None
        before = await asyncio.to_thread(container_processes, init_pid, self.cgroups)
        if not before:
            log.warning(
                "container %s: its cgroup is not readable: timeouts enforced inside only", container_id[:12]
            )
        swept = 0

        async def sweep() -> None:
            nonlocal swept
            try:
                swept += await self.kill_newer(container_id, init_pid, before)
            except aiodocker.DockerError as exc:
                raise EnvironmentFailure(
                    "daemon-error", f"freezing for the timeout failed: {exc.message}"
                ) from None

        try:
            execution = await self.exec_create(
                container_id,
                ["/bin/sh", "-c", EXEC_WRAPPER, "belayer-action", command, f"{timeout_s:.3f}", marker],
                user,
            )
        except aiodocker.DockerError as exc:
            raise EnvironmentFailure("daemon-error", f"exec create failed: {exc.message}") from None
        out, err = bytearray(), bytearray()
        truncated = False

        async def read(stream: Any) -> None:
            nonlocal truncated
            while (message := await stream.read_out()) is not None:
                buf = out if message.stream == 1 else err
                room = OUTPUT_CAP - len(buf)
                if len(message.data) > room:
                    truncated = True
                buf += message.data[: max(room, 0)]

        try:
            async with contextlib.AsyncExitStack() as started:
                stream = await self.exec_start(started, execution)
                reader = asyncio.create_task(read(stream))
                try:
                    info = await self._wait_exec(
                        execution,
                        reader,
                        start + timeout_s + EXEC_GRACE_S,
                        start + timeout_s + SWEEP_GRACE_S,
                        sweep,
                    )
                finally:
                    if not reader.done():  # a background job may still hold the stream open
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(asyncio.shield(reader), 0.1)
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await reader
        except aiodocker.DockerError as exc:
            raise EnvironmentFailure("daemon-error", f"exec failed: {exc.message}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EnvironmentFailure("exec-stream", f"exec stream broke: {exc}") from None
        if reader.done() and not reader.cancelled() and reader.exception() is not None:
            raise EnvironmentFailure("exec-stream", f"exec stream broke: {reader.exception()}")
        if info.exit_code is None:
            raise EnvironmentFailure("exec-stream", "the exec ended without an exit code")
        if info.pid == 0:  # e.g. the container froze as it started: the output is the daemon's
            said = (bytes(out) + bytes(err)).decode(errors="replace").strip()[-400:]
            raise EnvironmentFailure("daemon-error", f"the action never started: {said}")
        stderr = bytes(err)
        fired = (marker + "\n").encode() in stderr
        if fired:
            stderr = stderr.replace((marker + "\n").encode(), b"")
            await sweep()  # what left the action's process group outlived the watcher's kill
        timed_out = fired or swept > 0
        return ActionOutput(
            exit_code=info.exit_code,
            stdout=bytes(out),
            stderr=stderr,
            timed_out=timed_out,
            truncated=truncated,
            duration_s=time.monotonic() - start,
        )

    @daemon_call
    async def exec_create(self, container_id: str, argv: list[str], user: str) -> Any:
        """The exec (aiodocker's Exec), created and not started."""
        container = self.docker.containers.container(container_id)
        return await container.exec(argv, stdout=True, stderr=True, user=user)

    @daemon_call
    async def exec_start(self, stack: contextlib.AsyncExitStack, execution: Any) -> Any:
        """Start the exec, its output stream (aiodocker's Stream) entered on `stack`. Only the
        start is bounded: the daemon answers it under the container's lock, which a frozen exec
        may hold for good. The stream itself lasts as long as the action."""
        async with asyncio.timeout(self.call_timeout_s):  # aiodocker leaves a stream unbounded
            return await stack.enter_async_context(execution.start(detach=False))

    @daemon_call
    async def exec_inspect(self, execution: Any) -> ExecInspect:
        """Raise aiodocker.DockerError, or msgspec.ValidationError for a reply that does not fit."""
        return msgspec.convert(await execution.inspect(), type=ExecInspect)

    async def kill_newer(self, container_id: str, init_pid: int, before: set[tuple[int, int]]) -> int:
        """Freeze the container, SIGKILL every process of it not in `before`, thaw it; how many.
        Frozen, nothing can fork meanwhile; the kills land as it thaws."""
        await self.pause(container_id)
        try:
            newer = await asyncio.to_thread(started_by_the_action, init_pid, before, self.cgroups)
            for pid in newer:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            try:
                await self.unpause(container_id)
            except aiodocker.DockerError:  # once more: a frozen sandbox would hang every action
                await asyncio.sleep(0.2)
                await self.unpause(container_id)
        return len(newer)

    async def _wait_exec(
        self,
        execution: Any,
        reader: asyncio.Task[None],
        deadline: float,
        sweep_at: float,
        sweep: Callable[[], Awaitable[None]],
    ) -> ExecInspect:
        """Wait until the exec has ended (its stream closed, or the daemon says so); its inspect.
        Still running at `sweep_at` (monotonic), it is ended from the host, once, by `sweep`."""
        poll = 0.02
        swept = False
        while True:
            if not swept and time.monotonic() >= sweep_at:
                swept = True
                await sweep()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EnvironmentFailure("exec-stream", "the action's wrapper outlived its timeout")
            wake = remaining if swept else min(remaining, max(sweep_at - time.monotonic(), 0.0))
            done, _ = await asyncio.wait({reader}, timeout=min(poll, wake))
            try:
                info = await self.exec_inspect(execution)
            except aiodocker.DockerError as exc:
                raise EnvironmentFailure("daemon-error", f"exec inspect failed: {exc.message}") from None
            except msgspec.ValidationError as exc:
                raise EnvironmentFailure("daemon-error", f"exec inspect reply: {exc}") from None
            if not info.running:
                return info
            if done:  # stream closed but the daemon has not recorded the exit yet
                await asyncio.sleep(0.01)
                continue
            poll = min(poll * 2, 0.25)
