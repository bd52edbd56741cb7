"""A small local Kubernetes API server for the REST paths that `finetune status/logs/resume` and the progress
publisher use, with the API's semantics for them. No Kubernetes API server can run on the test machines.

Served (JSON only, bearer-token auth, plain HTTP on 127.0.0.1):
  GET    /apis/ray.io/v1/namespaces/NS/rayjobs[?labelSelector=...]      list (RayJobList)
  POST   /apis/ray.io/v1/namespaces/NS/rayjobs                           create (409 AlreadyExists)
  GET    /apis/ray.io/v1/namespaces/NS/rayjobs/NAME                      get (404 NotFound)
  PUT    /apis/ray.io/v1/namespaces/NS/rayjobs/NAME                      update (resourceVersion required, 409 Conflict)
  PATCH  /apis/ray.io/v1/namespaces/NS/rayjobs/NAME                      merge-patch / json-patch (415 for strategic)
  DELETE /apis/ray.io/v1/namespaces/NS/rayjobs/NAME                      preconditions, propagationPolicy, finalizers
  GET    /api/v1/namespaces/NS/pods[?labelSelector=...]                  list (PodList)
  GET    /api/v1/namespaces/NS/pods/NAME/log[?container&follow&tailLines] text, chunked when follow

What it does as the real server does: every write bumps metadata.resourceVersion (a cluster-wide counter);
generation grows only when spec changes; status is kept on writes to the main resource (status
subresource); creation fills uid, creationTimestamp, generation and the CRD's structural defaults; errors
are Status objects with the real reasons and messages (NotFound, AlreadyExists, Conflict, Invalid,
Forbidden, Unauthorized, UnsupportedMediaType, BadRequest); DELETE honours preconditions (uid,
resourceVersion) and, when the object has finalizers or propagationPolicy=Foreground, only marks it
(deletionTimestamp) until a simulated operator drops the finalizers after `finalize_delay_s`; creating a
name that is still terminating answers 409 AlreadyExists.

Every RayJob body it receives (POST and PUT bodies, and the object that a PATCH produces) is checked against
the openAPIV3Schema of the KubeRay RayJob CRD (k8s_support.crds_dir(): the operator module's own CRDs):
types, enums, patterns and formats through jsonschema, and unknown fields rejected as with
fieldValidation=Strict (the real default, Warn, would drop them silently). CEL rules (x-kubernetes-validations)
are not evaluated. A failed check answers 422 Invalid and is also kept in `schema_errors` for tests.

Test hooks: `mode` ("ok", "forbidden": 403 for every call, "unauthorized": 401, "no-crd": 404 for ray.io
paths as when KubeRay's CRDs are not installed), `forbidden_verbs` (403 for just those, e.g. {"create"}),
`before` (a callable(method, path) run before each request is handled), `set_status`, `add_pod`,
`requests` (every request with its answer's code), `stop()` (connection refused afterwards).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import jsonschema
import k8s_support
import yaml

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = "ray.io_rayjobs.yaml"
TOKEN = "fake-token-for-tests"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
SERVER_METADATA = (
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
)


def crd_path() -> Path:
    folder = os.environ.get("KUBERAY_CRDS_DIR")
    if folder and not Path(folder).is_dir():
        return Path(folder)  # a path to the file itself
    return k8s_support.crd_file("RayJob")


def load_schema(path: Path | None = None) -> dict:
    return copy.deepcopy(_schema(str(path or crd_path())))


@functools.lru_cache(maxsize=4)
def _schema(path: str) -> dict:
    """The CRD's v1 openAPIV3Schema, parsed once per process (25,000 lines of YAML)."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"KubeRay RayJob CRD not found at {path}: set KUBERAY_CRDS_DIR to the folder with {CRD_FILE}"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc = yaml.load(Path(path).read_text(), Loader=loader)  # noqa: S506 - a safe loader
    version = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


# Schema helpers: structural defaulting and strict unknown-field detection, as the API server does them.
def apply_defaults(obj, schema: dict) -> None:
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                if key not in props:
                    apply_defaults(value, extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])


