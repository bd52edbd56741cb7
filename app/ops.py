"""`finetune status / logs / resume`: operate an experiment's RayJob from a terminal through the Kubernetes API.

RayJobs are found by the label ray-finetune/experiment=<experiment> that the chart puts on them.
Credentials: the kubeconfig (KUBECONFIG or ~/.kube/config, current context), else the pod's ServiceAccount.
Every API failure becomes one line that says what to check, and an exit code of `app.exit_codes`.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app import experiment_folder, kube, logs
from app.errors import seconds
from app.exit_codes import Exit
from app.progress import duration
from app.progress import parse as parse_progress

COMMANDS = ("status", "logs", "resume")
TIMEOUT = (kube.CONNECT_TIMEOUT_S, kube.READ_TIMEOUT_S)
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ACTIVE = ("pending", "running", "retrying", "suspending")  # states resume refuses without --force
SUBMITTER_CONTAINER = "ray-job-submitter"


class OpsError(Exception):
    def __init__(self, message: str, code: Exit):
        super().__init__(message)
        self.code = code


def register(sub) -> None:
    """Add `status`, `logs` and `resume` to the CLI's subparsers."""
    epilog = (
        "Credentials: the kubeconfig's current context (KUBECONFIG or ~/.kube/config), else the pod's "
        f"ServiceAccount. The experiment's RayJobs are those labelled {kube.EXPERIMENT_LABEL}=EXPERIMENT."
    )

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "experiment",
            metavar="EXPERIMENT",
            help="experiment name (training.experiment.name in the chart); for status also a local experiment "
            "folder, a path with a '/' (e.g. ./runs/exp1)",
        )
        p.add_argument(
            "-n", "--namespace", help="namespace of the RayJob (default: the kubeconfig context's, else 'default')"
        )

    p = sub.add_parser(
        "status",
        help="show an experiment's RayJob state and live training progress",
        description="Show the experiment's RayJob(s): job and deployment status, RayCluster, retry "
        "counts, start/end, and the latest progress record the training publishes on the "
        "RayJob (step, loss and its curve, tokens/s, ETA, the latest checkpoint). "
        f"Exit {Exit.OK} when running, pending or succeeded, {Exit.FAILED} when failed, {Exit.NOT_FOUND} when no "
        f"RayJob is found, {Exit.API_UNREACHABLE} when the API cannot be asked. Given a folder path instead, the "
        f"same from a local experiment folder's files (exit {Exit.OK}, {Exit.INVALID} when it is not one).",
        epilog=epilog,
    )
    common(p)
    p.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format (default: table)")

    p = sub.add_parser(
        "logs",
        help="print (or follow) the logs of an experiment's job submitter or Ray head",
        description="Print the logs of the experiment's newest RayJob: its submitter (the pod of the "
        "Kubernetes Job that runs `ray job submit`, or the head's submitter sidecar), which "
        "carry the training driver's output; the Ray head pod's when there is no submitter "
        "or with --head.",
        epilog=epilog,
    )
    common(p)
    p.add_argument(
        "-f", "--follow", action="store_true", help="keep streaming new lines until the container ends (Ctrl-C stops)"
    )
    p.add_argument("--head", action="store_true", help="show the Ray head pod's container instead of the submitter")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="every line the pod wrote; default: the quiet view of a local run (app lines and warnings)",
    )

    p = sub.add_parser(
        "resume",
        help="delete and re-create a finished, failed or stuck RayJob so it resumes",
        description="Delete the experiment's RayJob (with its own RayCluster; never the checkpoint "
        "PVC) and create it again with the same spec, read from the live object minus "
        "status and server-set fields. The new run continues from the last complete "
        "checkpoint of the experiment. Refuses while the job is pending or running unless "
        "--force. The spec is saved to a file first, so it is never lost.",
        epilog=epilog,
    )
    common(p)
    p.add_argument("--force", action="store_true", help="also resume a job that is pending or running (e.g. stuck)")
    p.add_argument(
        "--wait",
        type=seconds,
        default=600,
        metavar="SECONDS",
        help="how long to wait for the old RayJob and its RayCluster to be gone (default: 600)",
    )


def main(args: argparse.Namespace) -> Exit:
    """Run one of COMMANDS; every failure ends as one line on stderr and an exit code."""
    try:
        if args.command == "status" and experiment_folder.looks_like_a_folder(args.experiment):
            return cmd_folder_status(args)
        check_name(args.experiment, args.namespace)
        return {"status": cmd_status, "logs": cmd_logs, "resume": cmd_resume}[args.command](args)
    except OpsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except kube.KubeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Exit.API_UNREACHABLE
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


