"""A real Kubernetes node for the e2e tests, on the control plane of tests/e2e/controlplane.py.

containerd (runc, overlayfs, its own config and state), the CNI bridge plugin on a bridge of our own, the
kubelet registered with the API server (TLS both ways, webhook authn/authz), kube-proxy (nftables mode:
Service ClusterIPs, including `kubernetes`, from pods), CoreDNS on the bridge address behind the `kube-dns`
Service (cluster.local names resolve in pods), and the local image registry of `make image`
(tools/image/registry.sh), which holds the project's image, and to which the pause image and a static busybox
image built here (tools/node/images.sh) are pushed: no public registry is reachable. Why each setting is what
it is: docs/kubernetes.md, "A real node".

The node carries a taint: only the pods of namespaces that `admit()` names run (their default toleration,
through the PodTolerationRestriction admission plugin); the rest stay Pending, as on a cluster without room.
For the tests it provides what a cluster's storage and log tooling would: `claim_dir()` (a PersistentVolume
pre-bound to a claim), `logs()` (every container's output in a namespace, also of pods already deleted) and
the processes of a pod (`pod_pids()`, `pods_running()`), read from its cgroups.

Everything lies under one state folder, but for what containerd 1.6 and the kubelet write at fixed places
(/run/containerd, /var/lib/kubelet, /var/lib/cni), three global sysctls the kubelet rewrites, the `kubepods`
cgroups, kube-proxy's nftables tables and the bridge. `stop()` removes or restores all of it (also registered
with atexit, so a failing, interrupted or terminated run cleans up), and `leftovers()` names whatever is still
there: the test fails on it. A run killed outright (SIGKILL, a machine's session ending) cannot clean up; its
state folder holds an owner record (the test process, what the host had before), and the next node's `start()`
reclaims such a node once its owner is gone, restoring the host as the dead run would have.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from e2e import image
from e2e.controlplane import (
    REPO,
    ControlPlane,
    ControlPlaneError,
    free_port,
    kill_group,
    kubeconfig,
    log_tail,
    sign_leaf,
    spawn,
    wait_for,
)

NODE_TOOLS = REPO / "tools" / "node"
NODE_NAME = "e2e-node"
BRIDGE = "ftnode0"
SUBNET = "10.244.77.0/24"
GATEWAY = "10.244.77.1"  # on the bridge: node IP, API server, kubelet, CoreDNS; pods' default route
CLUSTER_DNS = "10.96.0.10"  # the kube-dns Service, in controlplane.SERVICE_CIDR
# The kubelet sets these for its own needs (kubelet/cm/container_manager_linux.go); restored at teardown.
SYSCTLS = ("vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops")
# Written by containerd 1.6 or the kubelet whatever their configured folders; removed when this created them.
FIXED_PATHS = ("/run/containerd", "/var/lib/kubelet", "/var/lib/cni", "/opt/containerd", "/etc/cni")
NFT_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))
OWNER_FILE = "owner.json"  # in the state folder: who runs this node and what to restore if it is killed
READY_TIMEOUT_S = 120
# Pods run here only where their namespace tolerates this (admit()).
TAINT = {"key": "finetune-e2e/pods", "value": "run", "effect": "NoSchedule"}
IMAGE_GID = 100  # the image's group (user ray, uid 1000), which the chart's fsGroup names
KEEP_LOGS_EVERY_S = 1.0
# Room a pull needs beside the compressed layers it downloads: the project's image unpacks to 2.1x its gzip size
# (6.94 GB from 3.34 GB); the spare is for the pods' logs, volumes and checkpoints.
PULL_ROOM_FACTOR = 3.2
PULL_SPARE_BYTES = 3 * 10**9


class NodeError(ControlPlaneError):
    pass


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise NodeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out


def sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def cgroup_mounts() -> list[Path]:
    """Every cgroup (v1 and v2) hierarchy's mount point."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] in ("cgroup", "cgroup2"):
            mounts.append(Path(left.split()[4]))
    return mounts


