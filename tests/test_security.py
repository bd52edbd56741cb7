"""Security of what the chart renders, from the defaults and every examples/values-*.yaml: least-privilege RBAC
(checked against what the progress writer really calls), and the other rules of issue 15."""

from __future__ import annotations

import re

import pytest
import yaml

from app.progress import ProgressPublisher
from fake_k8s import ApiError, FakeKube
from k8s_support import EXAMPLE_VALUES, by_kind, one, pod_templates, render
from test_ops import NS, rayjob

VALUE_SETS = [pytest.param([], id="defaults")] + [pytest.param([p], id=p.stem) for p in EXAMPLE_VALUES]


# --- RBAC: the progress writer may patch its own RayJob, nothing else ---------------------------------------


def allowed(rules: list[dict], verb: str, group: str, resource: str, name: str | None) -> bool:
    """Kubernetes' RBAC rule matching (rbac/v1 RuleAllows) for a namespaced resource request."""
    def has(values, value):
        return "*" in values or value in values

    for r in rules:
        if not (has(r.get("verbs", []), verb) and has(r.get("apiGroups", []), group)
                and has(r.get("resources", []), resource)):
            continue
        names = r.get("resourceNames") or []
        if not names or (name is not None and name in names):
            return True
    return False


@pytest.mark.parametrize("values", VALUE_SETS)
def test_role_is_patch_of_the_own_rayjob_only(values):
    objects = render(values)
    name = one(objects, "RayJob")["metadata"]["name"]
    role = one(objects, "Role")
    assert role["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [name],
                              "verbs": ["patch"]}]
    rules = role["rules"]
    assert allowed(rules, "patch", "ray.io", "rayjobs", name)
    for verb, resource, other in [("patch", "rayjobs", "someone-elses-job"), ("get", "rayjobs", name),
                                  ("patch", "rayjobs/status", name), ("update", "rayjobs", name),
                                  ("list", "rayjobs", None), ("create", "rayjobs", None),
                                  ("get", "secrets", name), ("patch", "rayclusters", name)]:
        assert not allowed(rules, verb, "ray.io" if "ray" in resource else "", resource, other), (verb, resource, other)
    # The binding names the release namespace (kustomize rewrites it for an overlay with `namespace:`).
    binding = one(objects, "RoleBinding")
    sa = one(objects, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "default"}]


def test_binding_follows_the_release_namespace():
    objects = render(release="exp1", namespace="ml-team")
    assert one(objects, "RoleBinding")["subjects"][0]["namespace"] == "ml-team"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_tokens_are_mounted_only_where_used(values):
    """Workers run Ray Train's rank 0 (the progress writer) and mount the token; the submitter never calls the
    API; the head only with CPU training (rank 0 may land there) or the autoscaler sidecar."""
    objects = render(values)
    sa = one(objects, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False
    for role, tpl in pod_templates(objects).items():
        spec = tpl["spec"]
        assert spec["automountServiceAccountToken"] is role.startswith("worker/"), role
        if role != "submitter":
            assert spec["serviceAccountName"] == sa["metadata"]["name"], role
        else:
            assert "serviceAccountName" not in spec


@pytest.mark.parametrize("sets, head_token", [
    (["training.scaling.use_gpu=false", "workers.gpu.gpus=0"], True),
    (["autoscaling.enabled=true"], True),
    (["progressReporting.enabled=false"], False),
])
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
        verb = {"GET": "get" if name else "list", "POST": "create", "PUT": "update", "PATCH": "patch",
                "DELETE": "delete"}[method]
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
