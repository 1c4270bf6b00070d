"""Is a Docker engine reachable? A synchronous `/_ping`, for `belayer up` deciding whether to start
a checkpointer. Knows nothing else."""

from __future__ import annotations

import os
import socket

DEFAULT_DOCKER = "unix:///var/run/docker.sock"


def docker_unreachable(url: str | None = None, timeout_s: float = 1.0) -> str | None:
    """None when the engine at `url` ($DOCKER_HOST, else the default socket) answers its ping;
    otherwise a sentence saying why not."""
    url = url or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER
    address: str | tuple[str, int]
    if url.startswith("unix://"):
        family, address = socket.AF_UNIX, url[len("unix://") :]
    elif url.startswith(("tcp://", "http://")):
        host, _, port = url.split("://", 1)[1].rstrip("/").partition(":")
        family, address = socket.AF_INET, (host, int(port or 2375))
    else:
        return f"unsupported Docker URL {url!r}"
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(address)
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status = s.recv(256).split(b"\r\n", 1)[0]
    except OSError as exc:
        return f"no Docker engine at {url}: {exc}"
    if b" 200" not in status:
        return f"Docker engine at {url} answered {status.decode(errors='replace')!r}"
    return None