def mounts_under(root: Path) -> list[str]:
    """Mount points at or under `root`, deepest first."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point == str(root) or point.startswith(f"{root}/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def shim_pids(socket: Path) -> list[int]:
    """containerd shims (they leave containerd's process group by design) serving `socket`'s containerd."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"containerd-shim" in argv[0] and str(socket).encode() in argv:
            pids.append(int(proc.name))
    return pids


# The cgroup trees are walked with os.walk, which skips a folder that vanishes while it is walked: the kubelet
# removes a deleted pod's cgroups while tests look for its processes, and pathlib's rglob raised FileNotFoundError.
def pod_cgroups(uid: str) -> list[Path]:
    """The cgroup folders of the pod with this uid, one per hierarchy (cgroupfs driver: .../kubepods/[QOS/]podUID)."""
    name = f"pod{uid}"
    return [Path(d) / name for m in cgroup_mounts() for d, subs, _ in os.walk(m / "kubepods") if name in subs]


def cgroup_pids(root: Path) -> set[int]:
    """The processes in the cgroups under `root` (a cgroup that goes meanwhile counts as empty)."""
    pids = set()
    for folder, _, files in os.walk(root):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (Path(folder) / "cgroup.procs").read_text().split())
    return pids


def kubepods_pids() -> list[int]:
    return sorted(pid for mount in cgroup_mounts() for pid in cgroup_pids(mount / "kubepods"))


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (with the pid, it names one process: pids are
    reused); None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


