"""Preemption: when a run is asked to stop (a node drain, a spot reclaim, Kueue evicting it), every rank finishes
the optimizer step in flight, the run writes one checkpoint of that step, releases its lease and exits
`Exit.PREEMPTED` (4); the next deploy resumes at the next step with nothing redone.

How a run is asked; all three end in the same notice:
- SIGTERM to a rank (a Ray worker process). Ray's own handler would exit the worker at once; `RankWatch` routes
  the first SIGTERM to the notice instead. A second one exits as before: the resume then falls back to the last
  complete checkpoint, never a partial one.
- SIGTERM to the driver (`finetune train`): `on_driver_sigterm` writes the notice file `<experiment>/.preempt`
  on the shared volume, which every rank looks at.
- On Kubernetes, the pod's preStop hook, `finetune preempt <experiment folder> --wait S` (set by the chart: the
  kubelet runs it before its SIGTERM, within terminationGracePeriodSeconds; a pod's PID 1 would ignore the
  SIGTERM itself), writes the same file and waits until the run has let go of its lease.

The notice carries the lease token of the run it is for, so that a notice left behind never stops a later run.
After every optimizer step each rank looks at its flag and the file, and the ranks agree through one MAX
all-reduce of a CPU tensor (on a gloo group: no GPU synchronisation), so that all of them save the same step and
stop together. The same all-reduce carries each rank's background checkpoint write state (`checkpoint.Saver`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from app.exit_codes import Exit

log = logging.getLogger("finetune")
NOTICE = ".preempt"
GRACE_ENV = "FINETUNE_GRACE_PERIOD_S"  # the pods' terminationGracePeriodSeconds, set by the chart

_requested = threading.Event()  # this process got its first SIGTERM
_loop_thread: threading.Thread | None = None  # the training loop's thread: SIGTERMs are routed while it runs


def notice_path(run_dir: Path) -> Path:
    return Path(run_dir) / NOTICE


def write_notice(run_dir: Path, token: str | None, by: str) -> Path:
    """Ask the run holding `token` (None: whichever holds the lease now) to stop after the step in flight."""
    path = notice_path(run_dir)
    tmp = path.with_name(f"{NOTICE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"token": token, "by": by, "at": time.time()}))
    os.replace(tmp, path)
    return path


def clear(run_dir: Path) -> None:
    """A new run starts without an old notice (the driver calls this once it holds the lease)."""
    notice_path(run_dir).unlink(missing_ok=True)


def notice_for(run_dir: Path, token: str | None) -> bool:
    """Whether the notice file asks the run holding `token` to stop."""
    try:
        notice = json.loads(notice_path(run_dir).read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # torn or foreign: stopping with a checkpoint is the safe reading
    return not isinstance(notice, dict) or notice.get("token") in (None, token)


class RankWatch:
    """Every rank: routes this worker's first SIGTERM to the notice, and `agreed()` after each optimizer step."""

    def __init__(self, run_dir: Path, token: str | None, world: int, gpu: bool):
        import torch
        import torch.distributed as dist

        self.run_dir, self.token = Path(run_dir), token
        self.world = world
        # On GPUs the default group is NCCL; the flag goes through a CPU (gloo) group so that asking costs no sync.
        self.group = dist.new_group(backend="gloo") if gpu and world > 1 else None
        self.flag = torch.zeros(2, dtype=torch.int32)
        global _loop_thread
        _loop_thread = threading.current_thread()
        _route_worker_sigterm()

    def agreed(self, writes: int = 0) -> tuple[bool, int]:
        """(whether any rank was asked to stop, the highest `writes` of any rank: the state of each rank's
        background checkpoint write, `checkpoint.Saver.status`). A collective: all ranks call it after each step."""
        import torch.distributed as dist

        mine = _requested.is_set() or notice_for(self.run_dir, self.token)
        if self.world == 1 or not dist.is_initialized():
            return mine, writes
        self.flag[0], self.flag[1] = int(mine), writes
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(self.flag[0]), int(self.flag[1])


