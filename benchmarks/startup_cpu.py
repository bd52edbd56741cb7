"""Launch to first step on a CPU machine, phase by phase: the tiny model, one CPU worker, the data prepared by an
untimed first run, each repeat a fresh experiment; trees (the app's code at two commits) and environment variants
alternated, medians printed. The phases are those of the GPU start-up table (docs/benchmarks.md, "Start-up"):
launch -> driver, Ray start, worker group, the loop's imports, data, model, engine, first step.

    python -m benchmarks.startup_cpu --model .local/tiny-gpt2 --work /tmp/startup --repeats 5 \
        --tree base=/tmp/startup/base --tree new=. [--env name=VAR=VALUE,VAR=VALUE] [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path

import yaml

from benchmarks.runner import REPO, bench_env, launch_app, read_records, startup_phases, stop

PHASES = ("launch_to_driver", "ray_started", "trainer", "worker", "imports", "model", "data", "engine", "first_step")


def config(model: Path, work: Path, name: str) -> dict:
    corpus = REPO / "examples" / "data" / "tiny-news.jsonl"
    return {
        "experiment": {"name": name, "storage_path": str(work / "storage")},
        "model": {"name_or_path": str(model)},
        "data": {"dataset": str(corpus), "split": "train", "seq_length": 64, "packing": True},
        "train": {"epochs": 1, "max_steps": 50, "micro_batch_size": 4, "log_every_steps": 1},
        "checkpoint": {"every_steps": 1000, "export_final": False},
        "scaling": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1},
    }


def one(tree: Path, model: Path, work: Path, name: str, env: dict[str, str], timeout: float = 240) -> dict:
    """One launch, ended (with every process it started) at its first step's record."""
    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(model, work, name)))
    metrics = work / "storage" / name / "metrics.jsonl"
    # DeepSpeed's CPU op built once under `work`: not waiting on another run's build in the shared cache.
    # The tree's own code in the driver and in the workers, which inherit its environment.
    own = {"TORCH_EXTENSIONS_DIR": str(work / "torch_extensions"), "PYTHONPATH": str(tree)}
    proc, launch = launch_app(cfg_path, work / f"{name}.log", {**bench_env(), **own, **env}, tree)
    while not read_records(metrics) and proc.poll() is None and time.time() - launch < timeout:
        time.sleep(0.05)
    records = read_records(metrics)
    stop(proc, grace=10, signals=(signal.SIGKILL,))
    phases = startup_phases(metrics, records, launch) if records else None
    total = round(records[0]["time"] - launch, 2) if records else None
    return {"name": name, "phases": phases, "total": total, "rc": proc.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the tiny model's folder (finetune tiny)")
    p.add_argument("--work", type=Path, required=True, help="configs, logs and storage (prepared data kept)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: the app's code to run (default: this)")
    p.add_argument("--env", action="append", default=[], help="NAME=VAR=VALUE[,VAR=VALUE]: an environment variant")
    p.add_argument("--out", type=Path, help="append each run as a JSON line")
    args = p.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["tree", str(REPO)]]
    envs: list[tuple[str, dict[str, str]]] = [("", {})]
    for spec in args.env:  # NAME=VAR=VALUE,VAR=VALUE
        name, pairs = spec.split("=", 1)
        envs.append((name, dict(kv.split("=", 1) for kv in pairs.split(","))))
    variants = [(f"{t}{'+' + e if e else ''}", Path(path).resolve(), env) for t, path in trees for e, env in envs]
    args.work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    one(variants[0][1], args.model.resolve(), args.work, f"warmup-{stamp}", variants[0][2])  # prepares the data
    runs: dict[str, list[dict]] = {v[0]: [] for v in variants}
    for i in range(args.repeats):
        for n, (label, tree, env) in enumerate(variants):
            run = one(tree, args.model.resolve(), args.work, f"s{stamp}-{i}-v{n}", env)
            run["variant"] = label
            runs[label].append(run)
            print(json.dumps(run), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(run) + "\n")
    print("\nmedians (s):", "variant".ljust(16), *(p[:10].rjust(10) for p in PHASES), "total".rjust(8))
    for label, got in runs.items():
        ok = [r for r in got if r["phases"]]
        med = [statistics.median(r["phases"].get(p, 0) for r in ok) if ok else float("nan") for p in PHASES]
        total = statistics.median(r["total"] for r in ok) if ok else float("nan")
        print(" " * 13, label.ljust(16), *(f"{m:10.2f}" for m in med), f"{total:8.2f}", f"({len(ok)}/{len(got)} ok)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
