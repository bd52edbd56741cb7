"""A test-only kubelet and container runtime for the e2e suite: runs the pods that the real scheduler binds to
its Node, with the project's virtual environment and checkout standing in for the image.

What it does, as a kubelet would (and what it does not):
- registers a Node with the CPU, memory and ephemeral storage it declares (not measured) and keeps its Lease
  and Ready condition fresh; provisions a PersistentVolume (a host folder) for each pending claim of its
  namespaces, so one folder is shared by every pod that mounts the claim, across pods and redeploys;
- per pod: a network namespace with its own IP on a bridge (pods reach each other and the host, the API
  server through the `kubernetes` Service IP as in a cluster), an /etc/hosts that maps the pod's name and
  the Services of its namespace (name, name.ns, name.ns.svc, name.ns.svc.cluster.local) to the IPs of the
  pods behind them (headless-Service semantics: there is no kube-proxy);
- per container: a mount and UTS namespace of its own (tests/e2e/podinit.py) with the volumes bound at their
  mountPaths (configMap, secret, downwardAPI and projected service-account tokens as files, emptyDir as a
  folder per pod, a claim as its shared folder), the env (value, valueFrom fieldRef / resourceFieldRef /
  configMapKeyRef / secretKeyRef, envFrom, $(VAR) expansion), command + args exactly as written; init
  containers in order first; exec / httpGet / tcpSocket probes; restartPolicy; when a container's first
  process ends, the rest of its processes are SIGKILLed (as the kernel does when a PID namespace's init ends);
- phase, conditions, container statuses with exit codes and restart counts through pods/status;
- a deleted pod (deletionTimestamp) ends as kubelet 1.35 ends it (kuberuntime killContainer, every container at
  once): the grace period is deletionGracePeriodSeconds (else terminationGracePeriodSeconds, else 30; at least
  1, the kubelet's floor, which a force-deleted pod gets); the container's preStop hook (exec in the
  container's namespaces with its env, httpGet, sleep) runs for at most that long; then SIGTERM to the
  container's first process, the rest of the grace period (at least 2 s), SIGKILL; the final container
  statuses and phase; then the final delete (grace 0).
Not done: images (the venv is the image), users (processes run as this process's user), cgroup limits,
NetworkPolicy, pods of other namespaces (left Pending), GPUs (the Node has none, so such pods stay Pending).
Stood in for: a PID namespace per container. The container's first process has the runner's PID namespace, so
the kernel's rule for a namespace's init (a signal it has no handler for is not delivered, SIGKILL always is) is
applied by the runner: it sends the SIGTERM only when /proc/PID/status shows a handler for it (KubeRay's
`bash -c "ulimit ...; ray start ... --block"` is `ray start` itself once bash has exec'd its last command, and
`ray start --block` handles SIGTERM: it stops the node's Ray processes and exits 1).
"""

from __future__ import annotations

import base64
import ctypes
import http.client
import ipaddress
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PODINIT = Path(__file__).with_name("podinit.py")
API_SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: first IP of controlplane.SERVICE_CIDR
NETNS_PREFIX = "fte2e-"
BRIDGE = "fte2e0"
POLL_S = 0.5
HEARTBEAT_S = 10
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"  # the node heartbeat's Lease
LOG_LIMIT = 200_000  # bytes of a container's log kept for `logs()`
# Mount points the runner made on this machine's file system (e.g. /etc/finetune): removed at stop, and by the
# next start if a session was killed before its cleanup.
MOUNT_POINTS = Path(os.environ.get("TMPDIR", "/tmp")) / "finetune-e2e-mount-points"


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True)
    if check and out.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def quantity(q) -> float:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes)."""
    s = str(q)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, mult in units.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


class Api:
    """The API server's REST interface with the admin client certificate (the runner is part of the cluster)."""

    def __init__(self, server: str, pki: Path):
        self.host = server.removeprefix("https://")
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def call(self, method: str, path: str, body=None, content_type: str = "application/json", ok=(200, 201)):
        conn = http.client.HTTPSConnection(self.host, timeout=30, context=self.ctx)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": content_type, "Accept": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
        finally:
            conn.close()
        if resp.status not in ok:
            raise ApiError(resp.status, f"{method} {path}: {resp.status} {text[:300]!r}")
        return json.loads(text) if text else {}

    def get(self, path: str, missing_ok: bool = False):
        try:
            return self.call("GET", path)
        except ApiError as exc:
            if missing_ok and exc.status == 404:
                return None
            raise

    def patch(self, path: str, body, kind: str = "merge"):
        return self.call("PATCH", path, body, content_type=f"application/{kind}-patch+json")


