"""Experiment tracking in MLflow: one MLflow run per experiment, continued across resumes.

Rank 0's MetricsLogger feeds an `MlflowSender`: `send()` only puts a record on a bounded queue, and a daemon
thread opens the run (the id kept in <experiment>/mlflow_run.json, so that a resume continues it), logs the
resolved config and DeepSpeed config as params, then the metrics, in batches. Every call to the server is
retried a bounded number of times with a bounded timeout; what still fails is logged once as a warning and
dropped (metrics.jsonl keeps everything), and a full queue drops records rather than wait: a tracking server
that is down or slow never stops or slows training. The driver ends the run (FINISHED, FAILED with the error
line, KILLED when preempted) through `end_run`, bounded in the same way. Credentials are MLflow's own
environment variables (MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD), never the config.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("finetune")

RUN_RECORD = "mlflow_run.json"  # in the experiment folder: which run this experiment logs into
CONFIG_RECORD = "config.json"  # the resolved training config, written by the driver beside ds_config.json
TAG_EXPERIMENT_DIR = "finetune.experiment_dir"  # whose run it is: a copied run record never adopts another's run
QUEUE_SIZE = 10_000  # records waiting for the server: hours of steps at log_every_steps=1
ATTEMPTS = 3  # tries of one call before it is given up (waits of 1 s, then 2 s between them)
HTTP_TIMEOUT_S = "10"  # MLflow's own default is 120 s with 7 retries: minutes for one call to a dead server
# MLflow's limits (mlflow/utils/validation.py): longer values are cut, batches split.
MAX_KEY, MAX_PARAM_VALUE, MAX_TAG_VALUE, MAX_PARAMS_PER_BATCH, MAX_METRICS_PER_BATCH = 250, 6000, 8000, 100, 1000


def bounded_client_env() -> None:
    """MLflow's HTTP client retries for minutes by default; the bounds here are ours (ATTEMPTS). A user's own
    settings of these variables win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)


