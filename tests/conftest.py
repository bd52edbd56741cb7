"""Shared test fixtures: the offline tiny model and corpus, and a way to run the real CLI."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "examples" / "data" / "tiny-news.jsonl"
# Environment for CLI subprocesses: quiet, offline, CPU DeepSpeed.
CLI_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DS_ACCELERATOR": "cpu",
    "RAY_DEDUP_LOGS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from app.tiny import build_tiny_model, read_texts

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", read_texts(CORPUS))


def tiny_overrides(storage: Path, name: str, model: Path, **extra) -> list[str]:
    """--set arguments for a short CPU run of the tiny model on the bundled corpus."""
    values = {
        "experiment.name": name,
        "experiment.storage_path": str(storage),
        "model.name_or_path": str(model),
        "data.dataset": str(CORPUS),
        "data.split": "train",
        "data.seq_length": 32,
        "train.micro_batch_size": 4,
        "train.learning_rate": 3e-3,
        "train.max_steps_per_epoch": 8,
        "scaling.num_workers": 2,
        "scaling.use_gpu": False,
        "checkpoint.export_final": False,
    }
    values.update(extra)
    args = []
    for key, value in values.items():
        args += ["--set", f"{key}={value}"]
    return args


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **CLI_ENV, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


# The start of a run_engine_script program: one CPU process as rank 0 of a gloo group on the port it is given, the
# "finetune" log captured in `lines`, six fixed batches of token ids, `engine(stage, **train)` (the app's own
# build_engine over the tiny model, one worker), `steps` (their losses) and `resumed`: a run saved after 3 steps and
# its checkpoint restored into another engine by the app's `restore`, as a redeploy does (tests/test_stage0.py,
# tests/test_weight_decay.py).
ENGINE_PRELUDE = r"""
import os, sys, json, logging, torch, torch.distributed as dist
os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from pathlib import Path
import deepspeed
from app.checkpoint import formats, restore
from app.config import parse
from app.ds_config import build
from app.train_loop import build_engine
dist.init_process_group("gloo")
deepspeed.init_distributed(dist_backend="gloo")
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("finetune").addHandler(handler)
logging.getLogger("finetune").setLevel(logging.INFO)
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 500, (2, 32), generator=gen) for _ in range(6)]

def engine(stage, **train):
    torch.manual_seed(0)
    cfg = parse({"model": {"name_or_path": sys.argv[1]}, "scaling": {"num_workers": 1},
                 "train": {"learning_rate": 1e-2, **train}, "deepspeed": {"zero_optimization": {"stage": stage}}})
    return build_engine(cfg, build(cfg, hidden_size=64, world_size=1), 10, False, {})[1]

def steps(e, some):
    out = []
    for ids in some:
        loss = e(input_ids=ids, labels=ids).loss
        e.backward(loss); e.step(); out.append(loss.item())
    return out

def adam_steps(e):
    return sorted({float(s["step"]) for s in getattr(e.optimizer, "optimizer", e.optimizer).state.values()})

def resumed(first, again, path, state):
    # first() trains 3 batches and saves under `path` (trainer state: `state` over one worker's), then trains the
    # other 3 (`ref`); again() builds the engine the checkpoint is restored into. Returns it and what the restore
    # found: the step counts, the groups, the log lines, whether the saved files were left as written.
    a = first()
    steps(a, batches[:3])
    a.save_checkpoint(str(path), tag="ds")
    counted, groups = adam_steps(a), len(a.optimizer.param_groups)
    state = {"global_step": 3, "world_size": 1, "micro_batch_size": a.train_micro_batch_size_per_gpu(),
             "gradient_accumulation_steps": 1, **state}
    (path / "trainer_state.json").write_text(json.dumps(state))
    ref = steps(a, batches[3:])
    del a
    b, lines[:] = again(), []
    files = lambda: {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in (path / "ds").iterdir()}
    written = files()
    restore(b, path, 0, 1)
    loaded = {"steps": adam_steps(b), "saved_steps": counted, "global": b.global_steps,
              "schedule": b.lr_scheduler.last_epoch, "groups": [groups, len(b.optimizer.param_groups)]}
    return b, {"ref": ref, "loaded": loaded, "lines": list(lines), "kept": written == files()}
"""


def run_engine_script(script: str, model: Path, folder: Path, plan: list) -> dict:
    """`script` (a test's engine program, single-process DeepSpeed on a free port) over `model`, writing under
    `folder`, given `plan` as JSON; the dict it prints after "RESULT "."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", script, str(model), port, str(folder), json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


def losses(run_dir: Path) -> dict[int, float]:
    """Per-step training loss from metrics.jsonl; where a step was logged twice (redone after a failure), the
    last one counts."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "train":
            out[rec["step"]] = rec["loss"]
    return out


# What a run logs when it resumes, is preempted, or resumes on another number of workers (tests/test_reliability.py,
# tests/test_preference_train.py).


def resumed_line(out: str) -> re.Match:
    """The resume line: (checkpoint, how it was chosen, global step, what is redone)."""
    m = re.search(
        r"resumed from (\S+) \((registered by Ray|complete, newer than Ray's latest|fallback)\) at global step "
        r"(\d+) [^;]*; (.*)",
        out,
    )
    assert m, out[-6000:]
    return m


def preempted_line(out: str) -> re.Match:
    m = re.search(r"preempted at step (\d+), checkpoint written in ([\d.]+) s", out)
    assert m, out[-6000:]
    return m


def check_world_change(out: str, s: int, before: int, after: int, batch: str) -> None:
    assert f"written by {before} workers, this run has {after}: {batch}" in out, out[-6000:]
    assert f"was written by {before} workers and this run has {after}: loaded it through DeepSpeed's universal" in out
    m = resumed_line(out)
    assert Path(m[1]).name == f"step-{s:08d}", m[0]


# make test runs three files at a time (pytest-xdist, `-n 3 --dist loadfile --no-loadscope-reorder`: a file's module
# fixtures are built once), each file whole on one worker, in collection order: a worker takes the next file when
# its own is down to its last two tests. Without --no-loadscope-reorder xdist orders the files by their number of
# tests, so the files below, which hold most of the suite's real training runs in few tests, were started last
# (test_reliability.py, the longest, after a dozen others). The order: their durations in the suite at -n 3 (fixtures
# included; test_train.py and test_lora.py down to one training run each), longest first; started first, no long
# file is left to run alone at the end, and the many short files fill the other workers meanwhile.
LONGEST_FIRST = (
    "test_reliability.py",
    "test_preference_train.py",
    "test_prepare.py",
    "test_tracking.py",
    "test_run_failures.py",
    "test_sequence_parallel.py",
    "test_first_run.py",
    "test_contract.py",
    "test_train.py",
    "test_lora.py",
    "test_progress.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