def check_name(experiment: str, namespace: str | None) -> None:
    if not LABEL_VALUE.match(experiment or ""):
        raise OpsError(
            f"EXPERIMENT {experiment!r} is not a valid experiment name: use at most 63 letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit",
            Exit.INVALID,
        )
    if namespace is not None and not DNS_LABEL.match(namespace):
        raise OpsError(
            f"-n {namespace!r} is not a valid namespace: lowercase letters, digits and '-', at most 63", Exit.INVALID
        )


class Session:
    """An API client, the namespace to use and a way to call the API with bounded time and one-line errors."""

    def __init__(self, namespace: str | None):
        from kubernetes import client

        self.api_client, default_ns, self.source = kube.connect(prefer_in_cluster=False, retries=False)
        self.namespace = namespace or default_ns
        self.host = self.api_client.configuration.host
        self.custom = client.CustomObjectsApi(self.api_client)
        self.core = client.CoreV1Api(self.api_client)

    def call(self, action: str, fn, *args, **kwargs):
        try:
            return fn(*args, _request_timeout=kwargs.pop("_request_timeout", TIMEOUT), **kwargs)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            raise OpsError(kube.describe(exc, action, self.namespace, self.host), Exit.API_UNREACHABLE) from None

    def rayjobs(self, experiment: str) -> list[dict]:
        """The experiment's RayJobs, oldest first."""
        result = self.call(
            "list rayjobs.ray.io",
            self.custom.list_namespaced_custom_object,
            kube.GROUP,
            kube.VERSION,
            self.namespace,
            kube.PLURAL,
            label_selector=f"{kube.EXPERIMENT_LABEL}={experiment}",
        )
        items = result.get("items") or []
        return sorted(items, key=lambda o: (o["metadata"].get("creationTimestamp") or "", o["metadata"]["name"]))

    def get(self, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(
                kube.GROUP, kube.VERSION, self.namespace, kube.PLURAL, name, _request_timeout=TIMEOUT
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise OpsError(
                kube.describe(exc, "get rayjobs.ray.io", self.namespace, self.host), Exit.API_UNREACHABLE
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise OpsError(
                kube.describe(exc, "get rayjobs.ray.io", self.namespace, self.host), Exit.API_UNREACHABLE
            ) from None

    def not_found(self, experiment: str) -> OpsError:
        return OpsError(
            f"no RayJob labelled {kube.EXPERIMENT_LABEL}={experiment} in namespace {self.namespace}; check "
            f"the name and -n (kubectl get rayjobs -A -l {kube.EXPERIMENT_LABEL}={experiment})",
            Exit.NOT_FOUND,
        )


# State.
def state_of(job: dict) -> str:
    """pending, running, retrying, suspending, suspended, succeeded, failed or deleting."""
    st = job.get("status") or {}
    dep, js = st.get("jobDeploymentStatus") or "", st.get("jobStatus") or ""
    if job["metadata"].get("deletionTimestamp"):
        return "deleting"
    if dep in ("Failed", "ValidationFailed"):
        return "failed"
    if dep == "Complete":
        return "succeeded" if js == "SUCCEEDED" else "failed"
    if dep in ("Suspended", "Suspending", "Retrying", "Running"):
        return dep.lower()
    return "pending"  # "", New, Initializing, Waiting


def exit_code(state: str) -> Exit:
    return Exit.FAILED if state == "failed" else Exit.OK


def summary(job: dict) -> dict[str, Any]:
    meta, st, spec = job["metadata"], job.get("status") or {}, job.get("spec") or {}
    return {
        "name": meta["name"],
        "namespace": meta.get("namespace"),
        "uid": meta.get("uid"),
        "created": meta.get("creationTimestamp"),
        "state": state_of(job),
        "jobStatus": st.get("jobStatus"),
        "jobDeploymentStatus": st.get("jobDeploymentStatus"),
        "rayClusterName": st.get("rayClusterName"),
        "jobId": st.get("jobId"),
        "succeeded": st.get("succeeded"),
        "failed": st.get("failed"),
        "backoffLimit": spec.get("backoffLimit"),
        "startTime": st.get("startTime"),
        "endTime": st.get("endTime"),
        "reason": st.get("reason"),
        "message": st.get("message"),
        "progress": parse_progress((meta.get("annotations") or {}).get(kube.PROGRESS_ANNOTATION)),
    }


# status
def cmd_status(args) -> Exit:
    s = Session(args.namespace)
    jobs = [summary(j) for j in s.rayjobs(args.experiment)]
    state = jobs[-1]["state"] if jobs else "not-found"
    if args.output == "json":
        print(
            json.dumps(
                {"experiment": args.experiment, "namespace": s.namespace, "state": state, "rayjobs": jobs}, indent=2
            )
        )
    if not jobs:
        raise s.not_found(args.experiment)
    if args.output == "table":
        print(render_table(args.experiment, s.namespace, jobs))
    return exit_code(state)


def cmd_folder_status(args) -> Exit:
    """`finetune status PATH`: a local experiment folder, read from its files."""
    from app.data import manifest

    run_dir = Path(args.experiment).expanduser().absolute()
    if not run_dir.is_dir():
        raise OpsError(f"{args.experiment}: no such experiment folder (pass <storage>/<experiment>)", Exit.INVALID)
    if (prepared := manifest.read_manifest(run_dir)) is not None:  # <storage>/prepared/<key>
        print(json.dumps(prepared, indent=2) if args.output == "json" else manifest.render(run_dir, prepared))
        return Exit.OK
    info = experiment_folder.describe(run_dir)
    print(json.dumps(info, indent=2) if args.output == "json" else experiment_folder.render(info))
    return Exit.OK


def render_table(experiment: str, namespace: str, jobs: list[dict]) -> str:
    header = (
        "RAYJOB",
        "STATE",
        "JOB STATUS",
        "DEPLOYMENT",
        "CLUSTER",
        "SUCCEEDED",
        "FAILED",
        "BACKOFF LIMIT",
        "STARTED",
        "ENDED",
    )
    rows = [header] + [
        (
            j["name"],
            j["state"],
            j["jobStatus"] or "-",
            j["jobDeploymentStatus"] or "-",
            j["rayClusterName"] or "-",
            _num(j["succeeded"]),
            _num(j["failed"]),
            _num(j["backoffLimit"]),
            j["startTime"] or "-",
            j["endTime"] or "-",
        )
        for j in jobs
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = [f"experiment {experiment} in namespace {namespace}: {jobs[-1]['state']}", ""]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for j in jobs:
        if j["message"] or j["reason"]:
            lines.append(
                f"{j['name']}: {j['reason'] or ''}{': ' if j['reason'] and j['message'] else ''}{j['message'] or ''}"
            )
    for j in jobs:
        lines += [""] + render_progress(j["name"], j["progress"])
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else str(value)


def render_progress(name: str, p: dict | None) -> list[str]:
    if not p:
        return [f"progress of {name}: none published yet"]
    updated = p.get("updated_at")
    ago = _ago(updated)
    lines = [f"progress of {name} (updated {updated or '?'}{f', {ago} ago' if ago else ''}):"]
    step, total = p.get("step"), p.get("total_steps")
    if step is not None:
        pct = f" ({step / total:.0%})" if total else ""
        lines.append(f"  step         {step}/{total if total is not None else '?'}{pct}, epoch {_num(p.get('epoch'))}")
    if p.get("loss") is not None or p.get("eval_loss") is not None:
        lines.append(f"  loss         {_fmt(p.get('loss'))}   eval loss {_fmt(p.get('eval_loss'))}")
    if p.get("tokens_per_s_per_gpu") is not None:
        lines.append(
            f"  throughput   {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, world size {_num(p.get('world_size'))}"
        )
    if p.get("eta_s") is not None:
        lines.append(f"  eta          {duration(p['eta_s'])}")
    if p.get("last_checkpoint"):
        lines.append(f"  checkpoint   {p['last_checkpoint']} (step {_num(p.get('last_checkpoint_step'))})")
    if p.get("resumed_from"):
        lines.append(f"  resumed from {p['resumed_from']}")
    if isinstance(p.get("loss_curve"), list):
        lines += experiment_folder.curve_lines([pt for pt in p["loss_curve"] if isinstance(pt, list) and len(pt) == 2])
    return lines


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _ago(stamp: str | None) -> str | None:
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return None
    return duration((datetime.now(timezone.utc) - then).total_seconds())


# logs
def cmd_logs(args) -> Exit:
    s = Session(args.namespace)
    jobs = s.rayjobs(args.experiment)
    if not jobs:
        raise s.not_found(args.experiment)
    job = jobs[-1]
    pod, container, what = log_source(s, job, args.head)
    kwargs = {"container": container, "follow": args.follow, "_preload_content": False}
    if args.tail is not None:
        kwargs["tail_lines"] = max(args.tail, 0)
    # Following may stay quiet for long stretches: bound only the connect time then.
    timeout = (kube.CONNECT_TIMEOUT_S, 7 * 24 * 3600.0) if args.follow else TIMEOUT
    try:
        resp = s.call(
            "get pods/log", s.core.read_namespaced_pod_log, pod, s.namespace, _request_timeout=timeout, **kwargs
        )
    except OpsError as exc:
        if "(400:" in str(exc):  # the container has not started (or is gone): say which pod to look at
            raise OpsError(
                f"{exc}; the pod is not ready for logs yet, try again shortly or run "
                f"`kubectl describe pod {pod} -n {s.namespace}`",
                exc.code,
            ) from None
        raise
    print(
        f"# {what}: pod {pod}, container {container} (RayJob {s.namespace}/{job['metadata']['name']})", file=sys.stderr
    )
    out = logs.StreamView(sys.stdout.buffer, show_all=args.verbose)
    try:
        for chunk in resp.stream(8192, decode_content=True):
            out.write(chunk)
        out.close()
    except BrokenPipeError:
        return Exit.OK
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the stream broke: say so in one line
        raise OpsError(
            f"log stream of pod {pod} ended early: {kube.describe(exc, 'get pods/log', s.namespace, s.host)}",
            Exit.API_UNREACHABLE,
        ) from None
    finally:
        resp.release_conn()
    return Exit.OK


def log_source(s: Session, job: dict, head: bool) -> tuple[str, str, str]:
    """(pod, container, description) of the submitter, else the head."""
    name = job["metadata"]["name"]
    spec, st = job.get("spec") or {}, job.get("status") or {}
    mode = spec.get("submissionMode") or "K8sJobMode"
    if not head and mode == "K8sJobMode":
        for selector in (f"batch.kubernetes.io/job-name={name}", f"job-name={name}"):
            pods = _pods(s, selector)
            if pods:
                pod = pods[-1]
                return (
                    pod["metadata"]["name"],
                    pod["spec"]["containers"][0]["name"],
                    "submitter (training driver output)",
                )
    cluster = st.get("rayClusterName")
    if not cluster:
        raise OpsError(
            f"RayJob {s.namespace}/{name} has no submitter pod and no RayCluster yet (deployment status "
            f"{st.get('jobDeploymentStatus') or 'New'}); try again shortly, or check `kubectl describe rayjob "
            f"{name} -n {s.namespace}`",
            Exit.NOT_FOUND,
        )
    pods = _pods(s, f"ray.io/cluster={cluster},ray.io/node-type=head")
    if not pods:
        raise OpsError(
            f"no head pod of RayCluster {cluster} in namespace {s.namespace}; check `kubectl get pods -n "
            f"{s.namespace} -l ray.io/cluster={cluster}`",
            Exit.NOT_FOUND,
        )
    pod = pods[-1]
    containers = [c["name"] for c in pod["spec"]["containers"]]
    if not head and mode == "SidecarMode" and SUBMITTER_CONTAINER in containers:
        return pod["metadata"]["name"], SUBMITTER_CONTAINER, "submitter sidecar (training driver output)"
    note = "" if head else f"; no submitter in {mode}, the driver's output is in `ray job logs`"
    return pod["metadata"]["name"], containers[0], f"Ray head{note}"


def _pods(s: Session, selector: str) -> list[dict]:
    result = s.call("list pods", s.core.list_namespaced_pod, s.namespace, label_selector=selector)
    pods = [s.api_client.sanitize_for_serialization(p) for p in result.items]
    return sorted(pods, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))


# resume
SERVER_FIELDS = (
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
    "finalizers",
)


def recreate_body(job: dict) -> dict:
    """The object to create again: the live one minus status, server-set metadata and the stale progress record."""
    meta = copy.deepcopy(job["metadata"])
    for key in (*SERVER_FIELDS, "generateName"):
        meta.pop(key, None)
    annotations = meta.get("annotations") or {}
    annotations.pop(kube.PROGRESS_ANNOTATION, None)
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    return {
        "apiVersion": job.get("apiVersion") or f"{kube.GROUP}/{kube.VERSION}",
        "kind": job.get("kind") or kube.KIND,
        "metadata": meta,
        "spec": copy.deepcopy(job.get("spec") or {}),
    }


def cmd_resume(args) -> Exit:
    s = Session(args.namespace)
    job = _the_one_rayjob(s, args.experiment)
    name = job["metadata"]["name"]
    where = f"RayJob {s.namespace}/{name}"
    state = _stopped_state(job, where, args.force)

    body = recreate_body(job)
    saved = Path(tempfile.gettempdir()) / f"finetune-resume-{s.namespace}-{name}-{job['metadata']['uid'][:8]}.json"
    saved.write_text(json.dumps(body, indent=2) + "\n")
    print(f"saved its spec to {saved}")

    if state != "deleting":
        _delete(s, job)
        print(f"deleting {where} and, first, its RayCluster (the checkpoint volume is not touched)...", flush=True)
    else:
        print(f"{where} is already being deleted; waiting for it to go...", flush=True)
    _wait_until_gone(s, job, where, args.wait, saved)
    try:
        created = s.call(
            "create rayjobs.ray.io",
            s.custom.create_namespaced_custom_object,
            kube.GROUP,
            kube.VERSION,
            s.namespace,
            kube.PLURAL,
            body,
            field_manager="finetune",
        )
    except OpsError as exc:
        raise OpsError(
            f"deleted {where} but could not create it again: {exc}; create it with `kubectl create -f {saved}`",
            Exit.FAILED,
        ) from None
    print(
        f"created {where} again (uid {created['metadata']['uid']}) with the same spec: it resumes experiment "
        f"{args.experiment} from its last complete checkpoint"
    )
    if (body["spec"] or {}).get("suspend"):
        print("note: its spec has suspend: true, so it waits until that is set to false")
    print(
        f"follow it: finetune status {args.experiment} -n {s.namespace}; finetune logs {args.experiment} -n "
        f"{s.namespace} -f"
    )
    return Exit.OK


def _the_one_rayjob(s: Session, experiment: str) -> dict:
    """The experiment's RayJob; an error when there is none or more than one."""
    jobs = s.rayjobs(experiment)
    if not jobs:
        raise s.not_found(experiment)
    if len(jobs) > 1:
        names = ", ".join(j["metadata"]["name"] for j in jobs)
        raise OpsError(
            f"{len(jobs)} RayJobs carry {kube.EXPERIMENT_LABEL}={experiment} in namespace {s.namespace} "
            f"({names}); two runs of one experiment must not run at once: delete all but one, then resume",
            Exit.FAILED,
        )
    return jobs[0]


def _stopped_state(job: dict, where: str, force: bool) -> str:
    """The job's state, printed with its last published checkpoint; an error while it still runs (unless
    `force`)."""
    info = summary(job)
    state = info["state"]
    if state in ACTIVE and not force:
        raise OpsError(
            f"{where} is {state} (job {info['jobStatus'] or '-'}, deployment {info['jobDeploymentStatus'] or '-'}); "
            "resuming would stop it. Wait for it to finish, or pass --force if it is stuck",
            Exit.FAILED,
        )
    progress = info["progress"] or {}
    checkpoint = (
        f"last published checkpoint {progress['last_checkpoint']} (step {progress.get('last_checkpoint_step')})"
        if progress.get("last_checkpoint")
        else "no checkpoint published on it"
    )
    print(
        f"{where} is {state} (job {info['jobStatus'] or '-'}, deployment {info['jobDeploymentStatus'] or '-'}, "
        f"{info['failed'] or 0} failed attempts); {checkpoint}"
    )
    return state


def _delete(s: Session, job: dict) -> None:
    """Deletes this very object (its uid and version), its RayCluster first (foreground propagation)."""
    from kubernetes import client

    meta = job["metadata"]
    options = client.V1DeleteOptions(
        propagation_policy="Foreground",
        preconditions=client.V1Preconditions(uid=meta["uid"], resource_version=meta["resourceVersion"]),
    )
    s.call(
        "delete rayjobs.ray.io",
        s.custom.delete_namespaced_custom_object,
        kube.GROUP,
        kube.VERSION,
        s.namespace,
        kube.PLURAL,
        meta["name"],
        body=options,
    )


def _wait_until_gone(s: Session, job: dict, where: str, wait: float, saved: Path) -> None:
    """Waits up to `wait` seconds for the job to be deleted; an error when someone created it again meanwhile."""
    name, uid = job["metadata"]["name"], job["metadata"]["uid"]
    t0 = time.monotonic()
    while True:
        live = s.get(name)
        if live is None:
            break
        if live["metadata"]["uid"] != uid:
            raise OpsError(
                f"{where} was created again by someone else meanwhile (uid {live['metadata']['uid']}); "
                "nothing more to do",
                Exit.FAILED,
            )
        if time.monotonic() - t0 > wait:
            finalizers = ", ".join(live["metadata"].get("finalizers") or []) or "none"
            raise OpsError(
                f"{where} is still being deleted after {wait:g}s (finalizers: {finalizers}); check that "
                f"the KubeRay operator runs, then create it with `kubectl create -f {saved}`",
                Exit.FAILED,
            )
        time.sleep(0.5)
    print(f"deleted after {time.monotonic() - t0:.1f}s")
