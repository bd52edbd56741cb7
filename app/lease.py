"""A lease on the experiment folder, so two runs with the same name never write it at once.

The lease is `<experiment>/.lease`, created with O_CREAT|O_EXCL (atomic on local disks and on NFSv3+) and
kept alive by a heartbeat thread that rewrites it every `timeout/4` seconds. A second run finds a live lease
and refuses (or waits, if configured). A lease whose heartbeat is older than the timeout belongs to a dead
run: it is renamed away (rename is atomic, so of two contenders exactly one wins) and taken over. A holder
whose lease was taken over stops the run at its next heartbeat rather than write beside the new holder.
Guarantee: at most one live holder, assuming the nodes' clocks agree to well within the timeout (NTP).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger("finetune")
LEASE = ".lease"


class LeaseHeld(Exception):
    def __init__(self, path: Path, holder: dict, age: float, timeout: float):
        self.path, self.holder, self.age, self.timeout = path, holder, age, timeout
        who = f"{holder.get('host', '?')} pid {holder.get('pid', '?')}"
        if holder.get("pod"):
            who += f" (pod {holder['pod']})"
        super().__init__(
            f"experiment folder {path.parent} is in use by {who}, started {holder.get('started', '?')}, last "
            f"heartbeat {age:.0f}s ago. Stop that run (or wait for it to end); if it died, its lease expires "
            f"{timeout:.0f}s after its last heartbeat and the next deploy takes over. "
            "Set experiment.on_conflict=wait to wait instead of failing."
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
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

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
            if age > self.timeout:
                stale = self.path.with_name(f"{LEASE}.stale-{uuid.uuid4().hex[:8]}")
                try:
                    os.rename(self.path, stale)
                except FileNotFoundError:
                    continue  # another contender took it over first
                log.warning(f"took over the lease of a run that stopped heart-beating {age:.0f}s ago: {holder}")
                stale.unlink(missing_ok=True)
                continue
            if not wait:
                raise LeaseHeld(self.path, holder, age, self.timeout)
            if not announced:
                log.warning(f"waiting for the lease held by {holder.get('host')} pid {holder.get('pid')}")
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
            json.dump({**self.info, "heartbeat": time.time()}, f)
        return True

    def read(self) -> tuple[dict | None, float]:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None, 0.0
        except (ValueError, OSError):
            # Torn or foreign content: judge it by the file's age alone.
            try:
                return {"host": "unknown (unreadable lease)"}, time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return None, 0.0
        return holder, time.time() - float(holder.get("heartbeat", 0))

    # -- holding -------------------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.timeout / 4):
            holder, _ = self.read()
            if not holder or holder.get("token") != self.token:
                self.on_lost(self, holder)
                return
            tmp = self.path.with_name(f"{LEASE}.{self.token}")
            tmp.write_text(json.dumps({**self.info, "heartbeat": time.time()}))
            os.replace(tmp, self.path)

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
