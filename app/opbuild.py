"""DeepSpeed's C++ ops that are compiled at first use (torch's just-in-time extension builder): say so before
the build starts, and never let a build lock left by a killed build block a start forever.

torch serialises builds with a `lock` file in the op's build folder and waits, without a limit, while it
exists; a build killed mid-way leaves it behind, and every later start on that machine then hangs.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("finetune")

# When no process can be seen holding the lock: no file of the build folder changed for this long means the
# build that holds it is dead (or hung). A compile step on 2 busy cores takes at most a few minutes.
STALE_AFTER_S = 600.0
POLL_S = 2.0


class JitOp(NamedTuple):
    what: str
    first_build: str  # on 2 CPU cores (measured: 60-100 s for the shm op)
    builder: str  # DeepSpeed's op builder class


JIT_OPS = {
    "deepspeed_shm_comm": JitOp(
        "DeepSpeed's shared-memory collectives for CPU workers", "1-2 min", "ShareMemCommBuilder"
    ),
    "cpu_adam": JitOp("DeepSpeed's CPU Adam for the offloaded optimizer", "1-3 min", "CPUAdamBuilder"),
}


def build_folder(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def needed(cpu_workers: bool, offloaded_optimizer: bool) -> list[str]:
    """The JIT-built ops this run will load: CPU collectives on CPU workers, CPU Adam with offload."""
    names = (["deepspeed_shm_comm"] if cpu_workers else []) + (["cpu_adam"] if offloaded_optimizer else [])
    try:
        from deepspeed.git_version_info import (
            installed_ops,  # ops compiled into the wheel (the image's)
        )
    except ImportError:
        installed_ops = {}
    return [n for n in names if not installed_ops.get(n)]


def _last_activity(folder: Path) -> float:
    times = [p.stat().st_mtime for p in folder.iterdir() if p.is_file()]
    return max(times, default=0.0)


def held_open(lock: Path) -> bool | None:
    """Does a live process hold `lock` open? torch keeps the lock's file descriptor open for the whole build, so
    a lock that no process holds was left by a dead one. None when that cannot be known (no /proc, or processes
    of other users whose descriptors cannot be read)."""
    target, unknown = str(lock), False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue  # the process ended meanwhile
        except PermissionError:
            unknown = True
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
    return None if unknown else False


def clear_stale_lock(
    folder: Path, stale_after_s: float = STALE_AFTER_S, poll_s: float = POLL_S, announce: bool = True
) -> str | None:
    """Waits while another process builds in `folder`; moves the lock aside (kept, renamed, for inspection) as
    soon as no process holds it open, or, when that cannot be known, after `stale_after_s` without a change in
    the folder. Returns what it did, or None when there was no lock or it went away."""
    lock = folder / "lock"
    said = False
    while True:
        try:
            judged = lock.stat().st_ino  # the lock file this pass judges; another may take its place meanwhile
            idle = time.time() - _last_activity(folder)
        except FileNotFoundError:
            return None
        holder = held_open(lock)
        if holder is False or idle >= stale_after_s:
            why = "no process holds it" if holder is False else f"nothing in {folder} changed for {idle / 60:.0f} min"
            aside = lock.with_name(f"lock.stale-{int(time.time())}-{os.getpid()}")
            if _move_aside(lock, aside, judged):
                return f"moved aside a stale build lock {lock} ({why}: a killed build left it); kept as {aside.name}"
            continue  # it went away or changed hands while it was judged: judge what is there now
        if announce and not said:
            said = True
            log.warning(
                f"waiting for another process's build in {folder} (lock {lock}); at most "
                f"{(stale_after_s - idle) / 60:.0f} min more if it stops changing"
            )
        time.sleep(min(poll_s, stale_after_s - idle))


def _move_aside(lock: Path, aside: Path, judged: int) -> bool:
    """Renames `lock` to `aside` if it is still the file (inode `judged`) found stale. Another rank may have moved
    that one aside first and taken a fresh lock for its own build or load (torch takes the lock even to find an op
    up to date): moving that live lock would make its holder's release fail (FileNotFoundError, seen in a CI run),
    so it is put back."""
    try:
        os.replace(lock, aside)
    except FileNotFoundError:
        return False  # another rank moved it, or the build finished
    if aside.stat().st_ino == judged:
        return True
    try:
        os.link(aside, lock)  # the live lock back where its holder will remove it
    except FileExistsError:
        pass  # a third process took the lock meanwhile: it is free to, as the path was empty
    aside.unlink(missing_ok=True)
    return False


def use_this_environments_ninja() -> None:
    """torch builds with the first `ninja` on PATH. This environment's own (pip's `ninja`, a DeepSpeed
    dependency) goes first: builds then need no system ninja, and two ninja versions never take turns on one
    build folder (each reads the other's .ninja_log as 'command line changed' and rebuilds the op, 1-2 min,
    at every start: seen here with /usr/bin/ninja 1.11 and the venv's 1.13)."""
    bin_dir = Path(sys.executable).parent
    if (bin_dir / "ninja").exists() and shutil.which("ninja") != str(bin_dir / "ninja"):
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def prepare(cpu_workers: bool, offloaded_optimizer: bool, announce: bool) -> None:
    """Before DeepSpeed starts: this environment's ninja first on PATH, stale locks of the ops it will build or
    load cleared, and (on rank 0) a line when a first-time build is about to run and how long it takes."""
    use_this_environments_ninja()
    for name in needed(cpu_workers, offloaded_optimizer):
        folder = build_folder(name)
        if folder.is_dir():
            moved = clear_stale_lock(folder, announce=announce)
            if moved:
                log.warning(moved)
        if announce and not (folder / f"{name}.so").exists():
            op = JIT_OPS[name]
            log.info(f"building {op.what} (about {op.first_build}): once per machine, cached in {folder.parent}")


def build(name: str) -> Path:
    """Compiles op `name` into torch's extension cache now (what DeepSpeed would do at a run's first use);
    returns its build folder. Loading an op that is up to date only checks it."""
    from deepspeed.accelerator import get_accelerator

    use_this_environments_ninja()
    folder = build_folder(name)
    if folder.is_dir():
        clear_stale_lock(folder)
    get_accelerator().create_op_builder(JIT_OPS[name].builder).load(verbose=False)
    return folder


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m app.opbuild",
        description="Build DeepSpeed's just-in-time ops into torch's extension cache ahead of the first run "
        "(make setup builds the CPU workers' collectives), so no run waits for a compiler.",
    )
    parser.add_argument(
        "ops",
        nargs="*",
        default=None,
        metavar="OP",
        help=f"ops to build, of {', '.join(sorted(JIT_OPS))} (default: deepspeed_shm_comm)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.ops if name not in JIT_OPS]
    if unknown:
        parser.error(f"unknown op {unknown[0]!r}; the ops are {', '.join(sorted(JIT_OPS))}")
    logging.basicConfig(level=logging.ERROR)
    for name in args.ops or ["deepspeed_shm_comm"]:
        started = time.perf_counter()
        folder = build(name)
        print(f"{JIT_OPS[name].what}: ready in {folder} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
