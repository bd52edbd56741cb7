"""Security of what the chart renders, from the defaults and every examples/values-*.yaml: least-privilege RBAC
(checked against what the progress writer really calls), and the other rules of issue 15."""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import pytest
from fake_k8s import ApiError, FakeKube
from k8s_support import CHART, EXAMPLE_VALUES, REPO, cluster_spec, container, helm, one, pod_templates, render
from test_ops import NS, rayjob

from app.progress import ProgressPublisher

VALUE_SETS = [pytest.param([], id="defaults")] + [pytest.param([p], id=p.stem) for p in EXAMPLE_VALUES]


# --- RBAC: the progress writer may patch its own RayJob, nothing else ---------------------------------------


def allowed(rules: list[dict], verb: str, group: str, resource: str, name: str | None) -> bool:
    """Kubernetes' RBAC rule matching (rbac/v1 RuleAllows) for a namespaced resource request."""

    def has(values, value):
        return "*" in values or value in values

    for r in rules:
        if not (
            has(r.get("verbs", []), verb)
            and has(r.get("apiGroups", []), group)
            and has(r.get("resources", []), resource)
        ):
            continue
        names = r.get("resourceNames") or []
        if not names or (name is not None and name in names):
            return True
    return False


def prepares(objects: list[dict[str, Any]]) -> bool:
    """A prepare release (prepare.enabled, examples/values-prepare.yaml): its RayJob runs `finetune prepare`."""
    return one(objects, "RayJob")["metadata"]["labels"]["app.kubernetes.io/component"] == "prepare"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_role_is_get_and_patch_of_the_own_rayjob_only(values):
    objects = render(values)
    if prepares(objects):  # nothing on its pods calls the API: no account, no Role, no token
        assert not {"ServiceAccount", "Role", "RoleBinding"} & {o["kind"] for o in objects}
        return
    name = one(objects, "RayJob")["metadata"]["name"]
    role = one(objects, "Role")
    assert role["rules"] == [
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [name], "verbs": ["get", "patch"]}
    ]  # progress (patch) and the lease's RayJob check (get)
    rules = role["rules"]
    assert allowed(rules, "patch", "ray.io", "rayjobs", name) and allowed(rules, "get", "ray.io", "rayjobs", name)
    for verb, resource, other in [
        ("patch", "rayjobs", "someone-elses-job"),
        ("get", "rayjobs", "someone-elses-job"),
        ("get", "pods", "exp1-head-abcde"),
        ("patch", "rayjobs/status", name),
        ("update", "rayjobs", name),
        ("list", "rayjobs", None),
        ("create", "rayjobs", None),
        ("get", "secrets", name),
        ("patch", "rayclusters", name),
        ("list", "pods", None),
        ("patch", "pods", name),
        ("get", "pods/log", name),
        ("create", "pods/exec", name),
    ]:
        assert not allowed(rules, verb, "ray.io" if "ray" in resource else "", resource, other), (verb, resource, other)
    # The binding names the release namespace (kustomize rewrites it for an overlay with `namespace:`).
    binding = one(objects, "RoleBinding")
    sa = one(objects, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}]


