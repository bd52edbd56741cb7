"""Running one benchmark case through the product's own entry point, and reading what it measured.

The app runner starts `python -m app.cli train CONFIG` (what `finetune train` runs: the same config models,
DeepSpeed config builder, data pipeline, Ray TorchTrainer and per-worker loop) in a process session of its
own, follows `<storage>/<experiment>/metrics.jsonl` (one record per optimizer step: the loop synchronises
with an all-reduce and `.item()` before it reads its clock, so each step time is a synchronised one), and
ends that process session once the timed steps are in, unless the case wants the run's own end (its final
checkpoint) measured too. The HF runner starts `benchmarks.hf_trainer` under torchrun.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    name: str  # also the experiment name: a DNS-1035 label
    shape: str
    sets: dict[str, Any] = field(default_factory=dict)  # dotted config overrides, as `--set`
    runner: str = "app"  # "app" (finetune train), or a PEERS key (a peer trainer under torchrun)
    config: str | None = None  # an examples/ YAML to start from, instead of the generated base config
    lengths: str = "docs"
    corpus_tokens: int = 2_500_000
    warmup: int = 3
    steps: int = 8
    checkpoint: bool = False  # let the run end, measure its final checkpoint, then time a resume from it
    saves: int = 0  # measure this many periodic saves (the loop's stall, the write, the bytes), then end the run
    fallback_for: str | None = None  # run only if the case of this name failed (e.g. out of memory)
    # The ZeRO stage, pure bf16, checkpointing and micro-batch: False, each the case does not set takes its value from
    # before "auto" existed (app.config.BEFORE_AUTO), so a suite measures what it always measured; True, the case
    # leaves them to the app (what a user gets), and its twin peer runs the app's micro-batch and checkpointing.
    auto: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the run (experiment switches)
    weights: bool = False  # load real (random-valued) safetensors weights instead of `random-init:`
    tree: str | None = None  # run the app from another checkout (an A/B against, e.g., main), relative to REPO
    timeout: float = 240
    estimate: float = 45  # seconds, for the suite's deadline
    note: str = ""


# ---- processes --------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(proc: subprocess.Popen, grace: float = 15, signals=(signal.SIGTERM, signal.SIGKILL)) -> None:
    """End the process session this harness started for one case, and every process it started."""
    tree = [proc.pid] + descendants(proc.pid)
    for sig in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline and any(alive(p) for p in tree):
            time.sleep(0.2)
            proc.poll()
        if not any(alive(p) for p in tree):
            break
    proc.poll()
    wait_gpus_free()


def wait_gpus_free(limit: float = 30) -> None:
    if not shutil.which("nvidia-smi"):
        return
    deadline = time.time() + limit
    while time.time() < deadline:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
        if not out:
            return
        time.sleep(0.5)


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "RAY_DEDUP_LOGS": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "warning",
            # `datasets` imports JAX and TensorFlow when it finds them (seconds per worker at start); torch only here.
            "USE_JAX": "0",
            "USE_TF": "0",
            "USE_TORCH": "1",
        }
    )
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder cannot parse "9.0a"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# ---- reading results --------------------------------------------------------------------------------------


def read_records(path: Path, kind: str = "train") -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def startup_phases(metrics: Path, records: list[dict[str, Any]], launch: float) -> dict[str, float] | None:
    """Launch to first step, phase by phase: the loop's own start-up record (app.metrics.MetricsLogger.startup)
    plus the launch (process start, CLI imports, config checks) before it and the first step after it."""
    found = read_records(metrics, "startup")
    if not found:
        return None
    marks = found[-1]["marks"]
    first = min(marks.values())
    out = {"launch_to_driver": round(first - launch, 2), **found[-1]["phases_s"]}
    if records:
        out["first_step"] = round(records[0]["time"] - max(marks.values()), 2)
    return out


# Preference tuning's metrics (TRL's names, in the app's metrics.jsonl and TRL's logs) that the records keep, per
# logged step, beside the losses.
PREFERENCE_LOGGED = ("rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def summarise(records: list[dict[str, Any]], warmup: int, launch: float, profiled: int | None = None) -> dict[str, Any]:
    """Figures over the timed steps: those after `warmup`, but not the `profiled` one (the profiler slows it); and
    each logged step's time and wait for data, as the run's own storage does not outlive the case."""
    timed = [r for r in records[warmup:] if r.get("step") != profiled]
    out: dict[str, Any] = {
        "steps_logged": len(records),
        "steps_timed": len(timed),
        "losses": [round(r["loss"], 4) for r in records],
        "step_times_s": [round(r["step_time_s"], 4) for r in records],
        "data_waits_s": [round(r.get("data_wait_s", 0.0), 4) for r in records],
    }
    if records and PREFERENCE_LOGGED[0] in records[0]:
        out["metrics"] = {name: [round(r[name], 4) for r in records] for name in PREFERENCE_LOGGED}
    if records:
        out["time_to_first_step_s"] = round(records[0]["time"] - launch, 2)
    if not timed:
        return out
    times = [r["step_time_s"] for r in timed]
    tokens = sum(r["tokens_per_s_per_gpu"] * r["step_time_s"] for r in timed)
    out.update(
        {
            "step_s": round(sum(times) / len(times), 4),
            "step_s_median": round(statistics.median(times), 4),
            "step_s_min": round(min(times), 4),
            "step_s_max": round(max(times), 4),
            "tokens_per_s_per_gpu": round(tokens / sum(times), 1),
            "peak_mem_gib": round(max(r.get("peak_mem_gib", 0.0) for r in records), 2),
            "peak_host_gib": round(max(r.get("peak_host_gib", 0.0) for r in records), 2),
        }
    )
    if all("mfu" in r for r in timed):
        out["mfu"] = round(sum(r["mfu"] * r["step_time_s"] for r in timed) / sum(times), 4)
    return out


# The loop's resume line: "resumed from ... (epoch E, step S of the epoch), loaded in 4.7s; ..."
LOADED_IN = re.compile(r"resumed from .*, loaded in (\d+(?:\.\d+)?)s;")


def error_lines(log: str, n: int = 6) -> str:
    keys = ("Error", "error:", "Exception", "OOM", "out of memory", "Traceback")
    hits = [line.strip() for line in log.splitlines() if any(k in line for k in keys)]
    return " | ".join(hits[-n:])[-1500:] if hits else log.strip()[-800:]


# ---- the app runner ---------------------------------------------------------------------------------------


# Set to a number of seconds, the process each case launches (the app's driver, a peer's torchrun) is sampled that
# long from its launch by py-spy (where it is on PATH; 100 samples a second, idle time included, --nonblocking: never
# paused), whose stacks land beside the case's log (LOG.driver-stacks.txt, py-spy's raw format): where launch to first
# step goes. With BENCH_PROFILE_SUBPROCESSES=1 its descendants too (Ray's processes and the training workers, the
# peer's torchrun workers), each stack led by its process chain (benchmarks/driver_profile.py --through picks one).
# py-spy attaches from a session of its own, so that the case's end (its process group signalled) leaves it to write
# what it sampled.
PROFILE_DRIVER_ENV = "BENCH_PROFILE_DRIVER"
PROFILE_SUBPROCESSES_ENV = "BENCH_PROFILE_SUBPROCESSES"


def profile_driver(proc: subprocess.Popen, log_path: Path) -> None:
    seconds = os.environ.get(PROFILE_DRIVER_ENV)
    spy = shutil.which("py-spy") if seconds else None
    if not spy:
        return
    out = log_path.with_suffix(".driver-stacks.txt")
    command = [spy, "record", "--pid", str(proc.pid), "--duration", seconds, "--idle", "--nonblocking", "-r", "100"]
    if os.environ.get(PROFILE_SUBPROCESSES_ENV) == "1":
        command.append("--subprocesses")
    with log_path.open("a") as log:
        subprocess.Popen(
            [*command, "-f", "raw", "-o", str(out)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def launch_app(
    cfg_path: Path, log_path: Path, env: dict[str, str], tree: Path = REPO
) -> tuple[subprocess.Popen, float]:
    log = log_path.open("a")
    launch = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "train", str(cfg_path)],
        cwd=tree,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    profile_driver(proc, log_path)
    return proc, launch


def follow(proc: subprocess.Popen, metrics: Path, need: int | None, timeout: float, launch: float) -> str | None:
    """Wait for `need` step records (then end the run), or for the run's own end; the reason if it failed."""
    while True:
        rc = proc.poll()
        if need is not None and len(read_records(metrics)) >= need:
            stop(proc)
            return None
        if rc is not None:
            wait_gpus_free()
            return None if rc == 0 else f"exit code {rc}"
        if time.time() - launch > timeout:
            stop(proc)
            return f"timed out after {timeout:.0f}s"
        time.sleep(0.5)


