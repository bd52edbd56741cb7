"""MLflow tracking and the loss pictures: real runs (2 CPU workers, the tiny model) logging to a real `mlflow server`
(SQLite) on loopback, read back through MLflow's client.

One experiment trains in two attempts (stopped at step 4 by train.stop_after_steps, then resumed to step 8), and
several tests read what it left; a second experiment runs while its server is killed in the middle of a save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import losses, run_cli, tiny_overrides
from mlflow_server import MlflowServer
from test_reliability import BASE, start, wait_until

from app import charts, config, tracking

SHARED_EXPERIMENT = "team-finetunes"  # the MLflow experiment both tests' runs log into


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield srv
    srv.stop()


def train(storage: Path, name: str, model: Path, uri: str, env: dict | None = None, **sets) -> str:
    sets = {**BASE, "tracking.mlflow.uri": uri, "tracking.mlflow.experiment": SHARED_EXPERIMENT, **sets}
    result = run_cli("train", *tiny_overrides(storage, name, model, **sets), env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]
    return out


@pytest.fixture(scope="module")
def resumed(server, tiny_model, tmp_path_factory):
    """Experiment `tracked`: 4 steps, stopped (as a preemption would), then resumed to its 8 steps with an
    evaluation every 2 and the final model exported. The MLflow run after each attempt."""
    storage = tmp_path_factory.mktemp("storage")
    sets = {"data.eval_fraction": 0.2, "train.eval_every_steps": 2, "train.eval_max_batches": 2}
    first_out = train(storage, "tracked", tiny_model, server.uri, **sets, **{"train.stop_after_steps": 4})
    run_dir = storage / "tracked"
    first = server.client().get_run(tracking.read_record(run_dir)["run_id"])
    second_out = train(storage, "tracked", tiny_model, server.uri, **sets, **{"checkpoint.export_final": True})
    second = server.client().get_run(tracking.read_record(run_dir)["run_id"])
    return {"dir": run_dir, "first": first, "second": second, "out": first_out + second_out}


def history(server: MlflowServer, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in server.client().get_metric_history(run_id, key)}


def test_a_resume_continues_the_same_run(server, resumed):
    first, second = resumed["first"], resumed["second"]
    assert first.info.status == "KILLED"  # stopped before its last step: it goes on when deployed again
    assert second.info.run_id == first.info.run_id and second.info.status == "FINISHED"
    assert second.info.run_name == "tracked"
    # One continuous loss curve, step = the global step, equal to what the run wrote locally.
    loss = history(server, second.info.run_id, "loss")
    assert sorted(loss) == list(range(1, 9))
    assert loss == pytest.approx(losses(resumed["dir"]), rel=1e-6)
    # The config changed at the resume: params are immutable in MLflow, so the change is a tag.
    assert second.data.params["train.stop_after_steps"] == "4"
    assert second.data.tags["param_changed.train.stop_after_steps"] == "null"
    assert second.data.tags["resumed_from"].endswith("step-00000004")


def test_the_run_holds_config_metrics_and_checkpoints(server, resumed):
    run = resumed["second"]
    params, tags, run_id = run.data.params, run.data.tags, run.info.run_id
    ds = json.loads((resumed["dir"] / "ds_config.json").read_text())
    assert params["ds_config.train_batch_size"] == str(ds["train_batch_size"])
    assert params["ds_config.zero_optimization.stage"] == "3" and params["train.learning_rate"] == "0.003"
    assert params["experiment.name"] == "tracked" and params["tracking.mlflow.experiment"] == SHARED_EXPERIMENT
    assert all(len(v) <= tracking.MAX_PARAM_VALUE for v in params.values())
    assert tags["model.source"] == params["model.name_or_path"] and tags["data.source"].endswith("tiny-news.jsonl")
    for key in ("learning_rate", "grad_norm", "tokens_per_s", "tokens_per_s_per_gpu"):
        assert sorted(history(server, run_id, key)) == list(range(1, 9)), key
    assert sorted(history(server, run_id, "eval_loss")) == [2, 4, 6, 8]
    perplexity = history(server, run_id, "eval_perplexity")
    assert perplexity[8] == pytest.approx(2.718281828 ** history(server, run_id, "eval_loss")[8], rel=1e-4)
    # Each checkpoint: step, path and save time.
    assert sorted(history(server, run_id, "checkpoint_save_s")) == [2, 4, 6, 8]
    for step in (2, 4, 6, 8):
        path = resumed["dir"] / "checkpoints" / f"step-{step:08d}"
        assert tags[f"checkpoint.{path.name}"].startswith(f"{path} (step {step}, saved 20"), tags
    assert tags["final_model"] == str(resumed["dir"] / "final") and tags["finetune.status"] == "finished"


def test_loss_png_and_the_terminal_curve(resumed):
    png = resumed["dir"] / charts.LOSS_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # `finetune status` of a local experiment folder: where it stands and its loss curve.
    result = run_cli("status", str(resumed["dir"]))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "finished" in lines[0] and re.search(r"^  step +8$", result.stdout, re.M), result.stdout
    curve = [line for line in lines if "│" in line]
    assert len(curve) == 6 and any(block in result.stdout for block in charts.BLOCKS[1:]), result.stdout


def test_a_dead_server_never_stops_training(server, resumed, tiny_model, tmp_path):
    """Experiment `untouched` logs into the same MLflow experiment, with a copy of `tracked`'s run record in its
    folder (a copied experiment folder): it gets a run of its own. Its server dies in the middle of the save of
    step 4; the run finishes with every checkpoint, one warning said, and the server, once back, holds what was
    sent before it died and nothing of it in `tracked`'s run."""
    storage, log = tmp_path / "storage", tmp_path / "train.log"
    (storage / "untouched").mkdir(parents=True)
    shutil.copy(resumed["dir"] / tracking.RUN_RECORD, storage / "untouched" / tracking.RUN_RECORD)
    sets = {"tracking.mlflow.uri": server.uri, "tracking.mlflow.experiment": SHARED_EXPERIMENT}
    proc = start(
        storage, "untouched", tiny_model, log, env={"FINETUNE_FAULT_SAVE_PAUSE": "before_shards:300:4"}, **sets
    )
    run_dir = storage / "untouched"
    try:
        wait_until(lambda: (run_dir / ".fault-paused-before_shards-4").exists(), proc, log, what="the save of step 4")
        # Step 4's loss is logged before its save, but sent in the background: wait until the server has it in
        # untouched's own run (until the sender has opened it, the copied record still names tracked's run).
        tracked = resumed["second"].info.run_id
        wait_until(
            lambda: 4 in sent_loss(server, run_dir, other_than=tracked), proc, log, timeout=120, what="steps 1-4 sent"
        )
        server.stop()
        started = time.monotonic()
        (run_dir / ".fault-continue-before_shards-4").touch()
        assert proc.wait(timeout=600) == 0, log.read_text()[-8000:]
        after_kill = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        server.start()
    out = log.read_text()
    assert [s for s in (run_dir / "checkpoints").iterdir() if s.name.startswith("step-")] and (
        run_dir / "checkpoints" / "step-00000008" / "trainer_state.json"
    ).exists(), out[-4000:]
    assert out.count("training goes on, what is not sent stays in metrics.jsonl") == 1, out[-8000:]
    assert after_kill < 300, after_kill
    record = tracking.read_record(run_dir)
    assert record["run_id"] != resumed["second"].info.run_id
    loss = history(server, record["run_id"], "loss")
    assert sorted(loss)[:4] == [1, 2, 3, 4]
    assert len(history(server, resumed["second"].info.run_id, "loss")) == 8  # nothing written into `tracked`'s run
    runs = server.client().search_runs([record["experiment_id"]])
    assert sorted(r.info.run_name for r in runs) == ["tracked", "untouched"]


