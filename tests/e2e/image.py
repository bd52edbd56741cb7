"""The project's image as `make image` builds it (tools/image/build.sh): the build's record, and containers of
the built image (or of its stand-in base) to run commands in with buildah, as a given user."""

from __future__ import annotations

import os
import subprocess

from e2e.controlplane import REPO

BUILD = REPO / "tools" / "image" / "build.sh"
REGISTRY = REPO / "tools" / "image" / "registry.sh"


class ImageError(RuntimeError):
    pass


def build(timeout: float = 3600) -> dict[str, str]:
    """Runs the build script (a cache hit prints its record in seconds); the NAME=VALUE lines it prints:
    IMAGE (in the local registry), IMAGE_DIGEST, IMAGE_LOCAL, BASE_LOCAL, CONTAINERS_STORAGE_CONF, ..."""
    out = subprocess.run(["bash", str(BUILD)], stdout=subprocess.PIPE, text=True, timeout=timeout)
    if out.returncode:
        raise ImageError("building the image failed (tools/image/build.sh, output above)")
    return dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)


def registry(action: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`registry.sh start` (REGISTRY=127.0.0.1:PORT, REGISTRY_STARTED=1|0) or `registry.sh stop`."""
    out = subprocess.run(
        ["bash", str(REGISTRY), action],
        stdout=subprocess.PIPE,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    if out.returncode:
        raise ImageError(f"registry.sh {action} failed (output above)")
    return dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)


def buildah(storage_conf: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """buildah ARGS on the build's storage (CONTAINERS_STORAGE_CONF of the build's record)."""
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": storage_conf}
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode:
        raise ImageError(f"buildah {' '.join(args)} -> {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


class Container:
    """A buildah working container of IMAGE (from the build's storage), removed on exit."""

    def __init__(self, image: str, storage_conf: str):
        self.image = image
        self.storage_conf = storage_conf
        self.id = ""

    def __enter__(self) -> Container:
        self.id = buildah(self.storage_conf, "from", "--pull=never", "--quiet", self.image).stdout.strip()
        return self

    def __exit__(self, *exc) -> None:
        if self.id:
            buildah(self.storage_conf, "rm", self.id)

    def run(self, *cmd: str, user: str = "1000:100", check: bool = True, timeout: float = 300):
        """cmd in the container as `user` (chroot isolation, the image's environment and working directory)."""
        return buildah(
            self.storage_conf,
            "run",
            "--isolation",
            "chroot",
            "--user",
            user,
            self.id,
            "--",
            *cmd,
            check=check,
            timeout=timeout,
        )