def stale_nodes() -> list[Path]:
    """State folders of nodes whose test process is gone (killed before its teardown could run)."""
    stale = []
    for root in Path(tempfile.gettempdir()).glob("ftnode-*"):
        try:
            owner = json.loads((root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue  # a node still starting (it writes the record before touching the host), or not one of ours
        if process_start(owner["pid"]) != owner["start"]:
            stale.append(root)
    return stale


@dataclass
class Node:
    kubectl_bin: str
    helm_bin: str
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ftnode-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    sysctls: dict[str, str] = field(default_factory=dict)
    existed: dict[str, bool] = field(default_factory=dict)
    images: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    app_image: dict[str, str] = field(default_factory=dict)  # image.build()'s record: IMAGE, IMAGE_DIGEST, ...
    cluster: ControlPlane | None = None
    stopped: bool = False
    registry: str = ""
    registry_started: bool = False
    _stopping: threading.Event = field(default_factory=threading.Event)
    _logs_lock: threading.Lock = field(default_factory=threading.Lock)
    _kept_logs: dict[Path, list[int]] = field(default_factory=dict)  # per log path, the inodes linked
    _log_keeper: threading.Thread | None = None

    @property
    def socket(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def log_dir(self) -> Path:
        """The node components' own logs (containerd, kubelet, ...)."""
        return self.root / "logs"

    # --- life cycle ----------------------------------------------------------------------------------------

    def start(self) -> Node:
        for root in stale_nodes():
            self.reclaim(root)
        busy = self._in_use()
        if busy:
            self.root.rmdir()  # still empty
            # Not ours to remove: another node may be running; a killed run's leftovers are the admin's call.
            raise NodeError(f"another node's parts are on this machine: {', '.join(busy)} (remove them if stale)")
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            sh("bash", str(NODE_TOOLS / "install.sh"), timeout=600)
            self.sysctls = {k: sysctl_path(k).read_text().strip() for k in SYSCTLS}
            self.existed = {p: os.path.lexists(p) for p in FIXED_PATHS}
            self.cluster = ControlPlane(self.kubectl_bin, self.helm_bin, node_address=GATEWAY)
            self._write_owner()
            self.log_dir.mkdir()
            self._bridge_up()
            self.cluster.start()
            t = time.monotonic()
            self._start_registry()
            self.timings["registry_and_images_s"], t = time.monotonic() - t, time.monotonic()
            self._start_containerd()
            self._start_kubelet()
            self.timings["containerd_and_kubelet_to_ready_s"], t = time.monotonic() - t, time.monotonic()
            self._log_keeper = threading.Thread(target=self._keep_logs_loop, name="keep-pod-logs", daemon=True)
            self._log_keeper.start()
            if self.app_image:
                self.pull(self.app_ref)
                self.timings["app_image_pull_s"], t = time.monotonic() - t, time.monotonic()
            self._start_kube_proxy()
            self._start_coredns()
            self.timings["kube_proxy_and_coredns_s"] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _write_owner(self) -> None:
        record = {
            "pid": os.getpid(),
            "start": process_start(os.getpid()),
            "sysctls": self.sysctls,
            "existed": self.existed,
            "cluster_root": str(self.cluster.root),
        }
        tmp = self.root / f"{OWNER_FILE}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.rename(self.root / OWNER_FILE)

    @staticmethod
    def reclaim(root: Path) -> list[str]:
        """Removes what the killed node of state folder `root` left (its pods' processes, mounts, the bridge,
        cgroups and nftables tables; its control plane's folder) and restores the host as recorded before it
        started; what is still left. Its own processes died with it (controlplane.spawn)."""
        owner = json.loads((root / OWNER_FILE).read_text())
        print(f"\nreclaiming the node of a killed run: {root} (its test process {owner['pid']} is gone)")
        dead = Node("", "", root=root, sysctls=owner["sysctls"], existed=owner["existed"])
        dead._clear_host()
        shutil.rmtree(owner["cluster_root"], ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        return dead.leftovers()

    @staticmethod
    def _in_use() -> list[str]:
        found = [f"bridge {BRIDGE}"] if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0 else []
        found += [f"cgroup {m / 'kubepods'}" for m in cgroup_mounts() if (m / "kubepods").exists()]
        tables = sh("nft", "list", "tables", check=False).stdout
        return found + [f"nft table {f} {t}" for f, t in NFT_TABLES if f"table {f} {t}\n" in tables + "\n"]

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.procs[name] = spawn(self.log_dir, name, argv, self.root, env)

    def log_tail(self, name: str) -> str:
        return log_tail(self.log_dir, name)

    def wait(self, name: str, ready, what: str, timeout: float = READY_TIMEOUT_S) -> None:
        wait_for(self.procs[name], self.log_dir, name, ready, what, timeout)

    def _bridge_up(self) -> None:
        """The bridge exists before the API server, which serves on its address (pods reach it there). The
        bridge plugin reuses it (isGateway false: it would turn on the global ip_forward). Forwarding is on
        for this one interface only: a pod's packet to a ClusterIP comes in here and, DNATed by kube-proxy to
        another pod, goes out here again."""
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        sysctl_path(f"net.ipv4.conf.{BRIDGE}.forwarding").write_text("1")

    def _start_registry(self) -> None:
        """The registry `make image` pushed the project's image to (started here unless it runs; stopped at the
        end only then), with the node's own two images pushed next to it."""
        out = image.registry("start")
        self.registry_started = out["REGISTRY_STARTED"] == "1"
        self.registry = out["REGISTRY"].replace("127.0.0.1", "localhost")  # the plain-HTTP name images carry
        out = sh("bash", str(NODE_TOOLS / "images.sh"), str(self.root / "images"), self.registry, timeout=300)
        self.images = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)

    def _start_containerd(self) -> None:
        r = self.root
        hosts = r / "certs.d" / self.registry
        hosts.mkdir(parents=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{self.registry}"\n[host."http://{self.registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n  skip_verify = true\n'
        )
        (r / "cni" / "net.d").mkdir(parents=True)
        (r / "cni" / "net.d" / "10-ftnode.conflist").write_text(json.dumps(cni_config(r / "cni" / "ipam")))
        (r / "containerd.toml").write_text(containerd_config(r, self.images["PAUSE"]))
        self.spawn("containerd", ["containerd", "--config", str(r / "containerd.toml")])
        self.wait("containerd", lambda: self.ctr("version").returncode == 0, "its socket")

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        return sh("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args, check=False)

    def _client(self, name: str, subject: str) -> Path:
        """A client certificate and kubeconfig for a node component."""
        cp = self.cluster
        sign_leaf(cp.pki, name, subject, "clientAuth")
        return kubeconfig(
            self.root / f"{name}.kubeconfig",
            cp.server,
            cp.pki / "ca.crt",
            cert=cp.pki / f"{name}.crt",
            key=cp.pki / f"{name}.key",
        )

    def _start_kubelet(self) -> None:
        cp, r = self.cluster, self.root
        sign_leaf(cp.pki, "kubelet-serving", f"/CN={NODE_NAME}", "serverAuth", f"IP:{GATEWAY},DNS:{NODE_NAME}")
        cfg = self._client("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}")
        (r / "resolv.conf").write_text("")  # pods get the cluster's search path only, not this machine's
        (r / "kubelet.yaml").write_text(json.dumps(kubelet_config(r, cp.pki, free_port(), free_port())))
        self.spawn(
            "kubelet",
            [
                str(Path(cp.versions["KUBERNETES"]) / "kubelet"),
                *("--config", str(r / "kubelet.yaml"), "--kubeconfig", str(cfg), "--root-dir", str(r / "kubelet")),
                *("--hostname-override", NODE_NAME, "--node-ip", GATEWAY, "--cert-dir", str(r / "kubelet-pki")),
            ],
        )

        def ready() -> bool:
            node = cp.kubectl_json("get", "node", NODE_NAME)
            return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

        self.wait("kubelet", ready, f"node {NODE_NAME} Ready")

    def _start_kube_proxy(self) -> None:
        cp, r = self.cluster, self.root
        cfg = self._client("kube-proxy", "/CN=system:kube-proxy")  # bound to system:node-proxier by default
        health = free_port()
        (r / "kube-proxy.yaml").write_text(json.dumps(kube_proxy_config(cfg, health)))
        self.spawn(
            "kube-proxy", [str(Path(cp.versions["KUBERNETES"]) / "kube-proxy"), "--config", str(r / "kube-proxy.yaml")]
        )
        self.wait(
            "kube-proxy",
            lambda: sh("curl", "-fs", f"http://127.0.0.1:{health}/healthz", check=False).returncode == 0,
            "/healthz",
        )

    def _start_coredns(self) -> None:
        cp, r = self.cluster, self.root
        cp.kubectl("apply", "-f", "-", stdin=json.dumps(coredns_objects()))
        cfg = self._client("coredns", "/CN=system:coredns")
        ready = free_port()
        (r / "Corefile").write_text(corefile(cfg, free_port(), ready))
        self.spawn("coredns", [str(Path(cp.versions["COREDNS"]) / "coredns"), "-conf", str(r / "Corefile")])
        self.wait(
            "coredns",
            lambda: sh("curl", "-fs", f"http://127.0.0.1:{ready}/ready", check=False).returncode == 0,
            "/ready",
        )

    # --- what the tests use --------------------------------------------------------------------------------

    @property
    def app_ref(self) -> str:
        """The project's image by digest: exactly the build `make image` recorded."""
        return f"{self.app_image['IMAGE'].rsplit(':', 1)[0]}@{self.app_image['IMAGE_DIGEST']}"

    def image_sets(self) -> list[str]:
        """The chart's values (for helm --set) that point it at the project's image in the local registry."""
        repository, digest = self.app_ref.split("@")
        return [f"image.repository={repository}", f"image.digest={digest}"]

    @property
    def gateway(self) -> str:
        """The host's address on the pod network: a service on the host listening there is reachable from pods."""
        return GATEWAY

    def pull(self, ref: str) -> None:
        """The image into containerd's store, as the kubelet's first pull would put it there (unpacked): the
        first pod that needs it then starts without a multi-gigabyte pull inside a test's time limit. Refuses,
        before pulling, a disk without room for it; afterwards drops the compressed layers, which containers never
        read again (the kubelet's own pulls do the same through containerd's discard_unpacked_layers)."""
        layers = self._manifest(ref)["layers"]
        packed = sum(layer["size"] for layer in layers)
        need = PULL_ROOM_FACTOR * packed + PULL_SPARE_BYTES
        free = shutil.disk_usage(self.root).free
        if free < need:
            raise NodeError(
                f"{self.root} has {free / 1e9:.1f} GB free; the node needs about {need / 1e9:.1f} GB there for "
                f"{ref} ({packed / 1e9:.1f} GB compressed, unpacked beside it): free some disk space "
                "(earlier image builds are pruned by `make image`; stale /tmp/ftnode-* state of a killed run too)"
            )
        ctr = ("ctr", "--address", str(self.socket), "--namespace", "k8s.io")
        sh(*ctr, "images", "pull", "--plain-http", "--hosts-dir", str(self.root / "certs.d"), ref, timeout=900)
        sh(*ctr, "content", "rm", *(layer["digest"] for layer in layers))

    def _manifest(self, ref: str) -> dict:
        """The image manifest of `ref` (localhost:PORT/NAME@DIGEST) from the local registry."""
        name, digest = ref.split("/", 1)[1].split("@")
        request = urllib.request.Request(
            f"http://{self.registry.replace('localhost', '127.0.0.1')}/v2/{name}/manifests/{digest}",
            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json, "
                     "application/vnd.oci.image.manifest.v1+json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def admit(self, ns: str) -> None:
        """The pods that namespace `ns` creates from now on may run on this node (its default toleration of the
        node's taint)."""
        toleration = {"operator": "Equal", **TAINT}
        self.cluster.kubectl(
            "annotate", "namespace", ns, f"scheduler.alpha.kubernetes.io/defaultTolerations={json.dumps([toleration])}"
        )

    def claim_dir(self, ns: str, claim: str) -> Path:
        """A PersistentVolume for the claim `ns/claim`, bound to it ahead (claimRef), as a cluster's provisioner
        would; its folder is of group IMAGE_GID, mode 2770: the pods (uid 1000) write through their group, nobody
        else may. Returns the folder."""
        folder = self.root / "volumes" / f"{ns}-{claim}"
        folder.mkdir(parents=True)
        os.chown(folder, 0, IMAGE_GID)
        folder.chmod(0o2770)
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{ns}-{claim}"[:63]},
            "spec": {
                "capacity": {"storage": "1Ti"},
                "accessModes": ["ReadWriteMany", "ReadWriteOnce"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "claimRef": {"namespace": ns, "name": claim},
                "hostPath": {"path": str(folder), "type": "Directory"},
            },
        }
        self.cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pv))
        return folder

    def logs(self, ns: str) -> str:
        """Every container's output in namespace `ns` since the node started, of deleted pods too, oldest file
        first, each under a header naming pod and container."""
        self._keep_logs()
        files = sorted((self.root / "kept-logs").glob(f"{ns}_*/*/*.log"), key=lambda f: f.stat().st_mtime)
        return "\n".join(
            f"=== pod {f.parts[-3].split('_')[1]}, container {f.parts[-2]} (run {f.stem}) ===\n{cri_text(f)}"
            for f in files
        )

    def _keep_logs_loop(self) -> None:
        while not self._stopping.wait(KEEP_LOGS_EVERY_S):
            self._keep_logs()

    def _keep_logs(self) -> None:
        """Hard-links every container log file the kubelet writes into kept-logs/: the kubelet removes a pod's logs
        with the pod, and a test reads what a deleted pod said. A link, not a copy, so that the last lines of a pod
        deleted right after it printed them (a RayJob's submitter on a retry) are kept too: the file stays whole
        under the second name, written to the end. A log rotated to a new file gets its own link (0.1.log, ...)."""
        src, dst = self.root / "pod-logs", self.root / "kept-logs"
        with self._logs_lock:
            for f in src.glob("*/*/*.log"):
                rel = f.relative_to(src)
                try:
                    inode = f.stat().st_ino
                except FileNotFoundError:
                    continue  # removed with its pod meanwhile
                kept = self._kept_logs.setdefault(rel, [])
                if inode in kept:
                    continue
                target = dst / rel if not kept else dst / rel.parent / f"{rel.stem}.{len(kept)}.log"
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(f, target)  # both folders are under the node's root: one file system
                except FileNotFoundError:
                    continue  # removed meanwhile (or rotated: the next call links the new file)
                kept.append(target.stat().st_ino)

    @staticmethod
    def pod_pids(uid: str) -> list[int]:
        """The processes in the cgroups of the pod with this uid (empty once they are all gone)."""
        return sorted(pid for pod in pod_cgroups(uid) for pid in cgroup_pids(pod))

    @staticmethod
    def memory_peak(uid: str) -> int:
        """The most memory the pod with this uid has used (its memory cgroup's high-water mark), in bytes."""
        for pod in pod_cgroups(uid):
            for name in ("memory.max_usage_in_bytes", "memory.peak"):  # cgroup v1, v2
                if (pod / name).exists():
                    return int((pod / name).read_text())
        return 0

    def pods_running(self, ns: str, title: str) -> list[str]:
        """The pods of `ns` with a process whose command line starts with `title` (e.g. Ray's process title
        ray::RayTrainWorker)."""
        names = []
        for pod in self.cluster.kubectl_json("get", "pods", "-n", ns)["items"]:
            for pid in self.pod_pids(pod["metadata"]["uid"]):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if argv.startswith(title):
                    names.append(pod["metadata"]["name"])
                    break
        return names

    # --- teardown ------------------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stops everything, restores what this changed outside the state folder; what is left (empty when
        all went). Safe to call twice. Ctrl-C and SIGTERM wait until it is done (its waits are bounded): a
        teardown cut short would leave the machine half restored."""
        if self.stopped:
            return self.leftovers()
        self.stopped = True
        signals = (signal.SIGINT, signal.SIGTERM)
        main = threading.current_thread() is threading.main_thread()
        previous = [signal.signal(s, signal.SIG_IGN) for s in signals] if main else []
        try:
            return self._stop()
        finally:
            for s, handler in zip(signals, previous, strict=False):
                signal.signal(s, handler)

    def _stop(self) -> list[str]:
        t0 = time.monotonic()
        self._stopping.set()
        if self._log_keeper:
            self._log_keeper.join(timeout=30)  # its copy in progress ends before the state folder goes
        if self.cluster and "kubelet" in self.procs:
            self._drain()
        for name in ("kubelet", "kube-proxy", "coredns"):
            self._stop_proc(name)
        self._kill_containers()
        self._stop_proc("containerd")
        self._clear_host()
        for name in list(self.procs):
            self._stop_proc(name)
        if self.registry_started:
            image.registry("stop")
            self.registry_started = False
        if self.cluster:
            self.cluster.stop()
        keep = os.environ.get("FINETUNE_E2E_LOGS")
        if keep and self.log_dir.exists():
            shutil.copytree(self.log_dir, Path(keep) / "node", dirs_exist_ok=True)
        if keep and (self.root / "kept-logs").exists():
            shutil.copytree(self.root / "kept-logs", Path(keep) / "pods", dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
        self.timings["teardown_s"] = time.monotonic() - t0
        return self.leftovers()

    def _drain(self) -> None:
        """Deletes every pod through the API server, so the kubelet stops them the normal way (CNI DEL, netns
        removed), and waits until containerd runs none."""
        self.cluster.kubectl("delete", "pods", "--all", "-A", "--grace-period=1", "--wait=false", check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.ctr("tasks", "ls", "-q").stdout.strip():
            time.sleep(0.5)

    def _kill_containers(self) -> None:
        """What the drain did not stop: its tasks killed and deleted through containerd itself."""
        if self.procs.get("containerd") is None or self.procs["containerd"].poll() is not None:
            return
        for task in self.ctr("tasks", "ls", "-q").stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task)
        time.sleep(0.5)
        for task in self.ctr("tasks", "ls", "-q").stdout.split():
            self.ctr("tasks", "delete", "-f", task)

    def _stop_proc(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        kill_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(proc, signal.SIGKILL)
            proc.wait()

    def _clear_host(self) -> None:
        """With containerd and the kubelet stopped: what their containers left running or mounted goes, and
        the host is restored."""
        for pid in [*shim_pids(self.socket), *kubepods_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10  # a killed process leaves its cgroup when it is gone, not at the signal
        while kubepods_pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        for point in mounts_under(self.root):
            sh("umount", "-l", point, check=False)
        self._restore_host()

    def _restore_host(self) -> None:
        for family, table in NFT_TABLES:
            sh("nft", "delete", "table", family, table, check=False)
        for veth in sh("ip", "-o", "link", "show", "master", BRIDGE, check=False).stdout.splitlines():
            sh("ip", "link", "delete", veth.split(":")[1].strip().split("@")[0], check=False)
        sh("ip", "link", "delete", BRIDGE, check=False)
        for mount in cgroup_mounts():
            top = mount / "kubepods"
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):  # still busy: leftovers() names it
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
        for key, value in self.sysctls.items():
            sysctl_path(key).write_text(value)
        for path, existed in self.existed.items():
            if not existed:
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree("/var/lib/kubelet/device-plugins", ignore_errors=True)
        shutil.rmtree("/var/lib/cni/results", ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What this node could have left on the machine; empty when nothing."""
        found = [f"process {name}" for name, p in self.procs.items() if p.poll() is None]
        found += [f"containerd shim pid {pid}" for pid in shim_pids(self.socket)]
        found += [f"pod process pid {pid}" for pid in kubepods_pids()]
        found += [f"mount {m}" for m in mounts_under(self.root)]
        found += [f"cgroup {m / 'kubepods'}" for m in cgroup_mounts() if (m / "kubepods").exists()]
        if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
            found.append(f"bridge {BRIDGE}")
        found += [
            f"nft table {f} {t}" for f, t in NFT_TABLES if sh("nft", "list", "table", f, t, check=False).returncode == 0
        ]
        found += [
            f"sysctl {k}={sysctl_path(k).read_text().strip()} (was {v})"
            for k, v in self.sysctls.items()
            if sysctl_path(k).read_text().strip() != v
        ]
        found += [f"path {p}" for p, existed in self.existed.items() if not existed and os.path.lexists(p)]
        found += [
            f"path {p}" for p in ("/var/lib/kubelet/device-plugins", "/var/lib/cni/results") if os.path.lexists(p)
        ]
        if self.root.exists():
            found.append(f"state folder {self.root}")
        return found


def cri_text(path: Path) -> str:
    """A container log file of the kubelet (CRI format: `TIME STREAM P|F TEXT`, P a part of a longer line) as the
    container wrote it."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        out.append(parts[3] if len(parts) == 4 else "")
        if parts[2] == "F":
            out.append("\n")
    return "".join(out)


# --- configuration -----------------------------------------------------------------------------------------


def containerd_config(root: Path, pause_image: str) -> str:
    """containerd 1.6's config: all state under `root`. restrict_oom_score_adj: root here lacks
    CAP_SYS_RESOURCE, and the sandbox's oom_score_adj of -998 fails every pod in runc without it. The `opt`
    plugin is off: it would create /opt/containerd."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}/containerd/root"
state = "{root}/containerd/state"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{root}/containerd.sock"
[{cri}]
  sandbox_image = "{pause_image}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{root}/runc"
[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{root}/cni/net.d"
[{cri}.registry]
  config_path = "{root}/certs.d"
"""


def cni_config(ipam_dir: Path) -> dict:
    """The bridge plugin on BRIDGE, addresses from host-local (its allocations under the state folder), a
    default route through the bridge address, where kube-proxy's rules take ClusterIP traffic."""
    ipam = {
        "type": "host-local",
        "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]],
        "routes": [{"dst": "0.0.0.0/0", "gw": GATEWAY}],
        "dataDir": str(ipam_dir),
    }
    bridge = {
        "type": "bridge",
        "bridge": BRIDGE,
        "isGateway": False,
        "ipMasq": False,
        "hairpinMode": True,
        "ipam": ipam,
    }
    return {"cniVersion": "1.0.0", "name": "ftnode", "plugins": [bridge]}


def kubelet_config(root: Path, pki: Path, port: int, health: int) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,  # these machines mount cgroup v1 controllers; the kubelet warns and runs
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{root}/containerd.sock",
        "address": GATEWAY,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": health,
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "makeIPTablesUtilChains": False,
        "podLogsDir": str(root / "pod-logs"),
        "containerLogMaxSize": "200Mi",  # no rotation within a session: Node.logs() follows each file by offset
        "registerWithTaints": [TAINT],
        "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%", "memory.available": "100Mi"},
        # The developer's disk is often over the default 85% in use: image GC would then delete the pulled image
        # between two tests, and the next pod would pull it again inside its test's time limit.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "clusterDomain": "cluster.local",
        "clusterDNS": [CLUSTER_DNS],
        "resolvConf": str(root / "resolv.conf"),
        "serializeImagePulls": False,
    }


def kube_proxy_config(kubeconfig_path: Path, health: int) -> dict:
    """nftables mode: its rules live in tables of its own (NFT_TABLES), removed whole at teardown. conntrack
    zeros: leave the machine's conntrack sysctls alone. masqueradeAll: a pod reaching another through a
    ClusterIP gets its reply back through the host even where bridged traffic skips netfilter."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "mode": "nftables",
        "hostnameOverride": NODE_NAME,
        "bindAddress": GATEWAY,
        "healthzBindAddress": f"127.0.0.1:{health}",
        "metricsBindAddress": f"127.0.0.1:{free_port()}",
        "clusterCIDR": SUBNET,
        "nodePortAddresses": [f"{GATEWAY}/32"],
        "masqueradeAll": True,
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def corefile(kubeconfig_path: Path, health: int, ready: int) -> str:
    """CoreDNS answers for cluster.local on the bridge address (behind the kube-dns Service), nothing else:
    no forwarder, as no outside resolver may be reached."""
    return f""".:53 {{
    bind {GATEWAY}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig_path} e2e
        pods insecure
        ttl 5
    }}
    cache 5
}}
"""


def coredns_objects() -> dict:
    """CoreDNS's read access (as on a kubeadm cluster), and the kube-dns Service at CLUSTER_DNS with one
    endpoint: CoreDNS on the bridge address."""
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "system:coredns"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["endpoints", "services", "pods", "namespaces"],
                "verbs": ["list", "watch"],
            },
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "system:coredns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}],
    }
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
        "spec": {"clusterIP": CLUSTER_DNS, "ports": [{**p, "targetPort": 53} for p in ports]},
    }
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-host",
            "namespace": "kube-system",
            "labels": {"kubernetes.io/service-name": "kube-dns", "endpointslice.kubernetes.io/managed-by": "e2e-node"},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": True}}],
        "ports": ports,
    }
    return {"apiVersion": "v1", "kind": "List", "items": [role, binding, service, endpoints]}