def sent_loss(server: MlflowServer, run_dir: Path, other_than: str | None = None) -> dict[int, float]:
    """The loss history on the server of the run that `run_dir`'s record names (none while it names `other_than`)."""
    record = tracking.read_record(run_dir)
    return history(server, record["run_id"], "loss") if record and record["run_id"] != other_than else {}


def test_flatten_keeps_to_mlflow_limits():
    flat = tracking.flatten({"a": {"b": [1, 2], "c": None, "d": "x" * 7000, "e": {}}, "k" * 300: True})
    assert flat["a.b"] == "[1, 2]" and flat["a.c"] == "null" and flat["a.e"] == "{}"
    assert len(flat["a.d"]) == tracking.MAX_PARAM_VALUE and flat["a.d"].endswith("...")
    assert flat["k" * tracking.MAX_KEY] == "true"


def test_terminal_curve_shape():
    points = [(s, 5.0 - s / 10) for s in range(1, 101)]
    lines = charts.terminal_curve(points, width=40, height=4)
    top, bottom = float(lines[0].split("│")[0]), float(lines[3].split("│")[0])
    assert len(lines) == 6 and 4.5 < top <= 4.9 and -5.0 <= bottom < -4.5
    assert lines[0].split("│")[1][0] == "█" and lines[0].split("│")[1][-1] == " "  # falls from left to right
    assert lines[-1].split() == ["1", "100", "step"]
    assert charts.terminal_curve([(1, 2.0)]) == []


