"""Kubernetes API access shared by `finetune status/logs/resume` and the progress publisher.

Names of the RayJob resource and of this app's labels and annotations, one way to build an API client
(kubeconfig or in-cluster), and one way to turn any API failure into a single line that says what to check.
"""

from __future__ import annotations

import os
from pathlib import Path

GROUP, VERSION, PLURAL, KIND = "ray.io", "v1", "rayjobs", "RayJob"
EXPERIMENT_LABEL = "ray-finetune/experiment"
PROGRESS_ANNOTATION = "finetune.ray.io/progress"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0


class KubeError(Exception):
    """A failure already worded for the user: one line, no traceback."""


def pod_namespace() -> str:
    """The namespace of the pod this runs in (its ServiceAccount's), or "default" outside a pod."""
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip() or "default"
    except OSError:
        return "default"


def _has_kubeconfig() -> bool:
    paths = os.environ.get("KUBECONFIG")
    if paths:
        return any(Path(p).expanduser().is_file() for p in paths.split(os.pathsep) if p)
    return Path("~/.kube/config").expanduser().is_file()


def connect(prefer_in_cluster: bool = False, retries: int | bool = 1):
    """(ApiClient, default namespace, where the config came from).

    The CLI prefers the kubeconfig (like kubectl) and falls back to the pod's ServiceAccount; the
    progress publisher, which runs inside the cluster, prefers the ServiceAccount. `retries` goes to
    urllib3 (False: one attempt, nothing logged).
    """
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    def in_cluster(cfg):
        config.load_incluster_config(client_configuration=cfg)
        return pod_namespace(), "in-cluster ServiceAccount"

    def kubeconfig(cfg):
        if not _has_kubeconfig():
            raise ConfigException("no kubeconfig file (KUBECONFIG or ~/.kube/config)")
        # The client reads KUBECONFIG once, at import: pass it explicitly so the current value counts.
        path = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
        config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
        _, current = config.list_kube_config_contexts(config_file=path)
        ns = (current or {}).get("context", {}).get("namespace") or "default"
        return ns, f"kubeconfig context {current.get('name') if current else '?'}"

    loaders = (in_cluster, kubeconfig) if prefer_in_cluster else (kubeconfig, in_cluster)
    reasons = []
    for loader in loaders:
        cfg = client.Configuration()
        try:
            namespace, source = loader(cfg)
        except (ConfigException, OSError, ValueError, TypeError, KeyError) as exc:
            reasons.append(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            continue
        cfg.retries = retries
        return client.ApiClient(cfg), namespace, source
    raise KubeError(
        "no Kubernetes credentials: set KUBECONFIG (or create ~/.kube/config), or run inside a pod "
        f"with a ServiceAccount ({'; '.join(reasons)})"
    )


def status_message(exc) -> str:
    """The `message` of a Kubernetes Status body, else the HTTP reason."""
    import json

    body = getattr(exc, "body", None)
    try:
        data = json.loads(body) if body else {}
    except (TypeError, ValueError):
        data = {}
    message = str((data.get("message") if isinstance(data, dict) else None) or getattr(exc, "reason", None) or "")
    return message.strip().splitlines()[0] if message.strip() else ""


def describe(exc: BaseException, action: str, namespace: str, host: str | None = None) -> str:
    """One line for any failure of an API call. `action` is e.g. 'list rayjobs.ray.io'."""
    from kubernetes.client.exceptions import ApiException
    from urllib3 import exceptions as u3

    where = f" at {host}" if host else ""
    verb = action.split()[0]
    resource = action.split()[-1]
    can_i = f"kubectl auth can-i {verb} {resource} -n {namespace}"
    if isinstance(exc, KubeError):
        return str(exc)
    if isinstance(exc, ApiException):
        msg = status_message(exc)
        code = exc.status
        if code == 401:
            return (
                f"cannot {action}: the API server{where} rejected the credentials (401 Unauthorized); log in "
                f"again or check the kubeconfig user"
            )
        if code == 403:
            return (
                f"cannot {action} in namespace {namespace}: forbidden (403: {msg}); check the RBAC of your "
                f"user or ServiceAccount ({can_i})"
            )
        if code == 404:
            return (
                f"cannot {action} in namespace {namespace}: not found (404: {msg}); check the namespace (-n) "
                f"and that the KubeRay operator and its CRDs (ray.io/v1) are installed"
            )
        if code == 409:
            return (
                f"cannot {action}: conflict (409: {msg}); someone changed or re-created it meanwhile, look "
                f"again and retry"
            )
        if code == 422:
            return f"cannot {action}: the API server rejected the object (422: {msg})"
        if code == 400:
            return f"cannot {action}: bad request (400: {msg})"
        if code in (None, 0):
            return f"cannot {action}: {msg or exc}"
        return (
            f"cannot {action}: the API server{where} answered {code} ({msg}); check the cluster's health and try again"
        )
    text = str(exc)
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, (u3.NewConnectionError, ConnectionRefusedError)) or "refused" in text.lower():
        # NewConnectionError is a ConnectTimeoutError subclass in urllib3 2: test it first.
        detail = "connection refused" if "refused" in text.lower() else "cannot connect"
        return (
            f"cannot {action}: cannot reach the Kubernetes API{where} ({detail}); check the kubeconfig context "
            "(kubectl config current-context) and that the cluster is up"
        )
    if isinstance(reason, (u3.TimeoutError, TimeoutError)) or "timed out" in text.lower():
        return (
            f"cannot {action}: the Kubernetes API{where} did not answer in time; check the network/VPN and "
            "that the cluster is up (kubectl cluster-info)"
        )
    if isinstance(exc, (u3.HTTPError, OSError)):
        return (
            f"cannot {action}: cannot reach the Kubernetes API{where} ({type(reason).__name__}); check the "
            "kubeconfig context (kubectl config current-context) and that the cluster is up"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"cannot {action}: {type(exc).__name__}: {first}"