class Dns:
    """The cluster DNS (there is no CoreDNS here): A records for the Services of the runner's namespaces,
    `<service>.<namespace>.svc.cluster.local` -> the IP of a pod behind it (headless semantics, as KubeRay's
    head Service is headless) and `kubernetes.default.svc.cluster.local` -> the Service IP the runner
    forwards to the API server; NXDOMAIN for everything else (nothing outside is reachable anyway)."""

    def __init__(self, ip: str):
        self.records: dict[str, str] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, 53))
        self.sock.settimeout(0.5)  # a socket blocked in recvfrom stays bound after close(): poll a flag instead
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self.sock.sendto(self.answer(data), peer)
            except (OSError, IndexError, ValueError):
                pass

    def answer(self, q: bytes) -> bytes:
        labels, i = [], 12
        while q[i]:
            labels.append(q[i + 1 : i + 1 + q[i]].decode().lower())
            i += 1 + q[i]
        qtype = int.from_bytes(q[i + 1 : i + 3], "big")
        question = q[12 : i + 5]
        ip = self.records.get(".".join(labels))
        flags = 0x8580 if ip else 0x8583  # response, authoritative, recursion desired+available; NXDOMAIN
        answers = b""
        if ip and qtype == 1:
            answers = (
                b"\xc0\x0c"
                + (1).to_bytes(2, "big")
                + (1).to_bytes(2, "big")
                + (5).to_bytes(4, "big")
                + (4).to_bytes(2, "big")
                + socket.inet_aton(ip)
            )
        return (
            q[:2]
            + flags.to_bytes(2, "big")
            + (1).to_bytes(2, "big")
            + (1 if answers else 0).to_bytes(2, "big")
            + b"\0\0\0\0"
            + question
            + answers
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class ApiError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --- one container -------------------------------------------------------------------------------------------


@dataclass
class Container:
    spec: dict
    init: bool
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    exit_code: int | None = None
    finished_at: str | None = None
    reason: str = ""
    restarts: int = 0
    ready: bool = False
    started: bool = False
    probe_counts: dict = field(default_factory=dict)
    log: Path | None = None
    mnt: int | None = None  # the container's mount namespace: which processes of the pod are this container's
    env: dict = field(default_factory=dict)  # as it started: an exec (probe, hook) gets the same

    @property
    def name(self) -> str:
        return self.spec["name"]

    def status(self) -> dict:
        st: dict = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "restartCount": self.restarts,
            "ready": self.ready,
            "started": self.started,
        }
        if self.proc is not None and self.exit_code is None:
            st["state"] = {"running": {"startedAt": self.started_at}}
        elif self.exit_code is not None:
            st["state"] = {
                "terminated": {
                    "exitCode": self.exit_code,
                    "reason": self.reason,
                    "startedAt": self.started_at,
                    "finishedAt": self.finished_at,
                }
            }
        else:
            st["state"] = {"waiting": {"reason": "PodInitializing" if not self.init else "Waiting"}}
        return st


# --- one pod ---------------------------------------------------------------------------------------------------


class Pod:
    def __init__(self, runner: PodRunner, obj: dict, ip: str):
        self.runner, self.obj, self.ip = runner, obj, ip
        meta = obj["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.netns = f"{NETNS_PREFIX}{self.uid[:8]}"
        self.dir = runner.root / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.hosts = self.dir / "etc-hosts"
        self.resolv = self.dir / "resolv.conf"
        self.init = [Container(c, True) for c in obj["spec"].get("initContainers", [])]
        self.main = [Container(c, False) for c in obj["spec"]["containers"]]
        self.lock = threading.RLock()
        self.terminating = False
        self.done = threading.Event()  # processes gone, namespace removed
        self.phase = "Pending"
        self.initialized = False
        self.start_time = now()
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)

    @property
    def api_path(self) -> str:
        return f"/api/v1/namespaces/{self.ns}/pods/{self.name}"

    # life cycle
    def _run(self) -> None:
        try:
            self._setup_network()
            self.volumes = self.runner.volumes_for(self)
            self.write_status()
            for c in self.init:
                while not self.terminating:
                    code = self._run_to_end(c)
                    if code == 0 or self.terminating:
                        break
                    if self.obj["spec"].get("restartPolicy", "Always") == "Never":
                        self.phase = "Failed"
                        self.write_status()
                        return
                    c.restarts += 1
                    self._backoff(c)
                if self.terminating:
                    return
            self.initialized = True
            if self.terminating:
                return
            for c in self.main:
                self._start(c)
            self.phase = "Running"
            self.write_status()
            self._supervise()
        except Exception:  # noqa: BLE001 - a runner bug must show, and the pod must not look healthy
            self.runner.errors.append(f"pod {self.ns}/{self.name}: {traceback.format_exc()}")
            self.phase = "Failed"
            self._try(self.write_status)
        finally:
            # The containers were started from this thread with PR_SET_PDEATHSIG, which fires when the thread (not
            # the process) ends: it stays until they have ended, also while a deleted pod's preStop hooks run.
            for c in self.init + self.main:
                if c.proc is not None:
                    c.proc.wait()

    def _backoff(self, c: Container) -> None:
        deadline = time.monotonic() + min(10 * 2 ** max(c.restarts - 1, 0), 60)
        while time.monotonic() < deadline and not self.terminating:
            time.sleep(0.2)

    def _run_to_end(self, c: Container) -> int:
        self._start(c)
        self.write_status()
        code = c.proc.wait()
        self._exited(c, code)
        self.write_status()
        return code

    def _supervise(self) -> None:
        policy = self.obj["spec"].get("restartPolicy", "Always")
        probes = [threading.Thread(target=self._probe_loop, args=(c,), daemon=True) for c in self.main]
        for t in probes:
            t.start()
        while not self.terminating:
            changed = False
            for c in self.main:
                if c.proc is not None and c.exit_code is None and c.proc.poll() is not None:
                    self._exited(c, c.proc.returncode)
                    changed = True
                if c.exit_code is not None and not self.terminating:
                    if policy == "Always" or (policy == "OnFailure" and c.exit_code != 0):
                        c.restarts += 1
                        self._backoff(c)
                        if not self.terminating:
                            self._start(c)
                            changed = True
            if all(c.exit_code is not None for c in self.main):
                self.phase = "Succeeded" if all(c.exit_code == 0 for c in self.main) else "Failed"
                self.write_status()
                return
            if changed:
                self.write_status()
            time.sleep(POLL_S)

    def _exited(self, c: Container, code: int) -> None:
        with self.lock:  # the supervisor and a termination may both see the end: recorded once
            if c.exit_code is not None:
                return
            # A signal shows as 128 + signal, as a container runtime reports it.
            c.exit_code = code if code >= 0 else 128 - code
            c.reason = "Completed" if c.exit_code == 0 else "Error"
            c.finished_at = now()
            c.ready = False
            c.started = False
        self._kill_container(c)  # the init of a PID namespace ended: the kernel kills the rest of it

    # processes
    def _start(self, c: Container) -> None:
        env = c.env = self.runner.container_env(self, c.spec)
        argv = expand(c.spec.get("command", []), env) + expand(c.spec.get("args", []), env)
        if not argv:
            raise RuntimeError(f"container {c.name} has no command: the image's entrypoint is not known here")
        mounts = self.runner.mounts_for(self, c.spec)
        plan = {
            "mounts": mounts,
            "hostname": self.name,
            "cwd": c.spec.get("workingDir") or str(REPO),
            "argv": argv,
            "env": env,
        }
        plan_file = self.dir / f"{c.name}.plan.json"
        plan_file.write_text(json.dumps(plan))
        c.log = self.dir / f"{c.name}.log"
        log = open(c.log, "ab")  # noqa: SIM115 - the child owns it
        c.exit_code, c.finished_at, c.reason, c.probe_counts = None, None, "", {}
        c.proc = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{self.netns}",
                "--",
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "--",
                sys.executable,
                str(PODINIT),
                str(plan_file),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        c.started_at = now()
        c.started = not c.spec.get("startupProbe")
        c.mnt = None
        own = _ns_inode(os.getpid(), "mnt")
        deadline = time.monotonic() + 10
        while c.proc.poll() is None and time.monotonic() < deadline:  # until unshare made its namespace
            mnt = _ns_inode(c.proc.pid, "mnt")
            if mnt and mnt != own:
                c.mnt = mnt
                break
            time.sleep(0.01)

    def terminate(self, grace: float) -> None:
        """A deleted pod, as the kubelet ends it: every running container at once is stopped with its preStop
        hook and the grace period (`_stop_container`), then the final status, then what is left goes."""
        self.terminating = True
        grace = max(1, int(grace))  # pod_workers.calculateEffectiveGracePeriod: never below 1 s
        with self.lock:
            running = [c for c in self.init + self.main if c.proc is not None and c.exit_code is None]
        threads = [threading.Thread(target=self._stop_container, args=(c, grace), daemon=True) for c in running]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(c.exit_code is not None for c in self.main):
            self.phase = "Succeeded" if all(c.exit_code == 0 for c in self.main) else "Failed"
        self._try(self.write_status)
        self.kill(0)

    def _stop_container(self, c: Container, grace: int) -> None:
        """kuberuntime killContainer: the preStop hook for at most the grace period, then the runtime's
        StopContainer with what is left of it (at least 2 s): SIGTERM to the first process, SIGKILL at the end."""
        t0 = time.monotonic()
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if hook and not c.init:
            self._pre_stop(c, hook, grace)
        remaining = max(grace - int(time.monotonic() - t0), 2)  # minimumGracePeriodInSeconds
        pid = c.proc.pid
        if c.proc.poll() is None and _handles(pid, signal.SIGTERM):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif c.proc.poll() is None:
            self.runner.note(
                f"{self.ns}/{self.name}/{c.name}: pid {pid} has no SIGTERM handler; as a PID "
                f"namespace's init it would not get the signal: SIGKILL after {remaining} s"
            )
        try:
            code = c.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            self._kill_container(c)
            code = c.proc.wait()
        self._exited(c, code)
        self._try(self.write_status)

    def _pre_stop(self, c: Container, hook: dict, grace: int) -> None:
        """The preStop handler, as the kubelet runs it; a failure is noted (the kubelet's FailedPreStopHook event)
        and the container is stopped anyway. An exec hook still running at the end of the grace period goes
        with the container (it runs in the container's namespaces)."""
        try:
            if "exec" in hook:
                with open(self.dir / f"{c.name}.preStop.log", "ab") as log:
                    proc = subprocess.Popen(
                        ["nsenter", "-t", str(c.proc.pid), "-m", "-n", "-u", "--", *hook["exec"]["command"]],
                        env=c.env,
                        cwd=c.spec.get("workingDir") or str(REPO),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        preexec_fn=_die_with_parent,
                    )
                try:
                    ok = proc.wait(timeout=grace) == 0
                except subprocess.TimeoutExpired:
                    self.runner.note(f"{self.ns}/{self.name}/{c.name}: preStop hook still running after {grace} s")
                    return
            elif "sleep" in hook:
                time.sleep(min(hook["sleep"]["seconds"], grace))
                ok = True
            else:
                get = hook["httpGet"]
                conn = http.client.HTTPConnection(get.get("host") or self.ip, self._port(c, get["port"]), timeout=grace)
                try:
                    conn.request("GET", get.get("path", "/"))
                    ok = 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
        except (OSError, http.client.HTTPException) as exc:
            self.runner.note(f"{self.ns}/{self.name}/{c.name}: preStop hook: {exc}")
            ok = False
        if not ok:
            self.runner.note(f"{self.ns}/{self.name}/{c.name}: FailedPreStopHook")

    def kill(self, grace: float) -> None:
        """The runner's own clean-up (at its stop, and what a terminated pod left): SIGTERM to every process in the
        pod's network namespace, SIGKILL to what is left after `grace`; then the namespace goes."""
        self.terminating = True
        deadline = time.monotonic() + grace
        sent = False
        while True:
            pids = self.pids()
            if not pids:
                break
            sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
            if sig == signal.SIGTERM and sent:
                time.sleep(0.2)
                continue
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            sent = True
            time.sleep(0.2)
        for c in self.init + self.main:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
            if c.proc is not None:
                c.proc.wait()
        self.thread.join(timeout=30)
        sh("ip", "netns", "del", self.netns, check=False)
        self.done.set()

    def pids(self) -> list[int]:
        out = sh("ip", "netns", "pids", self.netns, check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    # network
    def _setup_network(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        host_if, pod_if = f"fh{self.uid[:8]}", f"fp{self.uid[:8]}"
        sh("ip", "netns", "add", self.netns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        sh("ip", "link", "set", host_if, "master", BRIDGE, "up")
        sh("ip", "link", "set", pod_if, "netns", self.netns)
        ns = ["ip", "-n", self.netns]
        sh(*ns, "link", "set", pod_if, "name", "eth0")
        sh(*ns, "addr", "add", f"{self.ip}/{self.runner.net.prefixlen}", "dev", "eth0")
        sh(*ns, "link", "set", "eth0", "up")
        sh(*ns, "link", "set", "lo", "up")
        sh(*ns, "route", "add", "default", "via", self.runner.gateway)
        # As a kubelet writes them: the pod's own name in /etc/hosts, the cluster DNS in resolv.conf.
        self.hosts.write_text(
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{self.ip}\t{self.name}\n"
        )
        self.resolv.write_text(
            f"search {self.ns}.svc.cluster.local svc.cluster.local cluster.local\n"
            f"nameserver {self.runner.gateway}\noptions ndots:5\n"
        )

    # probes
    def _probe_loop(self, c: Container) -> None:
        ready, live, startup = c.spec.get("readinessProbe"), c.spec.get("livenessProbe"), c.spec.get("startupProbe")
        if not ready:
            c.ready = True
            self._try(self.write_status)
        t0, last = time.monotonic(), {}
        while not self.terminating and c.exit_code is None:
            for kind, probe in (("startup", startup), ("readiness", ready), ("liveness", live)):
                if not probe or (kind != "startup" and not c.started) or (kind == "startup" and c.started):
                    continue
                if time.monotonic() - t0 < probe.get("initialDelaySeconds", 0):
                    continue
                if time.monotonic() - last.get(kind, 0) < probe.get("periodSeconds", 10):
                    continue
                last[kind] = time.monotonic()
                self._probe_result(c, kind, probe, self._probe(c, probe))
            time.sleep(0.5)

    def _probe_result(self, c: Container, kind: str, probe: dict, ok: bool) -> None:
        ok_n, bad_n = c.probe_counts.get((kind, True), 0), c.probe_counts.get((kind, False), 0)
        ok_n, bad_n = (ok_n + 1, 0) if ok else (0, bad_n + 1)
        c.probe_counts[(kind, True)], c.probe_counts[(kind, False)] = ok_n, bad_n
        if kind == "readiness":
            want = c.ready
            if ok and ok_n >= probe.get("successThreshold", 1):
                want = True
            elif not ok and bad_n >= probe.get("failureThreshold", 3):
                want = False
            if want != c.ready:
                c.ready = want
                self._try(self.write_status)
        elif kind == "startup" and ok:
            c.started = True
            self._try(self.write_status)
        elif not ok and bad_n >= probe.get("failureThreshold", 3):  # liveness or startup failed: restart
            self.runner.note(f"{self.ns}/{self.name}/{c.name}: {kind} probe failed {bad_n} times, killing it")
            self._kill_container(c)

    def _kill_container(self, c: Container) -> None:
        """SIGKILL to every process of the container (those in its mount namespace), as to a PID namespace."""
        mnt = c.mnt or _ns_inode(c.proc.pid, "mnt")
        for pid in self.pids():
            if mnt and _ns_inode(pid, "mnt") == mnt:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _probe(self, c: Container, probe: dict) -> bool:
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "exec" in probe:
                out = subprocess.run(
                    ["nsenter", "-t", str(c.proc.pid), "-m", "-n", "-u", "--", *probe["exec"]["command"]],
                    env=c.env,
                    capture_output=True,
                    timeout=timeout,
                    cwd=c.spec.get("workingDir") or str(REPO),
                )
                return out.returncode == 0
            if "httpGet" in probe:
                get = probe["httpGet"]
                conn = http.client.HTTPConnection(
                    get.get("host") or self.ip, self._port(c, get["port"]), timeout=timeout
                )
                try:
                    conn.request(
                        "GET", get.get("path", "/"), headers={h["name"]: h["value"] for h in get.get("httpHeaders", [])}
                    )
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in probe:
                with socket.create_connection((self.ip, self._port(c, probe["tcpSocket"]["port"])), timeout=timeout):
                    return True
        except (OSError, subprocess.TimeoutExpired, http.client.HTTPException):
            return False
        return False

    @staticmethod
    def _port(c: Container, port) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(p["containerPort"] for p in c.spec.get("ports", []) if p.get("name") == port)

    # status
    def write_status(self) -> None:
        with self.lock:
            ready = self.phase == "Running" and all(c.ready for c in self.main)
            t = now()
            conds = [
                {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": self.start_time},
                {"type": "Initialized", "status": str(self.initialized), "lastTransitionTime": t},
                {"type": "ContainersReady", "status": str(ready), "lastTransitionTime": t},
                {"type": "Ready", "status": str(ready), "lastTransitionTime": t},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": self.start_time},
            ]
            status = {
                "phase": self.phase,
                "conditions": conds,
                "hostIP": self.runner.gateway,
                "hostIPs": [{"ip": self.runner.gateway}],
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "startTime": self.start_time,
                "containerStatuses": [c.status() for c in self.main],
            }
            if self.init:
                status["initContainerStatuses"] = [c.status() for c in self.init]
            try:
                self.runner.api.patch(self.api_path + "/status", {"status": status})
            except ApiError as exc:
                if exc.status != 404:
                    raise

    def _try(self, fn) -> None:
        try:
            fn()
        except (ApiError, OSError) as exc:
            self.runner.note(f"{self.ns}/{self.name}: {exc}")


def _handles(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def expand(items: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion: a defined VAR is replaced, $$ escapes, anything else stays."""

    def one(s: str) -> str:
        return re.sub(
            r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
            lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
            s,
        )

    return [one(s) for s in items]


# --- the runner ------------------------------------------------------------------------------------------------

_node_ids = itertools.count()


class PodRunner:
    # Declared, not measured, and large: the scheduler also binds pods of other namespaces here (earlier tests'
    # jobs, still being deleted), which this runner leaves Pending; they must not crowd out the test's own.
    def __init__(
        self,
        cp,
        namespaces: list[str],
        *,
        cpu: str = "64",
        memory: str = "512Gi",
        subnet: str = "10.244.0.0/24",
        venv: Path | None = None,
    ):
        # A new name for each runner: pods still bound to an earlier runner's Node are orphans the pod garbage
        # collector removes, instead of counting against this one.
        self.cp, self.namespaces, self.node = cp, set(namespaces), f"e2e-node-{next(_node_ids)}"
        self.capacity = {"cpu": cpu, "memory": memory, "pods": "250", "ephemeral-storage": "2Ti"}
        self.net = ipaddress.ip_network(subnet)
        hosts = list(self.net.hosts())
        self.gateway, self._free = str(hosts[0]), [str(h) for h in hosts[1:]]
        self.venv = Path(venv or os.environ.get("FINETUNE_E2E_VENV") or Path(sys.executable).parent.parent)
        self.root = cp.root / "podrunner"
        self.api = Api(cp.server, cp.pki)
        self.pods: dict[str, Pod] = {}
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.created_dirs: list[Path] = []
        self._mkdir_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._forwarder: socket.socket | None = None
        self.dns: Dns | None = None

    def note(self, text: str) -> None:
        self.notes.append(f"{now()} {text}")

    # start / stop
    def start(self) -> PodRunner:
        missing = [t for t in ("ip", "nsenter", "unshare", "mount") if not shutil.which(t)]
        if missing or os.geteuid() != 0:
            raise RuntimeError(
                f"the e2e pod runner needs root and {', '.join(missing) or 'ip, nsenter, unshare'} "
                "(network and mount namespaces per pod): run `make e2e` as root; Debian/Ubuntu: "
                "apt-get install iproute2 util-linux mount"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        remove_leftovers()
        try:
            sh("ip", "link", "add", BRIDGE, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", BRIDGE)
            sh("ip", "addr", "add", f"{API_SERVICE_IP}/32", "dev", BRIDGE)
            sh("ip", "link", "set", BRIDGE, "up")
            self._start_forwarder()
            self.dns = Dns(self.gateway)
            self._register_node()
            for target in (self._heartbeat_loop, self._pod_loop):
                t = threading.Thread(target=target, name=target.__name__, daemon=True)
                t.start()
                self._threads.append(t)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> list[str]:
        """Kills every pod's processes, removes namespaces, links and folders; returns what could not be removed."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        for pod in list(self.pods.values()):
            if not pod.done.is_set():
                pod.kill(grace=2)
        self.pods.clear()
        if self._forwarder:
            self._accept_thread.join(timeout=5)
            self._forwarder.close()
        if self.dns:
            self.dns.close()
        if self.api:
            for path in (f"/api/v1/nodes/{self.node}", f"{LEASES}/{self.node}"):
                try:
                    self.api.call("DELETE", path, ok=(200, 202, 404))
                except (ApiError, OSError):
                    pass
        sh("ip", "link", "del", BRIDGE, check=False)
        remove_mount_points()
        shutil.rmtree(self.root, ignore_errors=True)
        return leftovers()

    def _start_forwarder(self) -> None:
        """The `kubernetes` Service (no kube-proxy here): API_SERVICE_IP:443 -> the API server on loopback."""
        target = self.cp.server.removeprefix("https://").rsplit(":", 1)
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((API_SERVICE_IP, 443))
        srv.listen(64)
        srv.settimeout(0.5)  # as for the DNS socket: accept() polls, so that stop() really unbinds it
        self._forwarder = srv

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        def accept() -> None:
            while not self._stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                conn.settimeout(None)
                try:
                    up = socket.create_connection((target[0], int(target[1])))
                except OSError:
                    conn.close()
                    continue
                for a, b in ((conn, up), (up, conn)):
                    threading.Thread(target=pipe, args=(a, b), daemon=True).start()

        self._accept_thread = threading.Thread(target=accept, name="apiserver-forwarder", daemon=True)
        self._accept_thread.start()

    # node
    def _register_node(self) -> None:
        self.api.call(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": self.node,
                    "labels": {
                        "kubernetes.io/hostname": self.node,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                    },
                },
            },
        )
        self._node_status()
        self.api.call(
            "POST",
            LEASES,
            {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.node},
                "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40, "renewTime": self._micro()},
            },
            ok=(201, 409),
        )

    @staticmethod
    def _micro() -> str:
        return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def _node_status(self) -> None:
        t = now()
        conds = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "e2e pod runner",
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            }
        ]
        conds += [
            {
                "type": f"{k}Pressure",
                "status": "False",
                "reason": f"KubeletHasSufficient{k}",
                "lastHeartbeatTime": t,
                "lastTransitionTime": t,
            }
            for k in ("Memory", "Disk", "PID")
        ]
        self.api.patch(
            f"/api/v1/nodes/{self.node}/status",
            {
                "status": {
                    "capacity": self.capacity,
                    "allocatable": self.capacity,
                    "conditions": conds,
                    "addresses": [
                        {"type": "InternalIP", "address": self.gateway},
                        {"type": "Hostname", "address": self.node},
                    ],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                    "nodeInfo": {
                        "machineID": "",
                        "systemUUID": "",
                        "bootID": "",
                        "kernelVersion": os.uname().release,
                        "osImage": "finetune e2e pod runner",
                        "containerRuntimeVersion": "podrunner://0",
                        "kubeletVersion": "v0.0.0-podrunner",
                        "kubeProxyVersion": "",
                        "operatingSystem": "linux",
                        "architecture": "amd64",
                    },
                }
            },
            kind="strategic-merge",
        )

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._node_status()
                self.api.patch(f"{LEASES}/{self.node}", {"spec": {"renewTime": self._micro()}})
            except (ApiError, OSError) as exc:
                self.note(f"heartbeat: {exc}")

    # pods
    def _pod_loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._sync()
            except (ApiError, OSError) as exc:
                self.note(f"sync: {exc}")
            except Exception:  # noqa: BLE001
                self.errors.append(traceback.format_exc())

    def _sync(self) -> None:
        self._provision_claims()
        listed = self.api.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.node}")["items"]
        seen = set()
        for obj in listed:
            meta = obj["metadata"]
            if meta["namespace"] not in self.namespaces:
                continue
            uid = meta["uid"]
            seen.add(uid)
            pod = self.pods.get(uid)
            if pod is None:
                if meta.get("deletionTimestamp"):
                    self._finalize(obj)
                    continue
                if obj.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                pod = self.pods[uid] = Pod(self, obj, self._free.pop(0))
                pod.thread.start()
            pod.obj = obj
            if meta.get("deletionTimestamp") and not pod.terminating:
                grace = meta.get("deletionGracePeriodSeconds", obj["spec"].get("terminationGracePeriodSeconds", 30))
                pod.terminating = True
                threading.Thread(target=self._delete, args=(pod, grace), daemon=True).start()
        for uid, pod in list(self.pods.items()):
            if uid not in seen and not pod.terminating:  # gone from the API (force-deleted): the kubelet's 1 s
                pod.terminating = True
                threading.Thread(target=self._delete, args=(pod, 1), daemon=True).start()
            if pod.done.is_set():
                del self.pods[uid]
        self._refresh_dns(listed)

    def _delete(self, pod: Pod, grace: float) -> None:
        pod.terminate(grace)
        self._finalize(pod.obj)

    def _finalize(self, obj: dict) -> None:
        """What a kubelet does once a deleted pod's processes are gone: delete it for good (grace 0)."""
        meta = obj["metadata"]
        try:
            self.api.call(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                ok=(200, 202, 404, 409),
            )
        except (ApiError, OSError) as exc:
            self.note(f"finalize {meta['name']}: {exc}")

    # claims
    def claim_dir(self, ns: str, claim: str) -> Path:
        d = self.root / "claims" / ns / claim
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _provision_claims(self) -> None:
        """A PersistentVolume (its host folder) for each pending claim of this runner's namespaces."""
        for ns in self.namespaces:
            for pvc in self.api.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims")["items"]:
                if pvc.get("status", {}).get("phase") != "Pending" or pvc["spec"].get("volumeName"):
                    continue
                meta = pvc["metadata"]
                name = f"e2e-{meta['uid']}"
                pv = {
                    "apiVersion": "v1",
                    "kind": "PersistentVolume",
                    "metadata": {"name": name, "labels": {"finetune-e2e/podrunner": "true"}},
                    "spec": {
                        "capacity": {"storage": pvc["spec"]["resources"]["requests"]["storage"]},
                        "accessModes": pvc["spec"]["accessModes"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "storageClassName": pvc["spec"].get("storageClassName") or "",
                        "hostPath": {"path": str(self.claim_dir(ns, meta["name"]))},
                        "claimRef": {"namespace": ns, "name": meta["name"], "uid": meta["uid"]},
                    },
                }
                self.api.call("POST", "/api/v1/persistentvolumes", pv, ok=(201, 409))

    # what a container sees
    def volumes_for(self, pod: Pod) -> dict[str, Path]:
        """Volume name -> the host path bound for it (files written now: the kubelet does it before start)."""
        out = {}
        vols = pod.dir / "volumes"
        for v in pod.obj["spec"].get("volumes", []):
            name, d = v["name"], vols / v["name"]
            if "persistentVolumeClaim" in v:
                out[name] = self.claim_dir(pod.ns, v["persistentVolumeClaim"]["claimName"])
                continue
            d.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                self._key_files(
                    d,
                    self._config_map(pod.ns, v["configMap"]["name"], v["configMap"].get("optional")),
                    v["configMap"].get("items"),
                )
            elif "secret" in v:
                self._key_files(
                    d,
                    self._secret(pod.ns, v["secret"]["secretName"], v["secret"].get("optional")),
                    v["secret"].get("items"),
                )
            elif "downwardAPI" in v:
                for item in v["downwardAPI"]["items"]:
                    self._write(d / item["path"], self._field(pod, item["fieldRef"]["fieldPath"]))
            elif "projected" in v:
                for src in v["projected"]["sources"]:
                    self._projected(pod, d, src)
            elif "emptyDir" not in v:
                raise RuntimeError(
                    f"volume {name}: only configMap, secret, downwardAPI, projected, emptyDir and "
                    "persistentVolumeClaim are supported by the e2e pod runner"
                )
            out[name] = d
        return out

    def _projected(self, pod: Pod, d: Path, src: dict) -> None:
        if "serviceAccountToken" in src:
            sa = pod.obj["spec"].get("serviceAccountName", "default")
            tok = src["serviceAccountToken"]
            body = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "audiences": [tok["audience"]] if tok.get("audience") else None,
                    "expirationSeconds": tok.get("expirationSeconds", 3607),
                    "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod.name, "uid": pod.uid},
                },
            }
            out = self.api.call("POST", f"/api/v1/namespaces/{pod.ns}/serviceaccounts/{sa}/token", body)
            self._write(d / tok["path"], out["status"]["token"])
        elif "configMap" in src:
            self._key_files(
                d,
                self._config_map(pod.ns, src["configMap"]["name"], src["configMap"].get("optional")),
                src["configMap"].get("items"),
            )
        elif "secret" in src:
            self._key_files(
                d,
                self._secret(pod.ns, src["secret"]["name"], src["secret"].get("optional")),
                src["secret"].get("items"),
            )
        elif "downwardAPI" in src:
            for item in src["downwardAPI"]["items"]:
                self._write(d / item["path"], self._field(pod, item["fieldRef"]["fieldPath"]))

    @staticmethod
    def _write(path: Path, text: str | bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    def _key_files(self, d: Path, data: dict[str, bytes], items: list | None) -> None:
        for key, path in [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]:
            if key in data:
                self._write(d / path, data[key])

    def _config_map(self, ns: str, name: str, optional: bool | None) -> dict[str, bytes]:
        obj = self.api.get(f"/api/v1/namespaces/{ns}/configmaps/{name}", missing_ok=bool(optional)) or {}
        return {k: v.encode() for k, v in (obj.get("data") or {}).items()} | {
            k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()
        }

    def _secret(self, ns: str, name: str, optional: bool | None) -> dict[str, bytes]:
        obj = self.api.get(f"/api/v1/namespaces/{ns}/secrets/{name}", missing_ok=bool(optional)) or {}
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def mounts_for(self, pod: Pod, spec: dict) -> list:
        """[host path, mountPath, read only] for the container, and the pod's /etc/hosts; makes missing
        mount points (removed again at stop)."""
        out = []
        for m in spec.get("volumeMounts", []):
            src = pod.volumes[m["name"]]
            if m.get("subPath"):
                src = src / m["subPath"]
                src.mkdir(parents=True, exist_ok=True) if not src.exists() else None
            self._mount_point(Path(m["mountPath"]), is_file=src.is_file())
            out.append([str(src), m["mountPath"], bool(m.get("readOnly"))])
        out.append([str(pod.hosts), "/etc/hosts", True])
        out.append([str(pod.resolv), "/etc/resolv.conf", True])
        return out

    def _mount_point(self, path: Path, is_file: bool) -> None:
        with self._mkdir_lock:  # pods start concurrently and share mount points such as /etc/finetune
            missing = []
            p = path
            while not p.exists():
                missing.append(p)
                p = p.parent
            for p in reversed(missing):
                if p == path and is_file:
                    p.touch()
                else:
                    p.mkdir()
                self.created_dirs.append(p)
                with open(MOUNT_POINTS, "a") as f:  # for remove_leftovers() after a SIGKILL
                    f.write(f"{p}\n")

    def container_env(self, pod: Pod, spec: dict) -> dict[str, str]:
        home = pod.dir / "home"
        if not home.exists():
            # The image's home folder: the venv first on PATH for login shells too (KubeRay runs `bash -lc`,
            # and /etc/profile resets PATH), as the Ray image's profile puts its Python first.
            home.mkdir(parents=True)
            (home / ".profile").write_text(f'export PATH="{self.venv}/bin:$PATH"\n')
        env = {
            "PATH": f"{self.venv}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(home),
            "HOSTNAME": pod.name,
            "PYTHONPATH": str(REPO),
            "LANG": "C.UTF-8",
            # The image ships DeepSpeed's ops built; here torch builds them once per machine, shared by all pods.
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR")
            or str(Path.home() / ".cache" / "torch_extensions"),
            "KUBERNETES_SERVICE_HOST": API_SERVICE_IP,
            "KUBERNETES_SERVICE_PORT": "443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "443",
            "KUBERNETES_PORT": f"tcp://{API_SERVICE_IP}:443",
        }
        for src in spec.get("envFrom", []):
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._config_map(pod.ns, src["configMapRef"]["name"], src["configMapRef"].get("optional"))
            else:
                data = self._secret(pod.ns, src["secretRef"]["name"], src["secretRef"].get("optional"))
            env |= {prefix + k: v.decode() for k, v in data.items()}
        for e in spec.get("env", []):
            if "valueFrom" not in e:
                env[e["name"]] = expand([e.get("value", "")], env)[0]
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = self._field(pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[e["name"]] = self._resource(spec, vf["resourceFieldRef"])
            else:
                ref = vf.get("secretKeyRef") or vf["configMapKeyRef"]
                get = self._secret if "secretKeyRef" in vf else self._config_map
                data = get(pod.ns, ref["name"], ref.get("optional"))
                if ref["key"] in data:
                    env[e["name"]] = data[ref["key"]].decode()
                elif not ref.get("optional"):
                    raise RuntimeError(f"env {e['name']}: key {ref['key']} not in {ref['name']}")
        return env

    def _field(self, pod: Pod, path: str) -> str:
        meta = pod.obj["metadata"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        return {
            "metadata.name": pod.name,
            "metadata.namespace": pod.ns,
            "metadata.uid": pod.uid,
            "spec.nodeName": self.node,
            "spec.serviceAccountName": pod.obj["spec"].get("serviceAccountName", ""),
            "status.podIP": pod.ip,
            "status.podIPs": pod.ip,
            "status.hostIP": self.gateway,
            "status.hostIPs": self.gateway,
        }[path]

    def _resource(self, spec: dict, ref: dict) -> str:
        kind, res = ref["resource"].split(".", 1)
        value = (spec.get("resources", {}).get(kind) or {}).get(res) or self.capacity.get(res, "0")
        divisor = quantity(ref.get("divisor", "1"))
        return str(math.ceil(quantity(value) / divisor))

    def _refresh_dns(self, listed: list[dict]) -> None:
        records = {"kubernetes.default.svc.cluster.local": API_SERVICE_IP}
        for ns in self.namespaces:
            for name, ip in self._service_ips(ns, listed).items():
                records[f"{name}.{ns}.svc.cluster.local"] = ip
        self.dns.records = records

    def _service_ips(self, ns: str, listed: list[dict]) -> dict[str, str]:
        """Service name -> the IP of a pod behind it: a ready one, or any running one where the Service
        publishes not-ready addresses (KubeRay's head Service does, so workers can wait for the GCS)."""
        out = {}
        for svc in self.api.get(f"/api/v1/namespaces/{ns}/services")["items"]:
            sel = svc["spec"].get("selector")
            if not sel:
                continue
            for obj in listed:
                labels = obj["metadata"].get("labels") or {}
                if (
                    obj["metadata"]["namespace"] != ns
                    or obj["metadata"].get("deletionTimestamp")
                    or any(labels.get(k) != v for k, v in sel.items())
                ):
                    continue
                pod = self.pods.get(obj["metadata"]["uid"])
                if pod is None or pod.terminating:
                    continue
                ready = any(
                    c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", [])
                )
                if ready or svc["spec"].get("publishNotReadyAddresses"):
                    out[svc["metadata"]["name"]] = pod.ip
                    break
        return out

    def running(self, ns: str, name: str) -> bool:
        """Whether a pod of that name still has processes (or has not been cleaned up) on this runner."""
        return any(p.ns == ns and p.name == name and not p.done.is_set() for p in list(self.pods.values()))

    def pods_running(self, ns: str, title: str) -> list[str]:
        """Names of the live pods of `ns` with a process whose command line starts with `title` (Ray titles its
        workers' processes, e.g. ray::RayTrainWorker for a Ray Train rank)."""
        out = []
        for pod in list(self.pods.values()):
            if pod.ns != ns or pod.terminating:
                continue
            for pid in pod.pids():
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                        out.append(pod.name)
                        break
                except OSError:
                    pass
        return out

    def logs(self, ns: str, name_prefix: str = "") -> str:
        """The logs of the pods of `ns` whose name starts with name_prefix (for failure messages)."""
        out = []
        for d in sorted((self.root / "pods").glob(f"{ns}_{name_prefix}*")):
            # The containers' output, and the Ray job drivers' (HTTPMode has no submitter to print them).
            for log in sorted(d.glob("*.log")) + sorted(d.glob("volumes/*/session_latest/logs/job-driver-*.log")):
                data = log.read_bytes()[-LOG_LIMIT:]
                out.append(f"--- {d.name}/{log.name}\n{data.decode(errors='replace')}")
        return "\n".join(out)


def leftovers() -> list[str]:
    """What a runner of this suite could have left behind: network namespaces, the bridge, processes in them."""
    found = []
    out = sh("ip", "netns", "list", check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(NETNS_PREFIX):
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            found.append(f"network namespace {name} (processes {pids})")
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        found.append(f"bridge {BRIDGE}")
    if MOUNT_POINTS.exists():
        found.append(f"mount points {MOUNT_POINTS.read_text().split()}")
    return found


def remove_mount_points() -> None:
    if not MOUNT_POINTS.exists():
        return
    for line in reversed(MOUNT_POINTS.read_text().splitlines()):
        p = Path(line)
        try:
            p.rmdir() if p.is_dir() else p.unlink()
        except OSError:
            pass
    MOUNT_POINTS.unlink()


def remove_leftovers() -> None:
    """A previous session killed before its cleanup (SIGKILL): its namespaces' processes and links."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(NETNS_PREFIX):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            sh("ip", "netns", "del", name, check=False)
    sh("ip", "link", "del", BRIDGE, check=False)
    remove_mount_points()
