"""The real node (tests/e2e/node.py): pods run by a kubelet and containerd from an image built here.

In a namespace enforcing Pod Security "restricted": a pod pulled from the local registry (imagePullPolicy
Always) runs as uid 1000 with a read-only root, no effective capabilities, no_new_privs and seccomp filtering
(read from /proc/self/status inside it); `kubectl logs` and `exec` go through the kubelet; Service names
resolve through CoreDNS and ClusterIPs (`kubernetes` included) answer through kube-proxy; a hostPath
PersistentVolume bound to a claim is writable through fsGroup only; a graceful delete delivers SIGTERM.
The session's teardown must leave nothing behind (tests/e2e/conftest.py), and what a killed run left is
reclaimed by the next one (tested first, before the session's node starts). Part of `make e2e` (alone:
`make e2e-node`), whose training pods run on the same node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from e2e.node import (
    BRIDGE,
    OWNER_FILE,
    Node,
    cgroup_mounts,
    mounts_under,
    process_start,
    sh,
    stale_nodes,
    sysctl_path,
)

pytestmark = pytest.mark.e2e
NS = "node-restricted"
UID, GID, FS_GROUP = 1000, 3000, 2000  # the claim's folder is writable by group FS_GROUP only
# The probe pod's main process: what it is allowed, on its log; SIGTERM leaves a mark on the claim.
PROBE_SCRIPT = """
echo "id: $(id)"
if touch /rootfs-write 2>/dev/null; then echo "rootfs: writable"; else echo "rootfs: read-only"; fi
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status
trap 'echo "SIGTERM at $(date +%s)" > /data/sigterm; exit 0' TERM
echo probe-ready
while true; do sleep 1 & wait $!; done
"""
ECHO_SCRIPT = "mkdir -p /tmp/www && echo hello-from-echo > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"


def sleeper(argv0: str, *args: str) -> subprocess.Popen:
    """A process named `argv0` (with `args` on its command line) that sleeps, in a session of its own."""
    code = "import time; time.sleep(600)"
    return subprocess.Popen([argv0, "-c", code, *args], executable=sys.executable, start_new_session=True)


@pytest.mark.before_node
def test_a_killed_runs_node_is_reclaimed_and_a_live_ones_is_not(tmp_path):
    """What a node killed outright leaves (a container's shim and process in the kubepods cgroups, a volume
    mount, the bridge, kube-proxy's tables, a rewritten sysctl, a path the kubelet made, the control plane's
    folder) is staged by hand, with an owner record whose process is gone: the next start reclaims it all."""
    for earlier in stale_nodes():  # a killed earlier run's, as the session's node start would
        Node.reclaim(earlier)
    assert not Node._in_use(), "a node is up: this test runs before the session's node starts"
    panic = "kernel.panic"
    panic_before = sysctl_path(panic).read_text().strip()
    root = Path(tempfile.mkdtemp(prefix="ftnode-"))
    cluster_root = Path(tempfile.mkdtemp(prefix="finetune-e2e-"))
    made = tmp_path / "var-lib-kubelet"
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"pid": gone.pid, "start": "0", "sysctls": {panic: panic_before}, "existed": {str(made): False}}
    (root / OWNER_FILE).write_text(json.dumps({**record, "cluster_root": str(cluster_root)}))
    live = Path(tempfile.mkdtemp(prefix="ftnode-"))
    (live / OWNER_FILE).write_text(json.dumps({**record, "pid": os.getpid(), "start": process_start(os.getpid())}))
    procs = [sleeper("containerd-shim-runc-v2", "-address", str(root / "containerd.sock")), sleeper("pod-main")]
    try:
        made.mkdir()
        sysctl_path(panic).write_text(str(int(panic_before) + 7))
        volume = root / "kubelet" / "pods" / "uid" / "volumes" / "dshm"
        volume.mkdir(parents=True)
        sh("mount", "-t", "tmpfs", "tmpfs", str(volume))
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("nft", "add", "table", "ip", "kube-proxy")
        pod_cgroups = [mount / "kubepods" / "podtest" for mount in cgroup_mounts()]
        for folder in pod_cgroups:
            folder.mkdir(parents=True)
        (pod_cgroups[0] / "cgroup.procs").write_text(str(procs[1].pid))
        assert len(Node._in_use()) >= 3, Node._in_use()

        stale = stale_nodes()
        assert root in stale and live not in stale, stale
        assert Node.reclaim(root) == []
        assert not Node._in_use()
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL] * 2
        assert sysctl_path(panic).read_text().strip() == panic_before
        assert not made.exists() and not root.exists() and not cluster_root.exists()
        assert live.exists(), "a live run's node was touched"
    finally:
        for p in procs:
            p.kill()
        Node("", "", root=root, sysctls={panic: panic_before})._clear_host()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)
    assert not mounts_under(root)


@pytest.fixture(scope="module")
def node(real_node):
    print(f"\nnode: {json.dumps({k: round(v, 1) for k, v in real_node.timings.items()})}")
    return real_node


def security(container: dict | None = None) -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        **(container or {}),
    }


def pod(name: str, image: str, script: str, **spec) -> dict:
    volumes = spec.pop("volumes", [])
    mounts = spec.pop("mounts", [])
    container = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "Always",
        "command": ["/bin/sh", "-c", script],
        "securityContext": security(),
        "resources": {"limits": {"cpu": "200m", "memory": "64Mi"}},
        "volumeMounts": mounts,
        **spec.pop("container", {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
        "spec": {
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": GID,
                "fsGroup": FS_GROUP,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": volumes,
            **spec,
        },
    }


def storage(host_dir: Path) -> list[dict]:
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": "node-e2e-data"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "node-e2e-hostpath",
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(host_dir), "type": "Directory"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data", "namespace": NS},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "node-e2e-hostpath",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [pv, pvc]


def services() -> list[dict]:
    def svc(name: str, port: int, **spec) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": port, "targetPort": 8080}], **spec},
        }

    # echo-headless resolves to the pod's IP, as KubeRay's head Service does.
    return [svc("echo", 80), svc("echo-headless", 8080, clusterIP="None")]


@pytest.fixture(scope="module")
def workload(node):
    """The restricted namespace, the claim on a host folder of group FS_GROUP (mode 2770: nobody else may
    write), an echo server behind two Services, and the probe pod; the seconds the probe took to Ready."""
    cp = node.cluster
    cp.kubectl("create", "namespace", NS)
    cp.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted")
    node.admit(NS)
    host_dir = node.root / "pv"
    host_dir.mkdir()
    os.chown(host_dir, 0, FS_GROUP)
    host_dir.chmod(0o2770)
    image = node.images["BUSYBOX"]
    echo = pod(
        "echo",
        image,
        ECHO_SCRIPT,
        volumes=[{"name": "tmp", "emptyDir": {}}],
        mounts=[{"name": "tmp", "mountPath": "/tmp"}],
        container={"readinessProbe": {"httpGet": {"port": 8080, "path": "/"}, "periodSeconds": 1}},
    )
    probe = pod(
        "probe",
        image,
        PROBE_SCRIPT,
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        mounts=[{"name": "data", "mountPath": "/data"}],
        terminationGracePeriodSeconds=30,
    )
    items = [*storage(host_dir), *services(), echo]
    cp.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
    t0 = time.monotonic()
    cp.kubectl("apply", "-f", "-", stdin=json.dumps(probe))
    out = cp.kubectl("wait", "-n", NS, "--for=condition=Ready", "pod/probe", "pod/echo", "--timeout=90s", check=False)
    if out.returncode:
        events = cp.kubectl("get", "events", "-n", NS, "--sort-by=.lastTimestamp", check=False).stdout
        pytest.fail(f"pods not Ready: {out.stderr}\n{events}\nkubelet:\n{node.log_tail('kubelet')}")
    yield {"host_dir": host_dir, "probe_ready_s": time.monotonic() - t0}
    cp.kubectl("delete", "namespace", NS, "--wait=false", check=False)  # its CPU requests leave the node


def exec_probe(node, *argv: str) -> str:
    return node.cluster.kubectl("exec", "-n", NS, "probe", "--", *argv, timeout=60).stdout


def test_restricted_pod_runs_confined_and_logs_through_the_kubelet(node, workload):
    print(f"\nprobe pod: created to Ready in {workload['probe_ready_s']:.1f} s (image pulled: imagePullPolicy Always)")
    log = node.cluster.kubectl("logs", "-n", NS, "probe").stdout
    assert f"uid={UID}" in log and f"gid={GID}" in log and str(FS_GROUP) in log, log
    assert "rootfs: read-only" in log, log
    status = dict(re.findall(r"^(CapEff|NoNewPrivs|Seccomp):\s*(\S+)", log, re.M))
    assert status == {"CapEff": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}, log
    p = node.cluster.kubectl_json("get", "pod", "-n", NS, "probe")
    assert p["status"]["containerStatuses"][0]["imageID"].startswith(node.images["BUSYBOX"].rsplit(":", 1)[0])


def test_pod_security_restricted_refuses_a_root_pod(node, workload):
    root_pod = pod("root", node.images["BUSYBOX"], "id")
    root_pod["spec"]["securityContext"] = {"runAsUser": 0}
    out = node.cluster.kubectl("apply", "-f", "-", stdin=json.dumps(root_pod), check=False)
    assert out.returncode and "violates PodSecurity" in out.stderr, out.stderr


def resolve(node, name: str) -> list[str]:
    out = exec_probe(node, "nslookup", name)
    return re.findall(r"^Address:\s*(\d+\.\d+\.\d+\.\d+)$", out.split("Name:", 1)[-1], re.M)


def test_service_names_resolve_through_coredns_and_cluster_ips_answer(node, workload):
    cp = node.cluster
    echo_ip = cp.kubectl_json("get", "service", "-n", NS, "echo")["spec"]["clusterIP"]
    pod_ip = cp.kubectl_json("get", "pod", "-n", NS, "echo")["status"]["podIP"]
    assert resolve(node, f"echo.{NS}.svc.cluster.local") == [echo_ip]
    assert resolve(node, f"echo-headless.{NS}.svc.cluster.local") == [pod_ip]
    assert resolve(node, "kubernetes.default.svc.cluster.local") == ["10.96.0.1"]
    resolv = exec_probe(node, "cat", "/etc/resolv.conf")
    assert "nameserver 10.96.0.10" in resolv and f"search {NS}.svc.cluster.local" in resolv, resolv
    # Through kube-proxy: a pod behind a ClusterIP, and the API server behind `kubernetes`. busybox's TLS
    # shares no cipher suite with the API server, so plain HTTP to its TLS port: Go's answer names it.
    assert exec_probe(node, "wget", "-q", "-O", "-", f"http://{echo_ip}/").strip() == "hello-from-echo"
    answer = exec_probe(node, "sh", "-c", "printf 'GET /version HTTP/1.0\\r\\n\\r\\n' | nc -w 5 10.96.0.1 443")
    assert "Client sent an HTTP request to an HTTPS server" in answer, answer


def test_claim_is_writable_through_fs_group(node, workload):
    exec_probe(node, "sh", "-c", "echo written-in-pod > /data/probe.txt")
    written = workload["host_dir"] / "probe.txt"
    assert written.read_text() == "written-in-pod\n"
    assert (written.stat().st_uid, written.stat().st_gid) == (UID, FS_GROUP)  # the folder's setgid: group FS_GROUP


def test_graceful_delete_delivers_sigterm(node, workload):
    t0 = time.monotonic()
    node.cluster.kubectl("delete", "pod", "-n", NS, "probe", "--wait=true", timeout=90)
    took = time.monotonic() - t0
    mark = workload["host_dir"] / "sigterm"
    assert mark.exists() and mark.read_text().startswith("SIGTERM at"), "the pod's TERM trap did not run"
    assert took < 25, f"deleting took {took:.0f} s: the pod did not exit on SIGTERM"
    print(f"\nprobe pod: graceful delete done in {took:.1f} s")
