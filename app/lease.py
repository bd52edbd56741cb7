"""A lease on the experiment folder, so two runs with the same name never write it at once.

The lease is `<experiment>/.lease`, created with O_CREAT|O_EXCL (atomic on local disks and on NFSv3+),
holding who took it, and kept alive by a heartbeat thread that touches its modification time every
`timeout/4` seconds (after checking that the file still carries this holder's token; a touch never rewrites
the content, so a holder can never overwrite another's lease). A second run finds a live lease and refuses
(or waits, if configured). A lease untouched for longer than the timeout belongs to a dead run: a contender
takes it over under a second create-exclusive file, `.lease.takeover`, so that of several contenders exactly
one removes the stale lease and creates its own; the others find the new live lease. A holder that finds
its lease gone or replaced stops the run at once rather than write beside the new holder.

A contender also takes over at once, without waiting for the timeout, when the holder is provably gone: it ran
on this host (same hostname, boot and pid namespace) and its process has ended (or its pid now belongs to a
process started later), or, on KubeRay, the RayJob it ran under no longer exists (deleted, or replaced by a new
object of the same name: a redeploy). That needs only `get` of the experiment's own RayJob, by name, which the
chart grants. Where it cannot be proven (another host, no API access), only the timeout decides; the late
workers of a run taken over this way cannot complete a checkpoint (they check the token first, `holds`).

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

from app.exit_codes import Exit

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
        in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        self.info = {
            "token": self.token,
            **_identity(os.getpid()),
            "pod": os.environ.get("HOSTNAME") if in_pod else None,
            "namespace": _pod_namespace() if in_pod else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "timeout_s": timeout_s,
        }

    # -- acquiring -----------------------------------------------------------------------------------------
    def acquire(self, wait: bool = False, poll_s: float = 5.0) -> Lease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.info["rayjob"] = own_rayjob()
        announced = False
        while True:
            if self._try_create():
                break
            holder, age = self.read()
            if holder is None:
                continue  # released or being replaced between our two calls: try again
            if self.stale(holder, age):
                if self._take_over():
                    break
                continue
            if not wait:
                raise LeaseHeld(self.path, holder, age, self._limit(holder))
            if not announced:
                log.warning(
                    f"waiting for the lease on {self.path.parent} held by {holder.get('host')} pid "
                    f"{holder.get('pid')} (last heartbeat {age:.0f}s ago)"
                )
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
            why = self.stale(holder, age) if holder is not None else None
            if why:
                self.path.unlink(missing_ok=True)
                log.warning(f"took over the lease of a run that {why}: {holder}")
            return self._try_create()
        finally:
            lock.unlink(missing_ok=True)

    def stale(self, holder: dict, age: float) -> str | None:
        """Why the holder no longer holds the lease, or None while it may still be alive."""
        if age > self._limit(holder):
            return f"stopped heart-beating {age:.0f}s ago"
        return holder_gone(holder)

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


def holds(run_dir: Path, token: str | None) -> bool:
    """Whether the lease on `run_dir` still carries `token` (the workers' check before they complete a
    checkpoint: a dead run's late workers must not add one after a takeover). No token: not under a lease."""
    if token is None:
        return True
    holder, _ = Lease(run_dir, 0).read()
    return bool(holder) and holder.get("token") == token


def _exit_lost(lease: Lease, holder: dict | None) -> None:
    log.error(
        f"lost the lease on {lease.path.parent} (now held by {holder}); stopping so that two runs never "
        "write the same experiment folder"
    )
    os._exit(Exit.LEASE_HELD)


# --- is the holder provably gone? ----------------------------------------------------------------------------


def _identity(pid: int) -> dict:
    """Where a process runs: with the same host, boot and pid namespace, its pid can be looked up here."""
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _link("/proc/self/ns/pid"),
        "pid_start": _process(pid)[1] if _process(pid) else None,
    }


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _process(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks after boot) of a live process, or None when there is none."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)", which may hold spaces
    return fields[0], fields[19]


def _pod_namespace() -> str | None:
    from app.kube import SA_NAMESPACE_FILE

    return _read(SA_NAMESPACE_FILE) or os.environ.get("FINETUNE_RAYJOB_NAMESPACE")


def holder_gone(holder: dict) -> str | None:
    """Why the lease's holder is certainly gone, or None when that cannot be proven."""
    here = _identity(os.getpid())
    pid = holder.get("pid")
    same_machine = here["boot_id"] is not None and all(holder.get(k) == here[k] for k in ("host", "boot_id", "pid_ns"))
    if same_machine and isinstance(pid, int) and pid > 0:
        proc = _process(pid)
        if proc is None or proc[0] in ("Z", "X"):  # a zombie has exited; only its exit status is left
            return f"ran as pid {pid} on this host, which has ended"
        if holder.get("pid_start") and proc[1] != holder["pid_start"]:
            return f"ran as pid {pid} on this host, which now belongs to a process started later"
        return None
    ref = holder.get("rayjob")
    if isinstance(ref, dict) and ref.get("name") and ref.get("namespace") and ref.get("uid"):
        return _rayjob_gone(ref)
    return None


def own_rayjob() -> dict | None:
    """{namespace, name, uid} of the RayJob this process runs under (FINETUNE_RAYJOB_*, set by the chart), or
    None off Kubernetes or when the API cannot tell (then only the timeout can end this lease early)."""
    name, namespace = os.environ.get("FINETUNE_RAYJOB_NAME"), os.environ.get("FINETUNE_RAYJOB_NAMESPACE")
    if not name or not namespace:
        return None
    found = _get_rayjob(namespace, name)
    uid = found.get("metadata", {}).get("uid") if isinstance(found, dict) else None
    return {"namespace": namespace, "name": name, "uid": uid} if uid else None


def _rayjob_gone(ref: dict) -> str | None:
    where = f"ran under RayJob {ref['namespace']}/{ref['name']}"
    found = _get_rayjob(ref["namespace"], ref["name"])
    if found == 404:
        return f"{where}, which no longer exists"
    if isinstance(found, dict) and found.get("metadata", {}).get("uid") not in (None, ref["uid"]):
        return f"{where}, which was deleted (the RayJob of that name is a new object: a redeploy)"
    return None


def _get_rayjob(namespace: str, name: str) -> dict | int | None:
    """The RayJob as a dict, 404 when there is none, None when the API cannot tell (logged: the timeout decides)."""
    from app import kube

    try:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api, _, _ = kube.connect(prefer_in_cluster=True, retries=False)
        with api:
            return client.CustomObjectsApi(api).get_namespaced_custom_object(
                "ray.io",
                "v1",
                namespace,
                "rayjobs",
                name,
                _request_timeout=(kube.CONNECT_TIMEOUT_S, kube.READ_TIMEOUT_S),
            )
    except ApiException as exc:
        if exc.status == 404:
            return 404
        log.info(
            f"cannot read RayJob {namespace}/{name}, so a lease held under it expires by timeout only: "
            f"{kube.describe(exc, 'get rayjobs', namespace)}"
        )
    except Exception as exc:  # noqa: BLE001 - no credentials, no network: the timeout decides
        log.info(
            f"cannot read RayJob {namespace}/{name} ({kube.describe(exc, 'get rayjobs', namespace)}); a lease "
            "held under it expires by timeout only"
        )
    return None
