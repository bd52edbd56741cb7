"""A container's first process, run by the pod runner (tests/e2e/podrunner.py) inside the pod's network
namespace and in a mount and UTS namespace of the container's own: bind-mounts the pod's volumes at their
mountPaths, sets the hostname to the pod's name, then execs the container's command with its env.

    podinit.py PLAN.json   (PLAN: {"mounts": [[src, dst, read_only]], "hostname", "cwd", "argv", "env"})

Nothing here outlives the namespace: the mounts go when the container's last process exits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def main(plan_path: str) -> None:
    with open(plan_path) as f:
        plan = json.load(f)
    for src, dst, read_only in plan["mounts"]:
        subprocess.run(["mount", "--bind", src, dst], check=True)
        if read_only:
            subprocess.run(["mount", "-o", "remount,bind,ro", dst], check=True)
    socket.sethostname(plan["hostname"])
    os.chdir(plan["cwd"])
    try:
        os.execvpe(plan["argv"][0], plan["argv"], plan["env"])
    except OSError as exc:  # what a runtime reports as "executable file not found": exit 127 / 126
        print(f"podinit: cannot run {plan['argv'][0]!r}: {exc}", file=sys.stderr)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


if __name__ == "__main__":
    main(sys.argv[1])