def _route_worker_sigterm() -> None:
    """In a Ray worker, Ray's SIGTERM handler (installed in the main thread, which the training loop does not run
    in) calls `ray._private.worker.raise_sys_exit_with_custom_error_message`; the first call of a SIGTERM while the
    training loop runs becomes this process's preemption request instead. Once the loop has ended (returned or
    failed) Ray's SIGTERMs stop the worker as before. Checked against the pinned Ray in tests/test_preemption.py."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return
    original = ray_worker.raise_sys_exit_with_custom_error_message
    if getattr(original, "_finetune_preemption", False):
        return

    def first_sigterm_preempts(message: str, exit_code: int = 1):
        training = _loop_thread is not None and _loop_thread.is_alive()
        if "SIGTERM" in message and training and not _requested.is_set():
            _requested.set()
            log.warning(
                "SIGTERM: this rank finishes the step in flight, then the run saves a checkpoint and stops "
                "(a second SIGTERM stops this rank at once)"
            )
            return None
        return original(message, exit_code)

    first_sigterm_preempts._finetune_preemption = True
    ray_worker.raise_sys_exit_with_custom_error_message = first_sigterm_preempts


def request_in_this_process() -> None:
    """What the first SIGTERM does in a rank (the fault drill sends a real one; see app/faults.py)."""
    _requested.set()


def requested_in_this_process() -> bool:
    return _requested.is_set()


def on_driver_sigterm(run_dir: Path, token: str) -> None:
    """The driver's first SIGTERM writes the notice for its own run; a second one does what the handler before
    it did (Ray's: exit). Only from the main thread (Python's rule for signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        if not notice_for(run_dir, token):
            write_notice(run_dir, token, f"SIGTERM to the driver (pid {os.getpid()} on {socket.gethostname()})")
            log.warning(
                "SIGTERM: every rank finishes the step in flight, then the run saves a checkpoint and stops "
                "(a second SIGTERM stops at once)"
            )
            return
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(Exit.TERMINATED)  # the handler is SIGTERM's alone

    signal.signal(signal.SIGTERM, handler)


def grace_note(save_s: float) -> tuple[bool, str] | None:
    """(fits, sentence) about the first checkpoint's save time against the grace period the pods get
    (FINETUNE_GRACE_PERIOD_S), or None where no grace period is known (not on Kubernetes)."""
    try:
        grace = float(os.environ.get(GRACE_ENV, ""))
    except ValueError:
        return None
    # The step in flight must end too, and the hook needs a moment: half the grace period for the write.
    if save_s <= grace / 2:
        return True, (
            f"the first checkpoint took {seconds(save_s)} to write: it fits in the pods' {grace:.0f} s grace "
            "period, so a preempted run saves its last step"
        )
    return False, (
        f"the first checkpoint took {seconds(save_s)} to write, more than half the pods' {grace:.0f} s grace "
        "period: a preempted run may be killed before its checkpoint is complete (it then resumes from "
        f"the last periodic one). Set preemption.gracePeriodSeconds to at least {4 * save_s:.0f}"
    )


def seconds(s: float) -> str:
    """A save time as a person reads it: 0.04 s, 9.50 s, 112 s."""
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def wait_for_release(
    run_dir: Path, token: str | None, timeout_s: float, poll_s: float = 1.0, gone_every_s: float = 10.0
) -> str | None:
    """Until the run holding `token` has let go of the experiment's lease (it saved and stopped): "released"; or
    until it is certainly dead without letting go (the lease's own rule: no heartbeat within its timeout, or its
    process or RayJob gone, looked at every `gone_every_s`): why. None when it still holds the lease after
    `timeout_s`. Waiting out the grace period for a dead run would only keep its pod (and GPUs) terminating:
    deleting a RayJob stops its driver within seconds, and KubeRay deletes the pods after that."""
    from app.lease import Lease

    lease = Lease(run_dir, 0)  # read-only: the holder's own timeout decides staleness
    deadline = time.monotonic() + timeout_s
    look_gone = time.monotonic()
    while True:
        holder, age = lease.read()
        if not holder or holder.get("token") != token:
            return "released"
        if time.monotonic() >= look_gone:
            if why := lease.stale(holder, age):
                return why
            look_gone = time.monotonic() + gone_every_s
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)
