"""`python -m belayer_rl.services.trainer_group.fork_server`: the local backend's warm start.

Starting a rank cold costs a Python start and the import of torch: about 3 CPU-seconds, and a
rebuild starts three ranks at once (two actor ranks and the reference). This process pays that
once per trainer. It imports torch and the rank code, says ForkServerReady, then forks a rank
for each ForkRank it reads; the child runs the same `main` a cold rank runs, so a forked rank
and a cold one differ only in how they started.

Owns: the ranks it forked, which are its children: it reaps them and reports each exit.
Listens: ForkRank on stdin (shared/protocol.py's fork-server pipe).
Publishes: ForkServerReady, then RankForked or ForkRefused per ForkRank, and RankExited, on stdout.

Each rank gets a session of its own (its pid is its process group, as a cold rank's is), and the
kernel SIGKILLs it when this server dies, as this server is SIGKILLed when the trainer dies. The
server starts no threads of its own and no event loop, so a fork copies nothing half-held but what
torch's import left (a BLAS pool, which handles fork itself, as DataLoader workers rely on).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from belayer_rl.services.trainer_group import service as _preloaded  # noqa: F401  (torch, before any fork)
from belayer_rl.services.trainer_group.declaration import TRAINER_GROUP
from belayer_rl.shared.declaration import main as service_main
from belayer_rl.shared.processes import dies_with_parent
from belayer_rl.shared.protocol import (
    BadMessage,
    ForkRank,
    ForkRefused,
    ForkServerReady,
    Message,
    RankExited,
    RankForked,
    decode,
    decoder_for,
    encode,
)

log = logging.getLogger("belayer.trainer.fork_server")

COMMANDS = decoder_for(ForkRank)
MAX_LINE_BYTES = 1 << 20


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fork-server %(levelname)s %(message)s")
    wake_read, wake_write = os.pipe()  # SIGCHLD wakes the select through it
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    report(ForkServerReady(pid=os.getpid()))
    pending = b""
    while True:
        ready, _, _ = select.select([sys.stdin.fileno(), wake_read], [], [])
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 4096):
                        break
                except BlockingIOError:
                    break
        reap()
        if sys.stdin.fileno() not in ready:
            continue
        data = os.read(sys.stdin.fileno(), 65536)
        if not data:  # the trainer is gone or closed us: our ranks die with us
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LINE_BYTES:
            log.warning("dropped an unterminated line of over %d bytes", MAX_LINE_BYTES)
            pending = b""
        for line in lines:
            if line.strip():
                fork_one(line, (wake_read, wake_write))


def fork_one(line: bytes, own_fds: tuple[int, int]) -> None:
    try:
        command = decode(COMMANDS, line)
    except BadMessage as exc:
        # A stray line is not a command: say so, and the next spawn still pairs with its answer.
        log.warning("not a ForkRank: %s", exc)
        report(ForkRefused(why=f"not a ForkRank: {exc}"))
        return
    child_setup = dies_with_parent(signal.SIGKILL)  # the parent it names is this server
    set_up_read, set_up_write = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(set_up_read)
        os.close(set_up_write)
        report(ForkRefused(why=f"fork failed: {exc}"))
        return
    if pid == 0:
        os.close(set_up_read)
        become_rank(command, child_setup, (*own_fds, set_up_write))
    os.close(set_up_write)
    # EOF once the child has its own session and dies with this server (or has died): only then
    # may the trainer kill it by its process group, and count on its death with the server.
    os.read(set_up_read, 1)
    os.close(set_up_read)
    report(RankForked(pid=pid))


def become_rank(command: ForkRank, child_setup: Callable[[], None], own_fds: tuple[int, ...]) -> NoReturn:
    """In the child: a session of its own, death with the server, the log as stdout and stderr,
    then the rank's `main`. Never returns into the server's loop. Closing `own_fds` (the last is
    the set-up pipe) tells the server the first two are done."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        child_setup()
        for fd in own_fds:
            os.close(fd)
        out = os.open(command.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(devnull)
        logging.getLogger().handlers.clear()  # the rank's runtime sets up its own, on the log
        sys.argv = ["belayer-trainer-group", *command.argv]
        service_main(TRAINER_GROUP, command.argv)
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        report(RankExited(pid=pid, returncode=os.waitstatus_to_exitcode(status)))


def report(message: Message) -> None:
    line = memoryview(encode(message) + b"\n")
    while line:
        line = line[os.write(sys.stdout.fileno(), line) :]


if __name__ == "__main__":
    main()