def run_app(case: Case, cfg_path: Path, run_dir: Path, shared_cache: Path, log_path: Path) -> dict[str, Any]:
    env = {**bench_env(), **case.env}
    tree = (REPO / case.tree).resolve() if case.tree else REPO
    if case.tree:  # that checkout's app, not this one's (the harness itself stays this one)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *env["PYTHONPATH"].split(os.pathsep)[1:]])
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shared_cache.mkdir(parents=True, exist_ok=True)
    # The tokenized-data cache is keyed by everything that shapes it: cases on the same corpus share it.
    (run_dir / "cache").symlink_to(shared_cache, target_is_directory=True)
    metrics = run_dir / "metrics.jsonl"
    need = case.warmup + case.steps
    proc, launch = launch_app(cfg_path, log_path, env, tree)
    if case.saves:
        failure = follow_saves(proc, metrics, case.saves, case.timeout, launch)
    else:
        failure = follow(proc, metrics, None if case.checkpoint else need, case.timeout, launch)
    records = read_records(metrics)
    profiles = read_records(metrics, "profile")
    result = summarise(records, case.warmup, launch, profiles[0]["step"] if profiles else None)
    result["startup"] = startup_phases(metrics, records, launch)
    if profiles:
        result["profile"] = {k: v for k, v in profiles[0].items() if k not in ("kind", "time")}
    if failure and (len(records) < need or case.saves):
        result["error"] = f"{failure}: {error_lines(log_path.read_text(errors='replace'))}"
    if case.saves:
        result["saves"] = measure_saves(metrics, records)
    if case.checkpoint and not result.get("error"):
        result["checkpoint"] = measure_checkpoint(case, cfg_path, run_dir, records, launch, log_path, env)
    return result


