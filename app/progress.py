"""Live progress on the RayJob: a small JSON record in the annotation `finetune.ray.io/progress`.

Rank 0 calls `update()` with what it knows (step, loss, checkpoint...); a daemon thread merges the records
and PATCHes the latest one onto the run's own RayJob every `interval_s`, and at once after
`update(..., force=True)` (checkpoints). The RayJob comes from FINETUNE_RAYJOB_NAME / FINETUNE_RAYJOB_NAMESPACE,
which the chart sets; without them there is no publisher. Credentials: the pod's ServiceAccount, else the
kubeconfig. Nothing here can fail or slow training: `update()` only stores a dict, every API call has a
bounded timeout and runs in the thread, the first failure logs one warning and later ones are retried
quietly, and `close()` waits a bounded time for a last flush.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from datetime import datetime, timezone
from typing import Any

from app import kube

log = logging.getLogger("finetune")

ANNOTATION = kube.PROGRESS_ANNOTATION
ENV_NAME, ENV_NAMESPACE, ENV_INTERVAL = (
    "FINETUNE_RAYJOB_NAME",
    "FINETUNE_RAYJOB_NAMESPACE",
    "FINETUNE_PROGRESS_INTERVAL_S",
)
FIELDS = (
    "step",
    "total_steps",
    "epoch",
    "loss",
    "eval_loss",
    "tokens_per_s_per_gpu",
    "eta_s",
    "last_checkpoint",
    "last_checkpoint_step",
    "world_size",
    "resumed_from",
    "loss_curve",
    "updated_at",
)
CALL_TIMEOUT_S = (3.0, 5.0)  # connect, read: the most one PATCH can take


def _clean(value: Any) -> Any:
    """JSON-safe scalars: tensors and numpy numbers become floats/ints, NaN/inf become null, floats 6 digits."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (TypeError, ValueError, RuntimeError):
            value = str(value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):  # the loss curve: [[step, loss], ...]
        return [_clean(v) for v in value]
    return str(value)


class ProgressPublisher:
    """Publishes the latest progress record as an annotation on one RayJob; see the module docstring."""

    def __init__(self, name: str, namespace: str, interval_s: float, connect=None):
        self.name, self.namespace, self.interval_s = name, namespace, max(float(interval_s), 0.05)
        self._connect = connect or (lambda: kube.connect(prefer_in_cluster=True, retries=False)[0])
        self._api = None
        self._record: dict[str, Any] = {}
        self._dirty = False
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._warned = False
        self.published = 0  # successful PATCHes (for tests and the final log line)
        self._thread = threading.Thread(target=self._run, name="finetune-progress", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, interval_s: float) -> ProgressPublisher | None:
        """A publisher for the RayJob named in the environment, or None outside one.

        FINETUNE_PROGRESS_INTERVAL_S, when set, overrides `interval_s`.
        """
        name = os.environ.get(ENV_NAME, "").strip()
        if not name:
            return None
        namespace = os.environ.get(ENV_NAMESPACE, "").strip() or kube.pod_namespace()
        try:
            interval_s = float(os.environ.get(ENV_INTERVAL, interval_s))
        except ValueError:
            log.warning(f"progress: ignoring {ENV_INTERVAL}={os.environ[ENV_INTERVAL]!r} (not a number)")
        log.info(f"progress: publishing to RayJob {namespace}/{name} (annotation {ANNOTATION}) every {interval_s:g}s")
        return cls(name, namespace, interval_s)

    def update(self, record: dict[str, Any], force: bool = False) -> None:
        """Merge `record` into the latest progress record; never blocks on the network.

        force=True (after a checkpoint) wakes the thread to publish now instead of at the next interval.
        """
        clean = {k: _clean(v) for k, v in record.items()}
        clean.setdefault("updated_at", datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"))
        with self._lock:
            self._record.update(clean)
            self._dirty = True
        if force:
            self._wake.set()

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish the latest record once more and stop; returns within about `timeout_s`."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def record(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._record)

    # The background thread.
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._flush()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            record, self._dirty = dict(self._record), False
        try:
            self._patch(record)
            self.published += 1
        except Exception as exc:  # noqa: BLE001 - progress must never break training
            with self._lock:
                self._dirty = True  # try again at the next interval
            if not self._warned:
                self._warned = True
                log.warning(
                    f"progress: {kube.describe(exc, 'patch rayjobs.ray.io', self.namespace)}; training goes on, "
                    f"progress stays in the logs (retrying quietly every {self.interval_s:g}s)"
                )

    def _patch(self, record: dict[str, Any]) -> None:
        from kubernetes import client

        if self._api is None:
            self._api = client.CustomObjectsApi(self._connect())
        value = json.dumps(record, separators=(",", ":"), sort_keys=True)
        body = {"metadata": {"annotations": {ANNOTATION: value}}}  # a JSON merge patch: touches only this key
        self._api.patch_namespaced_custom_object(
            kube.GROUP, kube.VERSION, self.namespace, kube.PLURAL, self.name, body, _request_timeout=CALL_TIMEOUT_S
        )


def duration(seconds: float) -> str:
    """A short human duration (4m05s, 2h07m): the ETA in progress lines and `finetune status`."""
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def parse(annotation: str | None) -> dict[str, Any] | None:
    """The progress record stored in a RayJob annotation, or None when absent or unreadable."""
    if not annotation:
        return None
    try:
        record = json.loads(annotation)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
