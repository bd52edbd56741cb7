"""Where a driver's seconds went, from the py-spy stacks the harness records (BENCH_PROFILE_DRIVER in
benchmarks/runner.py): the main thread's samples summed by their path through the app's own functions (and the
harness's), down to the first call outside them (an import is named by its package), stacks under `--until` (default
start_ray: Ray's own start) summed apart. `--through F` (a record taken with BENCH_PROFILE_SUBPROCESSES=1) sums the
samples of any process and thread whose stack passes through F instead, e.g. train_loop.train_loop (a training
worker's loop) or trl_peer.train (the TRL peer's worker).

    python -m benchmarks.driver_profile LOG.driver-stacks.txt [--rate 100] [--depth 9] [--most 14] [--through F]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

FRAME = re.compile(r"(.*) \((.*):(\d+)\)")
OWN = ("app/", "benchmarks/")  # the code whose functions a path names
MODULE = re.compile(r"<module> \((.*):\d+\)")


def call_path(frames: list[str], depth: int, until: str) -> tuple[str, ...]:
    """The app's functions (module.function) a sample passes through, then the first frame outside the app."""
    names: list[str] = []
    for at, frame in enumerate(frames):
        found = FRAME.match(frame)
        if not found:
            continue
        function, path, _ = found.groups()
        if path.startswith(OWN):
            names.append(f"{path.split('/')[-1].removesuffix('.py')}.{function}")
        elif names:
            if "importlib" in path:
                modules = [m.group(1) for m in map(MODULE.match, frames[at:]) if m]
                names.append("import " + (modules[0].split("/")[0] if modules else "?"))
            else:
                names.append(f"{path.split('/')[0]}:{function}")
            break
    if any(until in name for name in names):
        return (f"in {until}",)
    return tuple(names[:depth])


def chosen(frames: list[str], through: str | None) -> list[str] | None:
    """The sample's frames (without py-spy's leading process frames) where it is one to sum: the main thread of the
    process py-spy attached to, or with `through`, any stack that passes through that function (module.function)."""
    processes = 0
    while processes < len(frames) and frames[processes].startswith("process "):
        processes += 1
    frames = frames[processes:]
    if through is None:
        return frames if processes <= 1 and frames and frames[0].startswith("_run_module_as_main") else None
    module, _, function = through.rpartition(".")
    for frame in frames:
        found = FRAME.match(frame)
        if found and found.group(1) == function and found.group(2).endswith(f"/{module}.py"):
            return frames
    return None


def summary(
    lines, rate: float, depth: int, until: str, through: str | None = None
) -> tuple[collections.Counter, float]:
    paths: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        frames = chosen(stack.split(";"), through)
        if frames is None or not count.isdigit():
            continue  # another thread's or process's sample, or not a sample line
        paths[call_path(frames, depth, until)] += int(count)
        total += int(count)
    return paths, total / rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stacks", help="py-spy's raw output (record -f raw)")
    p.add_argument("--rate", type=float, default=100, help="samples a second it was recorded at (default 100)")
    p.add_argument("--depth", type=int, default=9, help="app frames a path keeps (default 9)")
    p.add_argument("--until", default="start_ray", help="a function whose samples are summed apart (default start_ray)")
    p.add_argument("--most", type=int, default=14, help="paths shown (default 14)")
    p.add_argument("--through", help="sum the stacks of any process passing through this module.function instead")
    args = p.parse_args(argv)
    with open(args.stacks) as f:
        paths, seconds = summary(f, args.rate, args.depth, args.until, args.through)
    for path, count in paths.most_common(args.most):
        print(f"{count / args.rate:7.2f}s  {' > '.join(path)}")
    print(f"{seconds:7.2f}s  {'the main thread' if args.through is None else 'stacks through ' + args.through} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