def test_binding_follows_the_release_namespace():
    objects = render(release="exp1", namespace="ml-team")
    assert one(objects, "RoleBinding")["subjects"][0]["namespace"] == "ml-team"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_tokens_are_mounted_only_where_used(values):
    """Workers run Ray Train's rank 0 (the progress writer) and the head the driver (the lease check): they mount
    the token; the submitter never calls the API."""
    objects = render(values)
    if prepares(objects):
        for role, tpl in pod_templates(objects).items():
            assert tpl["spec"]["automountServiceAccountToken"] is False and "serviceAccountName" not in tpl["spec"]
        return
    sa = one(objects, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    for role, tpl in pod_templates(objects).items():
        spec = tpl["spec"]
        assert spec["automountServiceAccountToken"] is (role.startswith("worker/") or role == "head"), role
        if role != "submitter":
            assert spec["serviceAccountName"] == sa["metadata"]["name"], role
        else:
            assert "serviceAccountName" not in spec


@pytest.mark.parametrize(
    "sets, head_token",
    [
        ([], True),
        (["progressReporting.rbac.create=false"], False),
        (["training.scaling.use_gpu=false", "workers.gpu.gpus=0"], True),
        (["autoscaling.enabled=true"], True),
        (["progressReporting.enabled=false"], False),
    ],
)
def test_head_token_only_when_something_there_uses_it(sets, head_token):
    templates = pod_templates(render(sets=sets))
    assert templates["head"]["spec"]["automountServiceAccountToken"] is head_token
    progress = "progressReporting.enabled=false" not in sets
    assert templates["worker/gpu"]["spec"]["automountServiceAccountToken"] is progress


def test_the_role_allows_what_the_progress_writer_does(tmp_path, monkeypatch):
    """The real publisher against the fake API server, which authorizes every request with the rendered Role:
    its PATCHes pass, and the same Role refuses a publisher pointed at another experiment's RayJob."""
    rules = one(render(release="exp1"), "Role")["rules"]
    server = FakeKube()

    def authorize(method, path):
        m = re.fullmatch(r"/apis/(ray\.io)/v1/namespaces/[^/]+/(rayjobs)(?:/([^/]+))?(/status)?", path)
        group, resource, name, status = m.groups() if m else ("", path, None, None)
        verb = {
            "GET": "get" if name else "list",
            "POST": "create",
            "PUT": "update",
            "PATCH": "patch",
            "DELETE": "delete",
        }[method]
        if not allowed(rules, verb, group, resource + (status or ""), name):
            raise ApiError(403, "Forbidden", f"{verb} {path} is forbidden by the chart's Role")

    server.before = authorize
    server.start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        for name in ("exp1", "exp2"):
            server.add_rayjob(rayjob(name=name, experiment=name), status={"jobStatus": "RUNNING"})
        for name in ("exp1", "exp2"):
            p = ProgressPublisher(name, NS, interval_s=60)
            p.update({"step": 3}, force=True)
            p.close()
        codes = {(r["method"], r["path"].rsplit("/", 1)[1], r["code"]) for r in server.requests}
        assert codes == {("PATCH", "exp1", 200), ("PATCH", "exp2", 403)}, codes
    finally:
        server.stop()


# --- Pod Security "restricted", on every pod the chart makes KubeRay create ----------------------------------
# The profile's checks (Kubernetes Pod Security Standards, baseline + restricted, version "latest"), over the
# containers, init containers and ephemeral containers of a pod spec. Returns one line per violation.

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
    "image",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(template: dict[str, Any]) -> list[str]:
    spec, annotations = template["spec"], (template.get("metadata") or {}).get("annotations") or {}
    pod_sc = spec.get("securityContext") or {}
    containers = [
        (kind, c) for kind in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(kind) or []
    ]
    out = []

    def bad(rule, where, detail):
        out.append(f"{rule}: {where}: {detail}")

    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            bad("host namespaces", "pod", f"{field}=true")
    for where, sc in [("pod", pod_sc)] + [(f"{k}/{c['name']}", c.get("securityContext") or {}) for k, c in containers]:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad("hostProcess", where, "windowsOptions.hostProcess=true")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad("seLinux", where, f"seLinuxOptions={se}")
        if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            bad("appArmor", where, f"appArmorProfile={sc['appArmorProfile']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            bad("seccompProfile", where, "Unconfined")
        if sc.get("runAsUser") == 0:
            bad("runAsUser", where, "0 (root)")
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            bad("appArmor", "pod", f"{key}={value}")
    for sysctl in pod_sc.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            bad("sysctls", "pod", sysctl["name"])
    for vol in spec.get("volumes") or []:
        kinds = set(vol) - {"name"}
        if "hostPath" in kinds:
            bad("hostPath volumes", "pod", vol["name"])
        if not kinds <= RESTRICTED_VOLUMES:
            bad("volume types", "pod", f"{vol['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_non_root = pod_sc.get("runAsNonRoot") is True
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    for kind, c in containers:
        where, sc = f"{kind}/{c['name']}", c.get("securityContext") or {}
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            bad("privileged", where, "privileged=true")
        if sc.get("procMount", "Default") != "Default":
            bad("procMount", where, sc["procMount"])
        if any(p.get("hostPort") for p in c.get("ports") or []):
            bad("hostPorts", where, [p["hostPort"] for p in c["ports"] if p.get("hostPort")])
        if set(caps.get("add") or []) - BASELINE_CAPABILITIES:
            bad("capabilities (baseline)", where, f"add {caps['add']}")
        # restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            bad("allowPrivilegeEscalation", where, f"must be false, is {sc.get('allowPrivilegeEscalation')}")
        if sc.get("runAsNonRoot") is False or not (pod_non_root or sc.get("runAsNonRoot") is True):
            bad(
                "runAsNonRoot",
                where,
                f"must be true (pod {pod_sc.get('runAsNonRoot')}, container {sc.get('runAsNonRoot')})",
            )
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (seccomp is None and pod_seccomp)):
            bad(
                "seccompProfile", where, f"must be RuntimeDefault or Localhost (pod {pod_seccomp}, container {seccomp})"
            )
        if "ALL" not in (caps.get("drop") or []):
            bad("capabilities", where, f"must drop ALL, drops {caps.get('drop')}")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad("capabilities", where, f"may add only NET_BIND_SERVICE, adds {caps['add']}")
    return out


def as_created(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pod templates with what KubeRay 1.7 adds before it creates the pods: the workers' wait-gcs-ready init
    container (it copies the worker container's securityContext), the autoscaler sidecar on the head (its
    securityContext from autoscalerOptions) and, in SidecarMode, the submitter container in the head pod
    (KubeRay builds it with no securityContext), plus the /tmp/ray emptyDir the autoscaler needs."""
    spec, job = cluster_spec(objects), one(objects, "RayJob")["spec"]
    out = {}
    for role, tpl in pod_templates(objects).items():
        tpl = copy.deepcopy(tpl)
        containers, volumes = tpl["spec"]["containers"], tpl["spec"].setdefault("volumes", [])
        if role.startswith("worker/"):
            ray = containers[0]
            tpl["spec"].setdefault("initContainers", []).append(
                {
                    "name": "wait-gcs-ready",
                    "image": ray["image"],
                    "imagePullPolicy": ray.get("imagePullPolicy"),
                    "command": ["/bin/bash", "-lc", "--"],
                    "securityContext": copy.deepcopy(ray.get("securityContext")),
                    "env": ray.get("env", []),
                    "volumeMounts": ray.get("volumeMounts", []),
                    "resources": {
                        "limits": {"cpu": "200m", "memory": "256Mi"},
                        "requests": {"cpu": "200m", "memory": "256Mi"},
                    },
                }
            )
        if role == "head" and spec.get("enableInTreeAutoscaling"):
            containers.append(
                {
                    "name": "autoscaler",
                    "image": containers[0]["image"],
                    "securityContext": copy.deepcopy((spec.get("autoscalerOptions") or {}).get("securityContext")),
                }
            )
            if not any(v["name"] == "ray-logs" for v in volumes):
                volumes.append({"name": "ray-logs", "emptyDir": {}})
        if role == "head" and job.get("submissionMode") == "SidecarMode":
            containers.append({"name": "ray-job-submitter", "image": containers[0]["image"]})
        out[role] = tpl
    return out


RESTRICTED_CASES = {
    **{f"example-{p.stem}": ([p], [], []) for p in EXAMPLE_VALUES},
    "defaults": ([], [], []),
    "autoscaling": ([], ["autoscaling.enabled=true", "workers.gpu.maxReplicas=4"], []),
    "persistent-http-no-rbac": (
        [],
        [
            "rayJob.clusterMode=persistent",
            "rayJob.submissionMode=HTTPMode",
            "rayJob.backoffLimit=0",
            "progressReporting.rbac.create=false",
        ],
        [],
    ),
    "prepare-cpu": ([REPO / "examples" / "values-cpu.yaml", REPO / "examples" / "values-prepare.yaml"], [], []),
    "cpu-training-extra-group": (
        [],
        ["training.scaling.use_gpu=false", "workers.gpu.gpus=0"],
        ['workers.cpu={"replicas": 2, "resources": {"requests": {"cpu": "4"}}}'],
    ),
}


@pytest.mark.parametrize("case", list(RESTRICTED_CASES))
def test_every_pod_passes_pod_security_restricted(case):
    values, sets, set_json = RESTRICTED_CASES[case]
    pods = as_created(render(values, sets, set_json))
    assert "head" in pods and any(role.startswith("worker/") for role in pods), set(pods)
    for role, tpl in pods.items():
        assert restricted_violations(tpl) == [], f"{case} {role}:\n" + json.dumps(tpl["spec"], indent=1)[:3000]
    if "submitter" in pods:
        assert container(pods["submitter"])["securityContext"]["allowPrivilegeEscalation"] is False


def test_sidecar_mode_cannot_pass_restricted():
    """KubeRay builds the SidecarMode submitter container itself, with no securityContext: the head pod is then
    refused by a "restricted" namespace. The chart says so (NOTES, docs/kubernetes.md) instead of hiding it."""
    pods = as_created(render(sets=["rayJob.submissionMode=SidecarMode"]))
    problems = restricted_violations(pods["head"])
    assert problems and all("containers/ray-job-submitter" in p for p in problems), problems


def test_group_security_contexts_merge_over_the_chart_wide_ones():
    objects = render(
        set_json=[
            'workers.gpu.securityContext={"runAsUser": 2000}',
            'head.podSecurityContext={"fsGroup": 2000}',
            'rayJob.submitter.securityContext={"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}',
        ]
    )
    pods = as_created(objects)
    worker_sc = container(pods["worker/gpu"])["securityContext"]
    assert worker_sc["runAsUser"] == 2000 and worker_sc["allowPrivilegeEscalation"] is False
    assert pods["worker/gpu"]["spec"]["initContainers"][0]["securityContext"] == worker_sc
    assert "runAsUser" not in container(pods["head"])["securityContext"]
    assert pods["head"]["spec"]["securityContext"]["fsGroup"] == 2000
    assert pods["worker/gpu"]["spec"]["securityContext"]["fsGroup"] == 100
    assert container(pods["submitter"])["securityContext"]["capabilities"]["add"] == ["NET_BIND_SERVICE"]
    for role, tpl in pods.items():
        assert restricted_violations(tpl) == [], role


VIOLATIONS = {  # a change to a passing pod -> the rule that must catch it
    "host network": (lambda p: p["spec"].update(hostNetwork=True), "host namespaces"),
    "host pid": (lambda p: p["spec"].update(hostPID=True), "host namespaces"),
    "hostPath": (lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath volumes"),
    "nfs volume": (
        lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}),
        "volume types",
    ),
    "privileged": (lambda p: sc(p).update(privileged=True), "privileged"),
    "escalation unset": (lambda p: sc(p).pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    "escalation true": (lambda p: sc(p).update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
    "root allowed": (
        lambda p: (sc(p).pop("runAsNonRoot"), p["spec"]["securityContext"].pop("runAsNonRoot")),
        "runAsNonRoot",
    ),
    "container non-root false": (lambda p: sc(p).update(runAsNonRoot=False), "runAsNonRoot"),
    "uid 0": (lambda p: p["spec"]["securityContext"].update(runAsUser=0), "runAsUser"),
    "no seccomp": (
        lambda p: (sc(p).pop("seccompProfile"), p["spec"]["securityContext"].pop("seccompProfile")),
        "seccompProfile",
    ),
    "unconfined": (lambda p: sc(p).update(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
    "caps kept": (lambda p: sc(p).pop("capabilities"), "capabilities"),
    "cap added": (lambda p: sc(p)["capabilities"].update(add=["SYS_ADMIN"]), "capabilities"),
    "cap NET_RAW": (lambda p: sc(p)["capabilities"].update(add=["NET_RAW"]), "capabilities"),
    "host port": (
        lambda p: p["spec"]["containers"][0]["ports"].append({"containerPort": 1, "hostPort": 80}),
        "hostPorts",
    ),
    "proc mount": (lambda p: sc(p).update(procMount="Unmasked"), "procMount"),
    "sysctl": (
        lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        "sysctls",
    ),
    "selinux user": (lambda p: sc(p).update(seLinuxOptions={"user": "root"}), "seLinux"),
    "apparmor": (lambda p: sc(p).update(appArmorProfile={"type": "Unconfined"}), "appArmor"),
    "init container": (
        lambda p: p["spec"].setdefault("initContainers", []).append({"name": "i"}),
        "allowPrivilegeEscalation",
    ),
}


@functools.cache
def default_head() -> dict[str, Any]:
    return as_created(render())["head"]


def sc(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]["securityContext"]


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_the_restricted_check_catches_each_rule(case):
    change, rule = VIOLATIONS[case]
    pod = copy.deepcopy(default_head())
    assert restricted_violations(pod) == []
    change(pod)
    assert any(p.startswith(rule + ":") for p in restricted_violations(pod)), (case, restricted_violations(pod))


# --- network policy, authentication, image references -------------------------------------------------------


def policy_admits(
    policy: dict[str, Any],
    pod_labels: dict[str, str],
    source_labels: dict[str, str],
    source_namespace: str,
    port: int,
    namespace: str = "default",
) -> bool:
    """NetworkPolicy ingress semantics for a TCP connection to a pod the policy selects (matchLabels only)."""

    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())

    assert matches(policy["spec"]["podSelector"], pod_labels)
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        for peer in rule.get("from") or [{}]:
            ns_ok = (
                source_namespace == namespace
                if "namespaceSelector" not in peer
                else matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_namespace})
            )
            if ns_ok and matches(peer.get("podSelector") or {}, source_labels):
                return True
    return False


@pytest.mark.parametrize("values", VALUE_SETS)
def test_network_policy_admits_the_experiment_and_the_operator_only(values):
    objects = render(values, namespace="ml-team")  # the operator runs in kuberay-system (the default value)
    policy = one(objects, "NetworkPolicy")
    egress = policy["spec"]["egress"]  # open, plus the MLflow server's port where tracking.mlflow.egressTo is set
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and egress[0] == {}
    assert all(set(rule) == {"to", "ports"} and len(rule["ports"]) == 1 for rule in egress[1:]), egress
    templates = pod_templates(objects)
    own = [tpl["metadata"]["labels"] for tpl in templates.values()]  # head, workers, submitter
    other_exp = {**own[0], "ray-finetune/experiment": "another-run"}
    for target in own:
        for source in own:
            for port in (6379, 8265, 10001, 52365, 12345):  # GCS, dashboard, client, agent, a worker port
                assert policy_admits(policy, target, source, "ml-team", port, namespace="ml-team")
        assert not policy_admits(policy, target, other_exp, "ml-team", 6379, namespace="ml-team")
        assert not policy_admits(policy, target, {}, "ml-team", 8265, namespace="ml-team")
        assert not policy_admits(policy, target, own[0], "elsewhere", 10001, namespace="ml-team")
    head = templates["head"]["metadata"]["labels"]
    # The KubeRay operator (namespace networkPolicy.operatorNamespace) reaches the dashboard and nothing else.
    operator = {"app.kubernetes.io/name": "kuberay-operator"}
    assert policy_admits(policy, head, operator, "kuberay-system", 8265, namespace="ml-team")
    assert not policy_admits(policy, head, operator, "kuberay-system", 6379, namespace="ml-team")
    assert not policy_admits(policy, head, operator, "default", 8265, namespace="ml-team")


def test_network_policy_values():
    objects = render(
        sets=["networkPolicy.operatorNamespace=ray-system", "head.rayStartParams.dashboard-port=9000"],
        set_json=[
            'networkPolicy.egress=[{"ports": [{"port": 53, "protocol": "UDP"}]}]',
            'networkPolicy.extraIngress=[{"from": [{"namespaceSelector": {"matchLabels": '
            '{"kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": 8080}]}]',
        ],
    )
    policy = one(objects, "NetworkPolicy")
    head = pod_templates(objects)["head"]
    labels = head["metadata"]["labels"]
    assert policy_admits(policy, labels, {}, "ray-system", 9000)
    assert not policy_admits(policy, labels, {}, "ray-system", 8265)
    assert {"containerPort": 9000, "name": "dashboard"} in container(head)["ports"]
    assert policy_admits(policy, labels, {}, "monitoring", 8080)
    assert policy["spec"]["egress"] == [{"ports": [{"port": 53, "protocol": "UDP"}]}]
    assert not [o for o in render(sets=["networkPolicy.enabled=false"]) if o["kind"] == "NetworkPolicy"]


def notes(*sets: str) -> str:
    args = ["install", "exp1", str(CHART), "--dry-run=client"] + [a for s in sets for a in ("--set", s)]
    return helm(*args).stdout.split("NOTES:", 1)[1]


def test_notes_warn_about_weakened_defaults():
    assert "WARNING" not in notes()
    text = notes("auth.mode=disabled", "auth.allowDisabled=true")
    assert "WARNING: auth.mode=disabled" in text and "The NetworkPolicy limits that" in text
    text = notes("auth.mode=disabled", "auth.allowDisabled=true", "networkPolicy.enabled=false")
    assert "that is every pod that can reach these pods" in text and "WARNING: networkPolicy.enabled=false" in text
    assert 'Pod Security "restricted" refuses the head pod' in notes("rayJob.submissionMode=SidecarMode")


DIGEST = "sha256:" + "0123456789abcdef" * 4
REFERENCE = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


def test_image_digest_renders_valid_references():
    def images(*sets):
        objs = render(sets=list(sets))
        return {role: container(tpl)["image"] for role, tpl in pod_templates(objs).items()}

    assert set(images().values()) == {"ghcr.io/example/ray-finetune:0.1.0"}
    pinned = images(f"image.digest={DIGEST}")
    assert set(pinned.values()) == {f"ghcr.io/example/ray-finetune@{DIGEST}"}
    # A group that names its own image does not inherit the chart-wide digest; it can carry its own.
    mixed = images(f"image.digest={DIGEST}", "workers.gpu.image.tag=0.1.0-rocm")
    assert mixed["worker/gpu"] == "ghcr.io/example/ray-finetune:0.1.0-rocm" and mixed["head"].endswith(DIGEST)
    own = images("workers.gpu.image.repository=registry.example.com/rocm", f"workers.gpu.image.digest={DIGEST}")
    assert own["worker/gpu"] == f"registry.example.com/rocm@{DIGEST}"
    for refs in (pinned, mixed, own):
        for ref in refs.values():
            assert REFERENCE.match(ref), ref
    assert not REFERENCE.match(f"ghcr.io/example/ray-finetune:{DIGEST}")


# --- secrets: never a literal in the RayJob, the ConfigMap or Ray's runtime environment ----------------------

SECRET_LIKE = [
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "DB_PASSWORD",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "api_key",
    "token",
]
NOT_SECRET = ["HF_HOME", "TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "KEYBOARD", "MONKEY_PATCH", "HF_HUB_OFFLINE"]


def test_chart_and_app_agree_on_what_looks_like_a_secret():
    from app.driver import SECRET_NAME

    for name in SECRET_LIKE + NOT_SECRET:
        out = helm(
            "template",
            "x",
            str(CHART),
            "--set-json",
            json.dumps([{"name": name, "value": "v"}]).join(["env=", ""]),
            check=False,
        )
        assert (out.returncode != 0) == bool(SECRET_NAME.search(name)) == (name in SECRET_LIKE), (name, out.stderr)
        if out.returncode:
            assert f"env[0]: {name} has a literal value" in out.stderr and "valueFrom" in out.stderr


@pytest.mark.parametrize(
    "where, value, named",
    [
        ("head.env", [{"name": "HF_TOKEN", "value": "hf_x"}], "head.env[0]: HF_TOKEN"),
        (
            "workers.gpu.env",
            [{"name": "A", "value": "1"}, {"name": "WANDB_API_KEY", "value": "k"}],
            "workers.gpu.env[1]: WANDB_API_KEY",
        ),
        (
            "training.deepspeed.comet",
            {"enabled": True, "api_key": "k"},
            "training.deepspeed.comet.api_key: a literal secret",
        ),
        ("training.deepspeed.monitors", [{"wandb": {"token": "t"}}], "training.deepspeed.monitors[0].wandb.token"),
    ],
)
def test_literal_secrets_fail_naming_the_value_and_the_fix(where, value, named):
    out = helm("template", "x", str(CHART), "--set-json", f"{where}={json.dumps(value)}", check=False)
    assert out.returncode != 0 and named in out.stderr, out.stderr
    assert "Fix:" in out.stderr and "secretKeyRef" in out.stderr


@pytest.mark.parametrize("values", VALUE_SETS)
def test_no_literal_secret_in_any_pod_env(values):
    from app.driver import SECRET_NAME

    for role, tpl in pod_templates(render(values)).items():
        for c in tpl["spec"]["containers"]:
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], (role, e)


def test_secrets_stay_out_of_rays_runtime_environment(monkeypatch):
    """The driver passes HF_*, NCCL_* ... to the workers through Ray's runtime environment, which the dashboard
    and `ray list runtime-envs` show: tokens and keys are left out (workers read them from their pod's Secret)."""
    from app.config import TrainingConfig
    from app.driver import worker_env

    for name in SECRET_LIKE + NOT_SECRET:
        monkeypatch.setenv(name.upper(), "value-of-" + name)
    monkeypatch.setenv("HF_API_KEY", "k")
    env = worker_env(TrainingConfig())
    assert {"HF_HOME", "NCCL_DEBUG", "HF_HUB_OFFLINE"} <= set(env)
    assert not {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_KEY"} & set(env), env
    assert all("value-of-HF_TOKEN" != v for v in env.values())


def test_the_users_cuda_allocator_settings_reach_the_workers_unchanged(monkeypatch):
    """PYTORCH_CUDA_ALLOC_CONF is the user's to set: passed through as it is, nothing added on GPU workers."""
    from app.config import parse
    from app.driver import worker_env

    gpu, cpu = parse({"scaling": {"use_gpu": True}}), parse({"scaling": {"use_gpu": False}})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env(gpu) and "PYTORCH_CUDA_ALLOC_CONF" not in worker_env(cpu)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert worker_env(gpu)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


# --- node disk: /tmp/ray bounded, ephemeral storage requested ------------------------------------------------


@pytest.mark.parametrize("values", VALUE_SETS)
def test_tmp_ray_is_a_bounded_emptydir_and_pods_request_ephemeral_storage(values):
    objects = render(values)
    for role, tpl in pod_templates(objects).items():
        requests = container(tpl)["resources"]["requests"]
        assert requests.get("ephemeral-storage"), role
        if role == "submitter":
            continue
        mounts = {m["mountPath"]: m["name"] for m in container(tpl)["volumeMounts"]}
        volume = next(v for v in tpl["spec"]["volumes"] if v["name"] == mounts["/tmp/ray"])
        assert volume["name"] == "ray-logs", "KubeRay's autoscaler sidecar shares the volume of that name"
        assert set(volume["emptyDir"]) == {"sizeLimit"}, "on disk, not in memory"
        assert requests["ephemeral-storage"] == volume["emptyDir"]["sizeLimit"], role


def test_tmp_size_and_an_explicit_ephemeral_request():
    objects = render(sets=["workers.gpu.tmpSize=200Gi", "head.resources.requests.ephemeral-storage=30Gi"])
    templates = pod_templates(objects)
    worker = container(templates["worker/gpu"])
    assert worker["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    assert "ephemeral-storage" not in worker["resources"].get("limits", {}), "no limit: a limit evicts"
    assert container(templates["head"])["resources"]["requests"]["ephemeral-storage"] == "30Gi"
    vols = {v["name"]: v for v in templates["head"]["spec"]["volumes"]}
    assert vols["ray-logs"]["emptyDir"]["sizeLimit"] == "20Gi"


def test_readwritemany_or_an_existing_claim():
    assert render(sets=["storage.create=false", "storage.existingClaim=rwx"])  # its mode is the admin's business
    assert render(set_json=['storage.accessModes=["ReadWriteMany", "ReadWriteOnce"]'])


def test_docs_have_a_security_section_for_the_cluster_admin():
    text = (CHART.parents[1] / "docs" / "kubernetes.md").read_text()
    section = text.split("\n## Security\n", 1)[1].split("\n## ", 1)[0]
    for needle in (
        "resourceNames",
        "automount",
        "restricted",
        "SidecarMode",
        "NetworkPolicy",
        "operatorNamespace",
        "secretKeyRef",
        "image.digest",
        "reclaimPolicy: Retain",
        "Never share a checkpoint claim",
        "unpickle",
        "fsGroup",
        "NFS",
        "checkov-accepted.yaml",
    ):
        assert needle in section, needle


def test_gpu_workers_keep_compiled_kernels_under_the_storage_root(monkeypatch, tmp_path):
    """Triton's and torch.compile's caches live on the shared storage (a pod's disk starts empty at every
    deployment): GPU workers get both folders under the storage root, shared by its experiments; a user's own
    cache folders win; CPU workers compile no Triton kernels and get neither."""
    from app.config import parse
    from app.driver import COMPILE_CACHE, worker_env

    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    storage = {"experiment": {"storage_path": str(tmp_path)}}
    gpu, cpu = parse({**storage, "scaling": {"use_gpu": True}}), parse({**storage, "scaling": {"use_gpu": False}})
    env = worker_env(gpu)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path.resolve() / COMPILE_CACHE / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path.resolve() / COMPILE_CACHE / "inductor")
    assert not {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"} & set(worker_env(cpu))
    monkeypatch.setenv("TRITON_CACHE_DIR", "/cache/triton")
    assert worker_env(gpu)["TRITON_CACHE_DIR"] == "/cache/triton"
    assert not any(tmp_path.iterdir())  # nothing written to storage before a run starts
