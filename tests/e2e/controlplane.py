"""A real Kubernetes control plane and the real KubeRay operator on loopback, for the tests marked `e2e`.

etcd, kube-apiserver (TLS, RBAC, PodSecurity admission, service-account token signing),
kube-controller-manager (service-account token controller, garbage collector and the other default
controllers), kube-scheduler and the KubeRay operator (its own ClusterRole, a service-account token, one
replica, no leader election), built from source by tools/controlplane/build.sh and cached by version.
No kubelet: pods stay Pending unless a test writes their status through the status subresource.

Every process runs in a process group of its own and dies with its parent (PR_SET_PDEATHSIG); `stop()` kills
the groups, removes the temp folder (certificates, etcd data, logs) and is also registered with atexit, so
nothing is left behind when the suite fails, is interrupted or is killed.
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import k8s_support

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "tools" / "controlplane" / "build.sh"
OPERATOR_NS = "kuberay-system"
OPERATOR_SA = "kuberay-operator"
SERVICE_CIDR = "10.96.0.0/16"
START_TIMEOUT_S = 120
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
KUBELET_CLIENT_USER = "kube-apiserver-kubelet-client"  # the API server's identity towards kubelets
ADMISSION = "NamespaceLifecycle,ServiceAccount,PodSecurity,LimitRanger,ResourceQuota"


class ControlPlaneError(RuntimeError):
    pass


def build() -> dict[str, str]:
    """Runs the build script (a no-op when the binaries are cached); NAME=VALUE lines it prints."""
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(BUILD)], stdout=subprocess.PIPE, text=True)
    if out.returncode:
        raise ControlPlaneError("building the control plane failed (tools/controlplane/build.sh, output above)")
    info = dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
    info["BUILD_SECONDS"] = f"{time.monotonic() - t0:.0f}"
    return info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def spawn(logs: Path, name: str, argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    """Starts `argv` in a process group of its own that dies with this process, output in logs/NAME.log."""
    with open(logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            env=env or os.environ.copy(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def log_tail(logs: Path, name: str, lines: int = 30) -> str:
    path = logs / f"{name}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def wait_for(proc: subprocess.Popen, logs: Path, name: str, ready, what: str, timeout: float) -> None:
    """Polls `ready()` until true; fails with the component's log when it exits or the time runs out. A
    connection refused, a TLS or HTTP error or a failing client command count as not ready yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ControlPlaneError(f"{name} exited ({proc.returncode}) before {what}:\n{log_tail(logs, name)}")
        try:
            if ready():
                return
        except (OSError, ssl.SSLError, http.client.HTTPException, subprocess.SubprocessError, AssertionError):
            pass
        time.sleep(0.3)
    raise ControlPlaneError(f"{name}: no {what} within {timeout:.0f} s:\n{log_tail(logs, name)}")


def openssl(*args: str, cwd: Path) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed: {out.stderr.strip()}")


def sign_leaf(d: Path, name: str, subject: str, usage: str, san: str | None = None) -> None:
    """NAME.key and NAME.crt in `d`, signed by the CA there: `usage` serverAuth or clientAuth, `san` like
    'IP:127.0.0.1,DNS:localhost' for a server."""
    ext = f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage={usage}\n"
    if san:
        ext += f"subjectAltName={san}\n"
    (d / f"{name}.ext").write_text(ext)
    openssl("req", "-new", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    openssl(
        "x509",
        *("-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2"),
        *("-out", f"{name}.crt", "-extfile", f"{name}.ext"),
        cwd=d,
    )


def make_pki(d: Path, address: str = "127.0.0.1") -> None:
    """A CA, the API server's serving certificate for `address` (and loopback), client certificates for the
    admin and the control-plane components (their names are what the default RBAC bindings expect), and the
    key pair that signs service-account tokens."""
    openssl(
        *("req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=finetune-e2e-ca"),
        *("-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"),
        cwd=d,
    )
    names = "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
    sign_leaf(d, "apiserver", "/CN=kube-apiserver", "serverAuth", f"IP:127.0.0.1,IP:{address},IP:10.96.0.1,{names}")
    sign_leaf(d, "admin", "/O=system:masters/CN=e2e-admin", "clientAuth")
    sign_leaf(d, "controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    sign_leaf(d, "scheduler", "/CN=system:kube-scheduler", "clientAuth")
    sign_leaf(d, "apiserver-kubelet-client", f"/CN={KUBELET_CLIENT_USER}", "clientAuth")
    openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=d)
    openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)