def follow_saves(proc: subprocess.Popen, metrics: Path, saves: int, timeout: float, launch: float) -> str | None:
    """Wait until `saves` checkpoints are complete (their metrics records) and a step after the last is logged,
    then end the run at once (SIGKILL: a SIGTERM would make the run save once more, as a preemption)."""
    while True:
        done = read_records(metrics, "checkpoint")
        if len(done) >= saves and any(r["step"] > done[saves - 1]["step"] for r in read_records(metrics)):
            stop(proc, signals=(signal.SIGKILL,))
            return None
        if proc.poll() is not None:
            wait_gpus_free()
            return f"exit code {proc.returncode} after {len(done)} of {saves} saves"
        if time.time() - launch > timeout:
            stop(proc, signals=(signal.SIGKILL,))
            return f"timed out after {timeout:.0f}s with {len(done)} of {saves} saves"
        time.sleep(0.5)


def measure_saves(metrics: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each periodic save: how long the loop waited (stall_s: the step after it took that much longer), how long
    until it was complete (total_s: every rank's files on disk, the completion mark written), the bytes it holds
    (the file list in its trainer_state.json) and the step times while it was being written."""
    out = []
    for c in read_records(metrics, "checkpoint"):
        state = json.loads((Path(c["path"]) / "trainer_state.json").read_text())
        saved_at = next((r["time"] for r in records if r["step"] == c["step"]), c["time"])
        during = [r["step_time_s"] for r in records if saved_at < r["time"] <= c["time"] and r["step"] > c["step"] + 1]
        before = [r["step_time_s"] for r in records if r["step"] < c["step"]][-5:]
        out.append(
            {
                "step": c["step"],
                "background": c["background"],
                "stall_s": c["stall_s"],
                "total_s": c["total_s"],
                "bytes": sum(state["files"].values()),
                "files": len(state["files"]),
                "step_after_save_s": next((r["step_time_s"] for r in records if r["step"] == c["step"] + 1), None),
                "step_s_before": round(statistics.median(before), 4) if before else None,
                "step_s_while_writing": round(statistics.median(during), 4) if during else None,
                "steps_while_writing": len(during),
            }
        )
    return out


def measure_checkpoint(
    case: Case,
    cfg_path: Path,
    run_dir: Path,
    records: list[dict[str, Any]],
    launch: float,
    log_path: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    """The run's final checkpoint (written by the loop, straight to its folder): size, write time, and the
    time a new deploy of the same experiment takes to load it."""
    done = sorted((run_dir / "checkpoints").glob("step-*"))
    if not done or not (done[-1] / "trainer_state.json").exists():
        return {"error": "no complete checkpoint"}
    ck = done[-1]
    files = [f for f in ck.rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    first_write = min(f.stat().st_mtime for f in files)
    end = (ck / "trainer_state.json").stat().st_mtime
    save_s = end - records[-1]["time"]
    t = time.time()
    os.sync()
    sync_s = time.time() - t
    out: dict[str, Any] = {
        "bytes": size,
        "files": len(files),
        "save_s": round(save_s, 2),
        "write_span_s": round(end - first_write, 2),
        "write_gb_per_s": round(size / save_s / 1e9, 2),
        "sync_after_s": round(sync_s, 2),
        "durable_gb_per_s": round(size / (save_s + sync_s) / 1e9, 2),
    }
    try:  # read it back from disk, not from the page cache (root in the benchmark VM; skipped elsewhere)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        out["page_cache_dropped"] = True
    except OSError:
        out["page_cache_dropped"] = False
    # Resume: deploy the same experiment again with a few more steps; end it at its first step.
    cfg_resume = cfg_path.with_name(cfg_path.stem + "-resume.yaml")
    import yaml

    doc = yaml.safe_load(cfg_path.read_text())
    doc["train"]["max_steps"] = len(records) + 3
    cfg_resume.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = log_path.read_text(errors="replace")
    proc, launch2 = launch_app(cfg_resume, log_path, env)
    failure = follow(proc, run_dir / "metrics.jsonl", len(records) + 1, case.timeout, launch2)
    log = log_path.read_text(errors="replace")[len(before) :]
    resumed = [r for r in read_records(run_dir / "metrics.jsonl") if r["time"] > launch2]
    if failure or not resumed:
        out["resume_error"] = failure or error_lines(log)
        return out
    out["resume_time_to_first_step_s"] = round(resumed[0]["time"] - launch2, 2)
    out["fresh_time_to_first_step_s"] = round(records[0]["time"] - launch, 2)
    out["resumed_at_step"] = resumed[0]["step"]
    m = LOADED_IN.search(log)  # the loop's own figure: restore() of engine, optimizer and scheduler states
    if m:
        out["load_s"] = float(m.group(1))
    out["startup_difference_s"] = round(out["resume_time_to_first_step_s"] - out["fresh_time_to_first_step_s"], 2)
    return out


# ---- the peer runners (Hugging Face Trainer, TRL's SFTTrainer and DPOTrainer) ---------------------------

# runner name: the module torchrun starts, and its extra arguments
PEERS = {
    "hf": ("benchmarks.hf_trainer", []),
    "trl": ("benchmarks.trl_sft", []),  # plain PyTorch on one GPU
    "trl-ds": ("benchmarks.trl_sft", ["--deepspeed"]),  # with the app's ds_config
    "trl-dpo": ("benchmarks.trl_dpo", []),  # TRL's DPOTrainer, plain PyTorch on one GPU
}


def peer_command(runner: str, cfg_path: Path, workers: int) -> list[str]:
    module, extra = PEERS[runner]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        "-m",
        module,
        "--config",
        str(cfg_path),
        *extra,
    ]


def run_hf(case: Case, cfg_path: Path, workers: int, out_json: Path, log_path: Path) -> dict[str, Any]:
    env = {**bench_env(), **case.env}
    env["BENCH_LAUNCH_T"] = repr(time.time())
    out_json.unlink(missing_ok=True)
    cmd = [
        *peer_command(case.runner, cfg_path, workers),
        "--warmup",
        str(case.warmup),
        "--steps",
        str(case.steps),
        "--out",
        str(out_json),
    ]
    with log_path.open("a") as log:
        launch = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    profile_driver(proc, log_path)
    failure = follow(proc, out_json, None, case.timeout, launch)
    if out_json.exists():
        return json.loads(out_json.read_text())
    return {"error": f"{failure or 'no result'}: {error_lines(log_path.read_text(errors='replace'))}"}


def method_of(cfg) -> str:
    """What a config trains, for the records' `method` (bench.peer_table pairs app and peer cases of one method
    only): sft, or the preference loss (dpo for sigmoid; ipo, simpo, orpo)."""
    if cfg.preference is None:
        return "sft"
    return {"sigmoid": "dpo"}.get(cfg.preference.loss, cfg.preference.loss)


def settled_config(cfg, gpu_memory: int | None = None):
    """`cfg` with its auto settings chosen as `finetune train` chooses them on this machine (app.autoset: its GPUs'
    memory, or `gpu_memory` bytes where given), for the harness's records and the peers that run the same config."""
    from app import autoset, driver

    def detect():
        return (gpu_memory, "the harness's --gpu-memory") if gpu_memory else driver.cluster_gpu_memory(cfg)

    return autoset.settle(cfg, hardware=autoset.Hardware(detect=detect))