def flatten(doc: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys; values as text (strings as is, the rest as JSON), cut to MLflow's length."""
    if isinstance(doc, dict) and doc:
        out: dict[str, str] = {}
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    text = doc if isinstance(doc, str) else json.dumps(doc)
    return {prefix[:MAX_KEY]: _cut(text, MAX_PARAM_VALUE)}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_params(config: dict[str, Any], ds_config: dict[str, Any]) -> dict[str, str]:
    """The resolved training config and the resolved DeepSpeed config (`ds_config.*`) as MLflow params."""
    return {**flatten(config), **flatten(ds_config, "ds_config")}


def run_tags(config: dict[str, Any], run_dir: Path) -> dict[str, str]:
    model, data = config["model"], config["data"]
    tags = {
        TAG_EXPERIMENT_DIR: str(run_dir),
        "finetune.experiment": config["experiment"]["name"],
        "model.source": model["name_or_path"],
        "model.tokenizer": model.get("tokenizer") or model["name_or_path"],
        "data.source": data["dataset"],
        "data.split": data["split"],
        "data.config_name": data.get("config_name") or "",
        "mlflow.source.name": "finetune",
        "mlflow.source.type": "JOB",
    }
    return {k: _cut(v, MAX_TAG_VALUE) for k, v in tags.items()}


def read_record(run_dir: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


class Calls:
    """MLflow client calls with a bound: ATTEMPTS tries, then one warning for the first call given up."""

    def __init__(self, uri: str, consequence: str):
        from mlflow.tracking import MlflowClient

        bounded_client_env()
        self.uri, self.client, self.warned = uri, MlflowClient(tracking_uri=uri), False
        self.consequence = consequence  # what the warning tells the user it means

    def __call__(self, what: str, fn, *args, **kwargs) -> Any:
        from mlflow.exceptions import MlflowException

        for attempt in range(ATTEMPTS):
            try:
                return fn(*args, **kwargs)
            except MlflowException as exc:
                if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS"):
                    raise  # an answer, not an outage: the caller decides
                error = exc
            except Exception as exc:  # noqa: BLE001 - connection refused, timeouts, a proxy's HTML error page
                error = exc
            if attempt + 1 < ATTEMPTS:
                time.sleep(2**attempt)
        if not self.warned:
            self.warned = True
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            log.warning(f"WARNING: MLflow at {self.uri}: {what} failed {ATTEMPTS} times ({first}); {self.consequence}")
        raise Unreachable(what)


class Unreachable(Exception):
    """A call given up after ATTEMPTS tries (already logged)."""


def open_run(calls: Calls, run_dir: Path, experiment: str, params: dict[str, str], tags: dict[str, str]) -> str:
    """The experiment's run: the one its run record names when it is still there, active and this experiment
    folder's (then marked RUNNING again), else a new one in the MLflow experiment `experiment`."""
    from mlflow.exceptions import MlflowException

    record = read_record(run_dir)
    if record and record.get("tracking_uri") == calls.uri and record.get("experiment") == experiment:
        try:
            run = calls("get the run", calls.client.get_run, record["run_id"])
        except MlflowException:
            run = None  # deleted on the server: a new one
        if run and run.info.lifecycle_stage == "active" and run.data.tags.get(TAG_EXPERIMENT_DIR) == str(run_dir):
            calls("mark the run running", calls.client.update_run, run.info.run_id, status="RUNNING")
            log_params(calls, run.info.run_id, params, run.data.params)
            return run.info.run_id
        log.warning(f"WARNING: MLflow run {record['run_id']} of {run_dir} is gone or not this experiment's: a new run")
    experiment_id = experiment_id_of(calls, experiment)
    run = calls(
        "create a run",
        calls.client.create_run,
        experiment_id,
        run_name=tags["finetune.experiment"],
        tags=tags,
    )
    from app.checkpoint import write_atomic

    record = {"tracking_uri": calls.uri, "experiment": experiment, "experiment_id": experiment_id}
    write_atomic(run_dir / RUN_RECORD, json.dumps({**record, "run_id": run.info.run_id}, indent=2) + "\n")
    log.info(f"MLflow: run {run.info.run_id} in experiment {experiment!r} at {calls.uri}")
    log_params(calls, run.info.run_id, params, {})
    return run.info.run_id


def experiment_id_of(calls: Calls, name: str) -> str:
    from mlflow.exceptions import MlflowException

    found = calls("find the experiment", calls.client.get_experiment_by_name, name)
    if found is not None:
        return found.experiment_id
    try:
        return calls("create the experiment", calls.client.create_experiment, name)
    except MlflowException:  # created meanwhile by another run
        return calls("find the experiment", calls.client.get_experiment_by_name, name).experiment_id


def log_params(calls: Calls, run_id: str, params: dict[str, str], logged: dict[str, str]) -> None:
    """Params are immutable in MLflow: a resume logs the new keys, and a value that changed (more epochs, a
    different number of workers) as the tag `param_changed.<key>`."""
    from mlflow.entities import Param, RunTag

    new = [Param(k, v) for k, v in params.items() if k not in logged]
    changed = [
        RunTag(_cut(f"param_changed.{k}", MAX_KEY), _cut(v, MAX_TAG_VALUE))
        for k, v in params.items()
        if k in logged and logged[k] != v
    ]
    for i in range(0, max(len(new), len(changed)), MAX_PARAMS_PER_BATCH):
        part = slice(i, i + MAX_PARAMS_PER_BATCH)
        calls("log params", calls.client.log_batch, run_id, params=new[part], tags=changed[part])


class MlflowSender:
    """Rank 0's link to the tracking server: `send()` never blocks; a daemon thread does the talking."""

    def __init__(self, uri: str, experiment: str, run_dir: Path, params: dict[str, str], tags: dict[str, str]):
        # mlflow imported here, not first in the thread: `import deepspeed` no longer does it (app/__init__.py), and
        # a large import in a thread races the loop's own imports and delayed the run's opening by seconds.
        import mlflow.tracking  # noqa: F401

        self.uri, self.experiment, self.run_dir = uri, experiment, run_dir
        self.params, self.tags = params, tags
        self.queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.dropped = 0
        self.healthy = True  # the last call went through: close() then waits for the rest
        self.deadline: float | None = None  # set by close(): past it, what is left is abandoned
        self.stopping = threading.Event()  # set by close(): send what is queued, then stop
        self.thread = threading.Thread(target=self._run, name="mlflow-sender", daemon=True)
        self.thread.start()

    @classmethod
    def for_experiment(cls, run_dir: Path) -> MlflowSender | None:
        """From the configs the driver recorded in the experiment folder; None when tracking is off."""
        try:
            config = json.loads((run_dir / CONFIG_RECORD).read_text())
            ds_config = json.loads((run_dir / "ds_config.json").read_text())
        except (OSError, ValueError) as exc:
            log.warning(f"WARNING: no MLflow tracking: cannot read the recorded configs in {run_dir} ({exc})")
            return None
        mlflow = config.get("tracking", {}).get("mlflow", {})
        if not mlflow.get("uri"):
            return None
        experiment = mlflow.get("experiment") or config["experiment"]["name"]
        return cls(mlflow["uri"], experiment, run_dir, run_params(config, ds_config), run_tags(config, run_dir))

    def metrics(self, step: int, values: dict[str, float], when: float | None = None) -> None:
        self._put(("metrics", step, values, int((when or time.time()) * 1000)))

    def set_tags(self, tags: dict[str, str]) -> None:
        self._put(("tags", tags))

    def _put(self, item: tuple) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(f"WARNING: MLflow at {self.uri} is not keeping up: records dropped (metrics.jsonl has all)")

    def close(self, timeout_s: float = 20.0) -> None:
        """Send what is queued for up to `timeout_s` (2 s when the server stopped answering), then leave the rest
        (the thread is a daemon)."""
        timeout_s = timeout_s if self.healthy else min(timeout_s, 2.0)
        self.deadline = time.monotonic() + timeout_s
        self.stopping.set()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        calls = Calls(self.uri, "training goes on, what is not sent stays in metrics.jsonl (said once)")
        run_id = None
        while run_id is None:
            try:
                run_id = open_run(calls, self.run_dir, self.experiment, self.params, self.tags)
            except Exception as exc:  # noqa: BLE001 - Unreachable (warned), or what the server refused
                if not isinstance(exc, Unreachable):
                    log.warning(f"WARNING: MLflow at {self.uri}: cannot open the run ({exc}); not tracked")
                    return
                self.healthy = False
                if self._closing():
                    return
                time.sleep(5)  # the server may come back; records wait in the queue meanwhile
        while True:
            batch = self._next_batch()
            if batch:
                self._log(calls, run_id, batch)
            if (self.stopping.is_set() and self.queue.empty()) or self._closing():
                return

    def _closing(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def _next_batch(self) -> list[tuple]:
        """Up to one batch of queued records, waiting up to a second for the first (less once stopping)."""
        batch: list[tuple] = []
        try:
            batch.append(self.queue.get(timeout=0.05 if self.stopping.is_set() else 1.0))
            while len(batch) < MAX_METRICS_PER_BATCH // 10:
                batch.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return batch

    def _log(self, calls: Calls, run_id: str, batch: list[tuple]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags = [], []
        for kind, *rest in batch:
            if kind == "metrics":
                step, values, when = rest
                metrics += [Metric(key, float(value), when, step) for key, value in values.items()]
            else:
                tags += [RunTag(k, _cut(str(v), MAX_TAG_VALUE)) for k, v in rest[0].items()]
        try:
            for i in range(0, max(len(metrics), len(tags)), MAX_PARAMS_PER_BATCH):
                part = slice(i, i + MAX_PARAMS_PER_BATCH)
                calls("log metrics", calls.client.log_batch, run_id, metrics=metrics[part], tags=tags[part])
            self.healthy = True
        except Exception as exc:  # noqa: BLE001 - Unreachable (warned), or a record the server refused
            self.healthy = False
            if not isinstance(exc, Unreachable):
                log.warning(f"WARNING: MLflow at {self.uri} refused a batch: {exc}")


# --- the driver: how the run ended ----------------------------------------------------------------------------

STATUSES = ("FINISHED", "FAILED", "KILLED")


def end_run(run_dir: Path, uri: str, status: str, error: str | None = None, final: Path | None = None) -> None:
    """Mark the experiment's run ended: FINISHED, FAILED (with `error`, its one line, as the tag `error`) or
    KILLED (preempted); the final model's path as the tag `final_model`. Bounded (ATTEMPTS tries of at most
    HTTP_TIMEOUT_S each, in a thread waited for 30 s): a server that is down costs the driver seconds, never
    the run's outcome."""
    assert status in STATUSES, status
    record = read_record(run_dir)
    if not uri or not record or record.get("tracking_uri") != uri:
        return  # tracking off, or rank 0 never reached the server
    import mlflow.tracking  # noqa: F401 - here, not in the thread's 30 s (MlflowSender says why)

    def end() -> None:
        from mlflow.entities import RunTag

        calls = Calls(uri, f"the run's status in MLflow is not {status}")
        tags = {"finetune.status": status.lower()}
        if error:
            tags["error"] = error
        if final is not None:
            tags["final_model"] = str(final)
        run_id = record["run_id"]
        try:
            tag_list = [RunTag(k, _cut(v, MAX_TAG_VALUE)) for k, v in tags.items()]
            calls("tag the run", calls.client.log_batch, run_id, tags=tag_list)
            calls("end the run", calls.client.set_terminated, run_id, status=status)
        except Exception as exc:  # noqa: BLE001 - Unreachable (warned), or the server's refusal
            if not isinstance(exc, Unreachable):
                log.warning(f"WARNING: MLflow at {uri}: cannot end run {run_id} ({exc})")

    thread = threading.Thread(target=end, name="mlflow-end", daemon=True)
    thread.start()
    thread.join(30)