def kubeconfig(
    path: Path, server: str, ca: Path, *, cert: Path | None = None, key: Path | None = None, token: str | None = None
) -> Path:
    user: dict = {"token": token} if token else {"client-certificate": str(cert), "client-key": str(key)}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "e2e", "user": user}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": "default"}}],
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


@dataclass
class ControlPlane:
    kubectl_bin: str
    helm_bin: str
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="finetune-e2e-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    # None: loopback only, no kubelet. An address (tests/e2e/node.py's bridge): the API server serves there,
    # the `kubernetes` Service's endpoint is there (pods reach it), and it accepts and calls a real kubelet.
    node_address: str | None = None

    # --- paths and clients ---------------------------------------------------------------------------------

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """Environment for kubectl, helm and `finetune` subprocesses: this cluster, nothing from $HOME."""
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.admin_kubeconfig),
            "HELM_CACHE_HOME": str(self.root / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.root / "helm" / "config"),
            "HELM_DATA_HOME": str(self.root / "helm" / "data"),
        }

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        stdin: str | None = None,
        kubeconfig: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [self.kubectl_bin, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(kubeconfig),
            timeout=timeout,
        )
        if check and out.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
        return out

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess:
        out = subprocess.run([self.helm_bin, *args], capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and out.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
        return out

    # --- life cycle ----------------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        atexit.register(self.stop)
        try:
            self.versions = build()
            bins = Path(self.versions["KUBERNETES"])
            self.pki.mkdir(parents=True)
            (self.root / "logs").mkdir()
            make_pki(self.pki, self.node_address or "127.0.0.1")
            self._start_etcd(bins)
            self._start_apiserver(bins)
            self._start_controllers(bins)
            self._start_operator(Path(self.versions["KUBERAY"]) / "ray-operator")
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        self.procs[name] = spawn(self.root / "logs", name, argv, self.root, env)

    def log_tail(self, name: str) -> str:
        return log_tail(self.root / "logs", name)

    def wait(self, name: str, ready, what: str, timeout: float = START_TIMEOUT_S) -> None:
        wait_for(self.procs[name], self.root / "logs", name, ready, what, timeout)

    def _start_etcd(self, bins: Path) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.spawn(
            "etcd",
            [
                str(bins / "etcd"),
                "--name",
                "e2e",
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                self.etcd_url,
                "--advertise-client-urls",
                self.etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"e2e=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        self.wait("etcd", lambda: http_get(f"127.0.0.1:{client}", "/health") == 200, "health")

    def _node_flags(self) -> list[str]:
        """The API server's flags that differ when a real kubelet joins (tests/e2e/node.py)."""
        if not self.node_address:
            # Loopback cannot be an Endpoints address: the `kubernetes` Service gets none (nothing in-cluster here).
            return [
                "--endpoint-reconciler-type",
                "none",
                "--authorization-mode",
                "RBAC",
                "--enable-admission-plugins",
                ADMISSION,
            ]
        p = self.pki
        return [
            # PodTolerationRestriction: a namespace's default tolerations (node.py's taint) reach its pods.
            *("--authorization-mode", "Node,RBAC"),
            *("--enable-admission-plugins", f"{ADMISSION},NodeRestriction,PodTolerationRestriction"),
            *("--kubelet-client-certificate", str(p / "apiserver-kubelet-client.crt")),
            *("--kubelet-client-key", str(p / "apiserver-kubelet-client.key")),
            *("--kubelet-certificate-authority", str(p / "ca.crt"), "--kubelet-preferred-address-types", "InternalIP"),
        ]

    def _start_apiserver(self, bins: Path) -> None:
        port = free_port()
        address = self.node_address or "127.0.0.1"
        self.server = f"https://{address}:{port}"
        p = self.pki
        self.spawn(
            "kube-apiserver",
            [
                str(bins / "kube-apiserver"),
                "--etcd-servers",
                self.etcd_url,
                "--bind-address",
                address,
                "--advertise-address",
                address,
                "--secure-port",
                str(port),
                *self._node_flags(),
                "--tls-cert-file",
                str(p / "apiserver.crt"),
                "--tls-private-key-file",
                str(p / "apiserver.key"),
                "--client-ca-file",
                str(p / "ca.crt"),
                "--service-account-issuer",
                "https://kubernetes.default.svc.cluster.local",
                "--service-account-key-file",
                str(p / "sa.pub"),
                "--service-account-signing-key-file",
                str(p / "sa.key"),
                "--service-cluster-ip-range",
                SERVICE_CIDR,
                "--allow-privileged=false",
                "--profiling=false",
                "--cert-dir",
                str(self.root / "apiserver-certs"),
            ],
        )
        kubeconfig(self.admin_kubeconfig, self.server, p / "ca.crt", cert=p / "admin.crt", key=p / "admin.key")
        ctx = ssl.create_default_context(cafile=str(p / "ca.crt"))
        ctx.load_cert_chain(str(p / "admin.crt"), str(p / "admin.key"))
        self.wait("kube-apiserver", lambda: https_get(f"{address}:{port}", "/readyz", ctx) == 200, "/readyz")
        if self.node_address:
            # Without it the kubelet refuses the API server (logs, exec, port-forward): Forbidden nodes/proxy.
            self.kubectl(
                "create",
                "clusterrolebinding",
                "e2e-kubelet-api-admin",
                "--clusterrole",
                "system:kubelet-api-admin",
                "--user",
                KUBELET_CLIENT_USER,
            )

    def _start_controllers(self, bins: Path) -> None:
        p = self.pki
        for name in ("controller-manager", "scheduler"):
            kubeconfig(
                self.root / f"{name}.kubeconfig",
                self.server,
                p / "ca.crt",
                cert=p / f"{name}.crt",
                key=p / f"{name}.key",
            )
        self.spawn(
            "kube-controller-manager",
            [
                str(bins / "kube-controller-manager"),
                "--kubeconfig",
                str(self.root / "controller-manager.kubeconfig"),
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=true",
                "--service-account-private-key-file",
                str(p / "sa.key"),
                "--root-ca-file",
                str(p / "ca.crt"),
                "--cluster-signing-cert-file",
                str(p / "ca.crt"),
                "--cluster-signing-key-file",
                str(p / "ca.key"),
                "--service-cluster-ip-range",
                SERVICE_CIDR,
                "--controllers",
                "*",
            ],
        )
        self.spawn(
            "kube-scheduler",
            [
                str(bins / "kube-scheduler"),
                "--kubeconfig",
                str(self.root / "scheduler.kubeconfig"),
                "--leader-elect=false",
                "--secure-port=0",
            ],
        )
        # The service-account controller creating `default` in every namespace proves the controller-manager runs.
        self.wait(
            "kube-controller-manager",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            "default ServiceAccount",
        )

    def _start_operator(self, binary: Path) -> None:
        module = k8s_support.operator_module_dir()  # the version the binary was built from
        self.kubectl("apply", "--server-side", "-f", str(module / "config" / "crd" / "bases"), timeout=180)
        self.kubectl("create", "namespace", OPERATOR_NS)
        self.kubectl(
            "apply",
            "-n",
            OPERATOR_NS,
            "-f",
            str(module / "config" / "rbac" / "service_account.yaml"),
            "-f",
            str(module / "config" / "rbac" / "role.yaml"),
        )
        self.kubectl(
            "create",
            "clusterrolebinding",
            "kuberay-operator",
            "--clusterrole",
            "kuberay-operator",
            "--serviceaccount",
            f"{OPERATOR_NS}:{OPERATOR_SA}",
        )
        token = self.kubectl("create", "token", OPERATOR_SA, "-n", OPERATOR_NS, "--duration", "24h").stdout.strip()
        cfg = kubeconfig(self.root / "operator.kubeconfig", self.server, self.pki / "ca.crt", token=token)
        probe = free_port()
        self.spawn(
            "kuberay-operator",
            [
                str(binary),
                "--enable-leader-election=false",
                "--metrics-addr",
                "0",
                "--health-probe-bind-address",
                f"127.0.0.1:{probe}",
                "--log-stdout-encoder",
                "console",
                # Out of the cluster's network (no DNS for Services here): reach each
                # head's dashboard through the API server's service proxy.
                "--use-kubernetes-proxy",
            ],
            env={**os.environ, "KUBECONFIG": str(cfg)},
        )
        self.wait("kuberay-operator", lambda: http_get(f"127.0.0.1:{probe}", "/readyz") == 200, "/readyz")

    def stop(self) -> None:
        """Kills every process group this started, then removes the temp folder. Safe to call twice."""
        for proc in self.procs.values():
            kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 3  # the data is thrown away: no need for a graceful shutdown
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        keep = os.environ.get("FINETUNE_E2E_LOGS")
        if keep and (self.root / "logs").exists():
            shutil.copytree(self.root / "logs", keep, dirs_exist_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
    except ProcessLookupError:
        pass


def http_get(hostport: str, path: str) -> int:
    conn = http.client.HTTPConnection(hostport, timeout=2)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def https_get(hostport: str, path: str, ctx: ssl.SSLContext) -> int:
    conn = http.client.HTTPSConnection(hostport, timeout=2, context=ctx)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()
