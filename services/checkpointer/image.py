"""Builds the test sandbox image without a registry: `docker import` of a tiny rootfs holding a
static busybox (Debian's busybox-static) and `memhold`, a static helper that keeps a given number
of MiB resident (the benchmarks' "process memory"). Its USER is 65534 (nobody), its WORKDIR /tmp.
Idempotent: an image with the same content label is reused.

    python -m belayer_rl.services.checkpointer.image [--name belayer-sandbox:test] [--docker URL]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import aiodocker
import msgspec
from yarl import URL

DEFAULT_IMAGE = "belayer-sandbox:test"
BUSYBOX_CANDIDATES = ("/bin/busybox", "/usr/bin/busybox")
LABEL_CONTENT = "belayer.content"  # the digest of the rootfs the image was imported from

# memhold MiB: touch MiB of private memory, then sleep forever (pages differ, so none is shared).
MEMHOLD_C = r"""
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    size_t n = (size_t)(argc > 1 ? atol(argv[1]) : 0) << 20;
    volatile unsigned char *p = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i += 512) p[i] = (unsigned char)(i * 2654435761u >> 13);
    for (;;) pause();
}
"""


class ImageLabels(msgspec.Struct, frozen=True, kw_only=True):
    """The one label read here; an image's other labels are ignored."""

    content: str = msgspec.field(name=LABEL_CONTENT, default="")


class ImageConfig(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    labels: ImageLabels | None = None  # the engine answers null for an image without labels


class LabelledImage(msgspec.Struct, frozen=True, kw_only=True, rename="pascal"):
    """GET /images/{name}/json, the fields that tell whether the image is the one built here."""

    id: str
    config: ImageConfig | None = None

    @property
    def content(self) -> str:
        """The content label; "" for an image not built here."""
        labels = self.config.labels if self.config is not None else None
        return labels.content if labels is not None else ""


def static_busybox() -> Path:
    for candidate in BUSYBOX_CANDIDATES:
        path = Path(candidate)
        if path.is_file():
            out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=False)
            if "not a dynamic executable" in out.stdout + out.stderr or out.returncode != 0:
                return path
    raise RuntimeError("no static busybox found: install Debian's busybox-static")


def build_memhold(workdir: Path) -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    source = workdir / "memhold.c"
    source.write_text(MEMHOLD_C)
    out = workdir / "memhold"
    result = subprocess.run(
        [cc, "-O1", "-static", "-o", str(out), str(source)], capture_output=True, check=False
    )
    return out if result.returncode == 0 else None


def rootfs_tar(busybox: Path, memhold: Path | None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def directory(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        for name in ("bin", "etc", "root", "home", "var", "run", "dev", "proc", "sys"):
            directory(name)
        directory("tmp", 0o1777)

        def fixed(info: tarfile.TarInfo) -> tarfile.TarInfo:  # the same bytes on every build
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            return info

        tar.add(busybox, "bin/busybox", filter=fixed)
        if memhold is not None:
            tar.add(memhold, "bin/memhold", filter=fixed)
        applets = subprocess.run(
            [str(busybox), "--list"], capture_output=True, text=True, check=True
        ).stdout.split()
        for applet in sorted(set(applets) - {"busybox", "memhold"}):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        passwd = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/tmp:/bin/sh\n"
        for name, text in (("etc/passwd", passwd), ("etc/group", "root:x:0:\nnogroup:x:65534:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def ensure_image(docker: aiodocker.Docker, name: str = DEFAULT_IMAGE) -> str:
    """Build the image unless it exists with the same content; return its id."""
    with tempfile.TemporaryDirectory() as tmp:
        body = rootfs_tar(static_busybox(), build_memhold(Path(tmp)))
    content = hashlib.sha256(body).hexdigest()[:16]
    try:
        existing = msgspec.convert(await docker.images.inspect(name), type=LabelledImage)
        if existing.content == content:
            return existing.id
    except aiodocker.DockerError:
        pass
    repo, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
    # Actions run as nobody (the checkpointer's idle init stays root: see its README), in /tmp.
    changes = [
        "CMD /bin/sh",
        "ENV PATH=/bin",
        "USER 65534",
        "WORKDIR /tmp",
        f"LABEL {LABEL_CONTENT}={content}",
    ]
    query = [("fromSrc", "-"), ("repo", repo), ("tag", tag), *(("changes", c) for c in changes)]
    async with docker._query(
        URL("images/create").with_query(query),
        method="POST",
        data=body,
        headers={"Content-Type": "application/x-tar"},
    ) as response:
        await response.read()
    return msgspec.convert(await docker.images.inspect(name), type=LabelledImage).id


async def _main(name: str, url: str | None) -> None:
    docker = aiodocker.Docker(url=url)
    try:
        print(name, await ensure_image(docker, name))
    finally:
        await docker.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="belayer-sandbox-image", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=DEFAULT_IMAGE)
    parser.add_argument("--docker", help="Docker Engine URL (default: $DOCKER_HOST or the local socket)")
    args = parser.parse_args()
    asyncio.run(_main(args.name, args.docker))


if __name__ == "__main__":
    main()