def unknown_fields(obj, schema: dict, path: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return found
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                found += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, f"{path}.{key}")
            elif extra is True:
                continue
            elif props is not None or schema.get("type") == "object":
                found.append(f"{path}.{key}".lstrip("."))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target, ops: list):
    """RFC 6902 (add, remove, replace, test)."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1] if parts else None
        kind = op["op"]
        if kind == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise ApiError(
                    422,
                    "Invalid",
                    f"the server rejected our request due to an error in our request: testing value "
                    f"{op['path']} failed",
                )
        elif kind in ("add", "replace"):
            if isinstance(parent, list):
                idx = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(idx, op["value"])
                else:
                    parent[idx] = op["value"]
            else:
                if kind == "replace" and last not in parent:
                    raise ApiError(
                        422,
                        "Invalid",
                        f"the server rejected our request due to an error in our request: replace operation "
                        f"does not apply: doc is missing key: {op['path']}",
                    )
                parent[last] = op["value"]
        elif kind == "remove":
            if isinstance(parent, list):
                parent.pop(int(last))
            elif last in parent:
                del parent[last]
            else:
                raise ApiError(
                    422,
                    "Invalid",
                    f"the server rejected our request due to an error in our request: remove operation does not "
                    f"apply: doc is missing path: {op['path']}",
                )
        else:
            raise ApiError(400, "BadRequest", f"unsupported JSON patch operation {kind}")
    return doc


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    # Split on commas that are not inside parentheses.
    terms, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    terms.append(cur)
    for term in (t.strip() for t in terms):
        if not term:
            continue
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term)
        if m:
            values = {v.strip() for v in m.group(3).split(",")}
            has = m.group(1) in labels and labels[m.group(1)] in values
            if (m.group(2) == "in") != has:
                return False
            continue
        m = re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term)
        if m:
            key, op, value = m.groups()
            if (labels.get(key) == value) != (op != "!="):
                return False
            continue
        if term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def check_selector(selector: str) -> None:
    for term in re.split(r",(?![^(]*\))", selector or ""):
        term = term.strip()
        if term and not re.fullmatch(
            r"!?[A-Za-z0-9./_-]+|[A-Za-z0-9./_-]+\s*(==|=|!=)\s*[A-Za-z0-9._-]*|"
            r"[A-Za-z0-9./_-]+\s+(in|notin)\s+\([A-Za-z0-9._,\s-]*\)",
            term,
        ):
            raise ApiError(400, "BadRequest", f"unable to parse requirement: invalid label selector: {term!r}")


class FakeKube:
    """The fake API server; start() it, write_kubeconfig() for the client, stop() to refuse connections."""

    def __init__(self, schema_path: Path | None = None, finalize_delay_s: float = 0.3):
        self.schema = load_schema(schema_path)
        self.validator = jsonschema.Draft4Validator(
            self.schema, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER
        )
        self.rayjobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.logs: dict[tuple[str, str, str], str] = {}
        self.requests: list[dict] = []
        self.schema_errors: list[str] = []
        self.mode = "ok"
        self.forbidden_verbs: set[str] = set()
        self.before = None
        self._conns: set = set()
        self.finalize_delay_s = finalize_delay_s
        self._rv = 1000
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._timers: list[threading.Timer] = []

    # Lifecycle.
    def start(self) -> FakeKube:
        fake = self

        class Handler(_Handler):
            server_fake = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True, name="fake-k8s").start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        """Stop listening and drop open keep-alive connections: clients get connection refused from now on."""
        import socket

        for t in self._timers:
            t.cancel()
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def write_kubeconfig(self, path: Path, namespace: str = "default", server: str | None = None) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": server or self.url}}],
            "users": [{"name": "tester", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    # Store.
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def rayjob(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            obj = self.rayjobs.get((namespace, name))
            return copy.deepcopy(obj) if obj else None

    def add_rayjob(
        self, obj: dict, status: dict | None = None, finalizers: list[str] | None = None, created: str | None = None
    ) -> dict:
        """Create as a client would (validated), then play the operator: finalizers and status."""
        ns = obj["metadata"].get("namespace", "default")
        stored = self._create(ns, copy.deepcopy(obj))
        with self._lock:
            live = self.rayjobs[(ns, stored["metadata"]["name"])]
            if finalizers:
                live["metadata"]["finalizers"] = list(finalizers)
            if created:
                live["metadata"]["creationTimestamp"] = created
            if status is not None:
                live["status"] = copy.deepcopy(status)
            live["metadata"]["resourceVersion"] = self._next_rv()
            return copy.deepcopy(live)

    def set_status(self, namespace: str, name: str, status: dict) -> None:
        with self._lock:
            live = self.rayjobs[(namespace, name)]
            live["status"] = copy.deepcopy(status)
            live["metadata"]["resourceVersion"] = self._next_rv()

    def add_pod(
        self,
        namespace: str,
        name: str,
        labels: dict,
        containers: list[str],
        logs: dict[str, str],
        phase: str = "Running",
        created: str | None = None,
    ) -> None:
        with self._lock:
            self.pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "labels": labels,
                    "uid": str(uuid.uuid4()),
                    "resourceVersion": self._next_rv(),
                    "creationTimestamp": created or now(),
                },
                "spec": {"containers": [{"name": c, "image": "rayproject/ray:2.60.0"} for c in containers]},
                "status": {"phase": phase},
            }
            for container, text in logs.items():
                self.logs[(namespace, name, container)] = text

    def validate_rayjob(self, obj: dict, namespace: str) -> None:
        problems = []
        if obj.get("apiVersion") != "ray.io/v1" or obj.get("kind") != "RayJob":
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({obj.get('apiVersion')}) and kind "
                f"({obj.get('kind')}) do not match ray.io/v1, RayJob",
            )
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            problems.append("metadata: Required value")
            meta = {}
        name = meta.get("name", "")
        if not name:
            problems.append("metadata.name: Required value: name or generateName is required")
        elif len(name) > 253 or not DNS_SUBDOMAIN.match(name):
            problems.append(
                f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain must consist of "
                "lower case alphanumeric characters, '-' or '.'"
            )
        if meta.get("namespace") not in (None, namespace):
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        for key, value in (meta.get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
                problems.append(
                    f"metadata.labels: Invalid value: {value!r}: a valid label must be 63 characters or less"
                )
            if not LABEL_NAME.match(key.split("/")[-1]) or len(key.split("/")[-1]) > 63:
                problems.append(
                    f"metadata.labels: Invalid value: {key!r}: name part must consist of alphanumeric characters"
                )
        for key, value in (meta.get("annotations") or {}).items():
            if not isinstance(value, str):
                problems.append(f"metadata.annotations.{key}: Invalid value: must be a string")
        unknown_meta = set(meta) - {
            "name",
            "generateName",
            "namespace",
            "labels",
            "annotations",
            "finalizers",
            "ownerReferences",
            *SERVER_METADATA,
        }
        problems += [f'unknown field "metadata.{k}"' for k in sorted(unknown_meta)]
        problems += [
            f'unknown field "{f}"'
            for f in unknown_fields({k: v for k, v in obj.items() if k != "metadata"}, self.schema)
        ]
        for error in sorted(self.validator.iter_errors(obj), key=lambda e: list(e.path)):
            where = ".".join(str(p) for p in error.path) or "<root>"
            problems.append(f"{where}: Invalid value: {error.message}")
        if problems:
            self.schema_errors += problems
            raise ApiError(
                422,
                "Invalid",
                f'RayJob.ray.io "{name}" is invalid: ' + "; ".join(problems),
                {
                    "name": name,
                    "group": "ray.io",
                    "kind": "RayJob",
                    "causes": [{"reason": "FieldValueInvalid", "message": p} for p in problems],
                },
            )

    def _create(self, namespace: str, obj: dict) -> dict:
        apply_defaults(obj, self.schema)  # the server defaults, then validates
        self.validate_rayjob(obj, namespace)
        meta = obj["metadata"]
        name = meta["name"]
        with self._lock:
            existing = self.rayjobs.get((namespace, name))
            if existing:
                prefix = "object is being deleted: " if existing["metadata"].get("deletionTimestamp") else ""
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{prefix}rayjobs.ray.io "{name}" already exists',
                    {"name": name, "group": "ray.io", "kind": "rayjobs"},
                )
            for key in SERVER_METADATA:
                meta.pop(key, None)
            meta.update(
                namespace=namespace,
                uid=str(uuid.uuid4()),
                generation=1,
                creationTimestamp=now(),
                resourceVersion=self._next_rv(),
            )
            obj.pop("status", None)  # status subresource: ignored on create
            self.rayjobs[(namespace, name)] = obj
            return copy.deepcopy(obj)

    def _replace(self, namespace: str, name: str, new: dict, require_rv: bool) -> dict:
        with self._lock:
            live = self.rayjobs.get((namespace, name))
            if live is None:
                raise _not_found(name)
            meta = new.get("metadata") or {}
            rv = meta.get("resourceVersion")
            if require_rv and not rv:
                raise ApiError(
                    422,
                    "Invalid",
                    f'RayJob.ray.io "{name}" is invalid: metadata.resourceVersion: Invalid '
                    "value: 0x0: must be specified for an update",
                )
            if rv and rv != live["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on rayjobs.ray.io "{name}": the object '
                    "has been modified; please apply your changes to the latest version and try again",
                    {"name": name, "group": "ray.io", "kind": "rayjobs"},
                )
            if meta.get("name", name) != name:
                raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
            apply_defaults(new, self.schema)
            self.validate_rayjob(new, namespace)
            for key in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds"):
                if key in live["metadata"]:
                    meta[key] = live["metadata"][key]
                else:
                    meta.pop(key, None)
            meta["namespace"] = namespace
            new["metadata"] = meta
            if "status" in live:
                new["status"] = live["status"]  # status subresource: writes here never change it
            else:
                new.pop("status", None)
            if new.get("spec") != live.get("spec"):
                meta["generation"] = live["metadata"]["generation"] + 1
            meta["resourceVersion"] = self._next_rv()
            self.rayjobs[(namespace, name)] = new
            if live["metadata"].get("deletionTimestamp") and not meta.get("finalizers"):
                del self.rayjobs[(namespace, name)]
            return copy.deepcopy(new)

    def _delete(self, namespace: str, name: str, options: dict, policy: str | None) -> dict:
        with self._lock:
            live = self.rayjobs.get((namespace, name))
            if live is None:
                raise _not_found(name)
            pre = options.get("preconditions") or {}
            meta = live["metadata"]
            if pre.get("uid") and pre["uid"] != meta["uid"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on rayjobs.ray.io "{name}": Precondition '
                    f"failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on rayjobs.ray.io "{name}": Precondition '
                    f"failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {meta['resourceVersion']}",
                )
            policy = policy or options.get("propagationPolicy")
            if policy not in (None, "Foreground", "Background", "Orphan"):
                raise ApiError(
                    422,
                    "Invalid",
                    f"DeleteOptions.meta.k8s.io is invalid: propagationPolicy: Unsupported value: {policy!r}",
                )
            finalizers = list(meta.get("finalizers") or [])
            if policy == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            if policy == "Orphan" and "orphan" not in finalizers:
                finalizers.append("orphan")
            if not finalizers:
                del self.rayjobs[(namespace, name)]
                return copy.deepcopy(live)
            if not meta.get("deletionTimestamp"):
                meta.update(
                    finalizers=finalizers,
                    deletionTimestamp=now(),
                    deletionGracePeriodSeconds=0,
                    resourceVersion=self._next_rv(),
                )
                timer = threading.Timer(self.finalize_delay_s, self._finalize, (namespace, name, meta["uid"]))
                timer.daemon = True
                self._timers.append(timer)
                timer.start()
            return copy.deepcopy(live)

    def _finalize(self, namespace: str, name: str, uid: str) -> None:
        """The operator and the garbage collector finish: dependents gone, finalizers removed, object deleted."""
        with self._lock:
            live = self.rayjobs.get((namespace, name))
            if live and live["metadata"]["uid"] == uid:
                del self.rayjobs[(namespace, name)]

    # Request dispatch (called by the handler).
    def handle(self, method: str, path: str, query: dict, headers, body: bytes, record: dict | None = None):
        record = record if record is not None else {}
        record.update(
            method=method,
            path=path,
            query=query,
            body=body.decode() if body else "",
            content_type=headers.get("Content-Type", ""),
            code=None,
            time=time.time(),
        )
        self.requests.append(record)
        if self.before:
            self.before(method, path)
        if headers.get("Authorization") != f"Bearer {TOKEN}" or self.mode == "unauthorized":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        m = re.fullmatch(r"/apis/ray\.io/v1/namespaces/([^/]+)/rayjobs(?:/([^/]+))?", path)
        if m and self.mode == "no-crd":
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if m:
            ns, name = m.groups()
            verb = {
                "GET": "get" if name else "list",
                "POST": "create",
                "PUT": "update",
                "PATCH": "patch",
                "DELETE": "delete",
            }.get(method)
            if verb is None or (verb == "create" and name):
                raise ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                )
            if self.mode == "forbidden" or verb in self.forbidden_verbs:
                user = "system:serviceaccount:default:tester"
                who = f'"{name}" ' if name else ""
                raise ApiError(
                    403,
                    "Forbidden",
                    f'rayjobs.ray.io {who}is forbidden: User "{user}" cannot {verb} resource '
                    f'"rayjobs" in API group "ray.io" in the namespace "{ns}"',
                    {"name": name or "", "group": "ray.io", "kind": "rayjobs"},
                )
            return self._rayjobs(verb, ns, name, query, headers, body)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)(/log)?)?", path)
        if m and method == "GET":
            ns, name, is_log = m.groups()
            if self.mode == "forbidden":
                raise ApiError(
                    403,
                    "Forbidden",
                    f'pods is forbidden: User "tester" cannot list resource "pods" in API group "" in the '
                    f'namespace "{ns}"',
                )
            return self._pods(ns, name, bool(is_log), query)
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _rayjobs(self, verb: str, ns: str, name: str | None, query: dict, headers, body: bytes):
        def parsed():
            try:
                return json.loads(body or b"null")
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"the body of the request was in an unknown format: {exc}") from None

        if verb == "list":
            selector = query.get("labelSelector", [""])[0]
            check_selector(selector)
            with self._lock:
                items = [
                    copy.deepcopy(o)
                    for (n, _), o in sorted(self.rayjobs.items())
                    if n == ns and label_selector_matches(selector, o["metadata"].get("labels") or {})
                ]
                return 200, {
                    "apiVersion": "ray.io/v1",
                    "kind": "RayJobList",
                    "items": items,
                    "metadata": {"resourceVersion": str(self._rv)},
                }
        if verb == "get":
            obj = self.rayjob(ns, name)
            if obj is None:
                raise _not_found(name)
            return 200, obj
        if verb == "create":
            obj = parsed()
            if not isinstance(obj, dict):
                raise ApiError(400, "BadRequest", "the body of the request must be an object")
            return 201, self._create(ns, obj)
        if verb == "update":
            return 200, self._replace(ns, name, parsed(), require_rv=True)
        if verb == "patch":
            ctype = (headers.get("Content-Type") or "").split(";")[0].strip()
            live = self.rayjob(ns, name)
            if live is None:
                raise _not_found(name)
            patch = parsed()
            if ctype == "application/merge-patch+json":
                new = merge_patch(live, patch)
            elif ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise ApiError(
                        400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
                    )
                new = json_patch(live, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted "
                    "media types include: application/json-patch+json, "
                    "application/merge-patch+json, application/apply-patch+yaml",
                )
            # A patch carries resourceVersion only when the client asks for optimistic concurrency.
            if isinstance(patch, dict) and not (patch.get("metadata") or {}).get("resourceVersion"):
                new["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
            return 200, self._replace(ns, name, new, require_rv=False)
        if verb == "delete":
            options = json.loads(body) if body and body.strip() else {}
            policy = query.get("propagationPolicy", [None])[0]
            return 200, self._delete(ns, name, options or {}, policy)
        raise AssertionError(verb)

    def _pods(self, ns: str, name: str | None, is_log: bool, query: dict):
        if name is None:
            selector = query.get("labelSelector", [""])[0]
            check_selector(selector)
            with self._lock:
                items = [
                    copy.deepcopy(p)
                    for (n, _), p in sorted(self.pods.items())
                    if n == ns and label_selector_matches(selector, p["metadata"]["labels"])
                ]
            return 200, {
                "apiVersion": "v1",
                "kind": "PodList",
                "items": items,
                "metadata": {"resourceVersion": str(self._rv)},
            }
        pod = self.pods.get((ns, name))
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})
        if not is_log:
            return 200, copy.deepcopy(pod)
        containers = [c["name"] for c in pod["spec"]["containers"]]
        container = query.get("container", [None])[0]
        if container is None:
            if len(containers) > 1:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]",
                )
            container = containers[0]
        if container not in containers:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        if pod["status"]["phase"] == "Pending":
            raise ApiError(
                400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
        text = self.logs.get((ns, name, container), "")
        tail = query.get("tailLines", [None])[0]
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail) :]) if int(tail) > 0 else ""
        return 200, _LogText(text, follow=query.get("follow", ["false"])[0] == "true")


class _LogText:
    def __init__(self, text: str, follow: bool):
        self.text, self.follow = text, follow


def _not_found(name: str) -> ApiError:
    return ApiError(
        404, "NotFound", f'rayjobs.ray.io "{name}" not found', {"name": name, "group": "ray.io", "kind": "rayjobs"}
    )


class _Handler(BaseHTTPRequestHandler):
    server_fake: FakeKube
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _serve(self) -> None:
        self.server_fake._conns.add(self.connection)
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        record: dict = {}
        try:
            code, payload = self.server_fake.handle(
                self.command, parts.path, parse_qs(parts.query), self.headers, body, record
            )
        except ApiError as exc:
            code, payload = exc.code, exc.status()
        except Exception as exc:  # noqa: BLE001 - a bug in the fake must show up as a 500, not hang the client
            code, payload = (
                500,
                ApiError(500, "InternalError", f"fake server error: {type(exc).__name__}: {exc}").status(),
            )
        record["code"] = code
        if isinstance(payload, _LogText):
            self._send_log(payload)
            return
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_log(self, log: _LogText) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        if not log.follow:
            data = log.text.encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        # follow: chunked, line by line, as the kubelet streams a running container.
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for line in log.text.splitlines(keepends=True):
            data = line.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve
