"""A lease on the experiment folder, so two runs with the same name never write it at once.

The lease is `<experiment>/.lease`, created with O_CREAT|O_EXCL (atomic on local disks and on NFSv3+),
holding who took it, and kept alive by a heartbeat thread that touches its modification time every
`timeout/4` seconds (after checking that the file still carries this holder's token; a touch never rewrites
the content, so a holder can never overwrite another's lease). A second run finds a live lease and refuses
(or waits, if configured). A lease untouched for longer than the timeout belongs to a dead run: a contender
takes it over under a second create-exclusive file, `.lease.takeover`, so that of several contenders exactly
one removes the stale lease and creates its own; the others find the new live lease. A holder that finds
its lease gone or replaced stops the run at once rather than write beside the new holder.

Guarantee: at most one live holder, provided the clocks of the nodes and the file server agree to well
within the timeout (NTP), and a holder is not frozen (SIGSTOP, a VM pause) for longer than the timeout; a
frozen holder that wakes up stops at its next heartbeat, within timeout/4.
"""
from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger("finetune")
LEASE = ".lease"
TAKEOVER = ".lease.takeover"


class LeaseHeld(Exception):
    def __init__(self, path: Path, holder: dict, age: float, timeout: float):
        self.path, self.holder, self.age, self.timeout = path, holder, age, timeout
        who = f"{holder.get('host', '?')} pid {holder.get('pid', '?')}"
        if holder.get("pod"):
            who += f" (pod {holder['pod']})"
        super().__init__(
            f"experiment folder {path.parent} is in use by {who}, started {holder.get('started', '?')}, last "
            f"heartbeat {age:.0f}s ago. Stop that run (or wait for it to end); if it died, its lease expires "
            f"{timeout:.0f}s after its last heartbeat and the next deploy takes over (to take over at once, delete "
            f"{path}, but only when that run is certainly gone). Set experiment.on_conflict=wait to wait instead "
            "of failing."
        )


class Lease:
    def __init__(self, run_dir: Path, timeout_s: float, on_lost=None):
        self.path = Path(run_dir) / LEASE
        self.timeout = timeout_s
        self.token = uuid.uuid4().hex
        self.on_lost = on_lost or _exit_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                     "pod": os.environ.get("HOSTNAME") if os.environ.get("KUBERNETES_SERVICE_HOST") else None,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "timeout_s": timeout_s}

    # -- acquiring -----------------------------------------------------------------------------------------
    def acquire(self, wait: bool = False, poll_s: float = 5.0) -> Lease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        announced = False
        while True:
            if self._try_create():
                break
            holder, age = self.read()
            if holder is None:
                continue  # released or being replaced between our two calls: try again
            if age > self._limit(holder):
                if self._take_over():
                    break
                continue
            if not wait:
                raise LeaseHeld(self.path, holder, age, self._limit(holder))
            if not announced:
                log.warning(f"waiting for the lease on {self.path.parent} held by {holder.get('host')} pid "
                            f"{holder.get('pid')} (last heartbeat {age:.0f}s ago)")
                announced = True
            time.sleep(poll_s)
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.info, f)
        return True

    def _take_over(self) -> bool:
        """Replace a stale lease; of several contenders at once, exactly one gets here and wins."""
        lock = self.path.with_name(TAKEOVER)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:  # a contender that died in the middle of a takeover leaves the lock: it expires too
                if time.time() - lock.stat().st_mtime > self.timeout:
                    lock.unlink()
            except FileNotFoundError:
                pass
            time.sleep(0.02 + random.random() * 0.05)
            return False
        try:
            holder, age = self.read()  # judged again under the lock: it may have been taken over already
            if holder is not None and age > self._limit(holder):
                self.path.unlink(missing_ok=True)
                log.warning(f"took over the lease of a run that stopped heart-beating {age:.0f}s ago: {holder}")
            return self._try_create()
        finally:
            lock.unlink(missing_ok=True)

    def _limit(self, holder: dict) -> float:
        """A lease is stale after the longer of the two runs' timeouts: a contender configured with a short
        timeout must not take a lease from a live holder that beats at the pace of a longer one."""
        try:
            theirs = float(holder.get("timeout_s") or 0)
        except (TypeError, ValueError):
            theirs = 0.0
        return max(self.timeout, theirs)

    def read(self) -> tuple[dict | None, float]:
        """(holder, seconds since its last heartbeat), or (None, 0) when there is no lease."""
        try:
            # Open, then stat the open file: on NFS, opening revalidates the cached attributes.
            with open(self.path) as f:
                text, mtime = f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None, 0.0
        age = time.time() - mtime
        try:
            holder = json.loads(text)
            if not isinstance(holder, dict):
                raise ValueError("not a mapping")
        except ValueError:
            # Torn or foreign content: judged by the file's age alone.
            holder = {"host": "unknown (unreadable lease)"}
        return holder, age

    # -- holding -------------------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.timeout / 4):
            holder, _ = self.read()
            if not holder or holder.get("token") != self.token:
                self.on_lost(self, holder)
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.on_lost(self, None)
                return
            except OSError as exc:  # e.g. the volume went read-only: the run will fail on its own writes
                log.warning(f"lease heartbeat on {self.path} failed: {exc}")

    def release(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        holder, _ = self.read()
        if holder and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _exit_lost(lease: Lease, holder: dict | None) -> None:
    log.error(f"lost the lease on {lease.path.parent} (now held by {holder}); stopping so that two runs never "
              "write the same experiment folder")
    os._exit(3)