@pytest.mark.parametrize(
    "uri, message",
    [
        ("https://bob:secret@mlflow.example.com", "must not carry credentials"),
        ("mlflow.example.com:5000", "must be a tracking server URI"),
    ],
)
def test_a_bad_tracking_uri_is_refused(uri, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(None, [f"tracking.mlflow.uri={uri}"])
    problem = err.value.problems[0]
    assert problem.field == "tracking.mlflow.uri" and message in problem.message
    assert "secret" not in str(problem)  # the password is never echoed


@pytest.mark.parametrize(
    "uri",
    ["", "databricks", "http://mlflow:5000", "https://mlflow.example.com/prefix", "file:///tmp/mlruns", "file:/tmp/m"]
    + ["https://u:p@mlflow.example.com", "mlflow:5000", "ftp://host", "http://u@host/"],
)
def test_schema_pattern_and_validator_agree(uri):
    import re as regex

    try:
        config.load(None, [f"tracking.mlflow.uri={uri}"])
        accepted = True
    except config.ConfigError:
        accepted = False
    assert accepted == bool(regex.match(config.MLFLOW_URI_PATTERN, uri)), uri


def test_uri_default_is_the_environment(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.mlops:5000")
    cfg = config.resolve(config.load(None, ["experiment.name=exp-a"]))
    assert cfg.tracking.mlflow.uri == "http://mlflow.mlops:5000" and cfg.tracking.mlflow.experiment == "exp-a"
    off = config.resolve(config.load(None, ["experiment.name=exp-a", "tracking.mlflow.uri="]))
    assert off.tracking.mlflow.uri == ""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert config.resolve(config.load(None, ["experiment.name=exp-a"])).tracking.mlflow.uri == ""


def test_the_driver_ends_a_failed_run_with_its_error_line(server, tmp_path):
    client = server.client()
    run = client.create_run(client.create_experiment("ended-by-the-driver"))
    record = {"tracking_uri": server.uri, "experiment": "ended-by-the-driver", "run_id": run.info.run_id}
    (tmp_path / tracking.RUN_RECORD).write_text(json.dumps(record))
    tracking.end_run(tmp_path, server.uri, "FAILED", "RuntimeError: CUDA out of memory [rank 1]")
    ended = client.get_run(run.info.run_id)
    assert ended.info.status == "FAILED" and ended.data.tags["error"] == "RuntimeError: CUDA out of memory [rank 1]"
    tracking.end_run(tmp_path, "http://another-server:5000", "FINISHED")  # not this record's server: untouched
    assert client.get_run(run.info.run_id).info.status == "FAILED"


def test_a_server_that_never_answers_costs_the_loop_nothing(tmp_path, monkeypatch, caplog):
    """A server that accepts connections and never answers (a hung proxy): send() returns at once whatever
    is queued, close() within its bound, and one warning says so."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        tags = {"finetune.experiment": "hung"}
        sender = tracking.MlflowSender(uri, "hung", tmp_path, {"a": "1"}, tags)
        started = time.perf_counter()
        for step in range(1, 20_001):  # twice the queue: the rest is dropped, never waited for
            sender.metrics(step, {"loss": 1.0, "learning_rate": 1e-3})
        sending = time.perf_counter() - started
        wait_until(lambda: not sender.healthy, None, None, timeout=60, what="the calls given up")
        started = time.perf_counter()
        sender.close(timeout_s=20)
        closing = time.perf_counter() - started
    assert sending < 2.0 and closing < 3.0, (sending, closing)
    assert sender.dropped == 20_000 - tracking.QUEUE_SIZE
    warnings = [r.getMessage() for r in caplog.records if "MLflow at" in r.getMessage()]
    assert len(warnings) == 2 and {"failed 3 times" in w for w in warnings} == {True, False}, warnings
    assert any("not keeping up" in w for w in warnings), warnings


def test_status_of_a_rayjob_draws_its_loss_curve():
    from app import ops

    lines = ops.render_progress("exp1", {"step": 3, "total_steps": 3, "loss_curve": [[1, 3.0], [2, 2.5], [3, 2.0]]})
    curve = [line for line in lines if "│" in line]
    assert len(curve) == 6 and curve[0].split()[0] == "3.000" and curve[-1].split()[0] == "2.000", lines


DEEPSPEED_THEN_TRACKING = """
import sys
import app
import deepspeed
from deepspeed.autotuning import autotuner
print("autotuner has mlflow:", autotuner.has_mlflow, "imported:", "mlflow" in sys.modules)
from app import tracking
import mlflow.tracking
print("tracking has mlflow:", hasattr(mlflow, "MlflowClient"))
"""


@pytest.mark.parametrize("with_app", [True, False])
def test_deepspeed_under_the_app_leaves_mlflow_to_tracking(with_app):
    """app/__init__.py keeps DeepSpeed's autotuner from importing mlflow (about 1 s of every worker's start); the
    autotuner sees none, and tracking still imports it. Without the app, `import deepspeed` imports mlflow."""
    script = DEEPSPEED_THEN_TRACKING if with_app else DEEPSPEED_THEN_TRACKING.replace("import app\n", "")
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = "False imported: False" if with_app else "True imported: True"
    assert r.stdout.splitlines() == [f"autotuner has mlflow: {expected}", "tracking has mlflow: True"], r.stdout
