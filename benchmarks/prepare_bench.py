"""Data preparation, side by side in one run: the path before issue #47 against the current one, on the same data.

    python -m benchmarks.prepare_bench --docs 20000 --conversations 10000    # about 5 minutes on 2 cores
    python -m benchmarks.prepare_bench --kinds text                        # the issue's sizes (GPU host, 16 cores;
    python -m benchmarks.prepare_bench --kinds chat                        # one call each: docs/benchmarks.md)
    python -m benchmarks.prepare_bench --quick --out /tmp/p.jsonl          # plumbing check (its test)

Data (seeded, deterministic): a byte-level BPE (32k) trained with `tokenizers` and saved as a Hugging Face tokenizer
folder (EOS `</s>`; `<|system|>`, `<|user|>`, `<|assistant|>` as special tokens, so the zephyr template has no
unknown marker), text documents of 200-800 words of a Zipf-distributed made-up vocabulary, and chat conversations of
1-4 turns (a system prompt in 3 of 10) as JSON Lines.

Paths, each in a process of its own with a fresh `datasets` cache, over the same files and settings (packing,
seq_length 2048, chat with the zephyr template):
- old: `app.data.prepare` of commit afa43bd (a `git worktree` of it, on PYTHONPATH), as global rank 0 ran it:
  `datasets.map` with data.num_proc processes (8, its default on a host of 8 or more CPUs, and every CPU), then
  save_to_disk. Its own rule runs one process where a split has fewer than 4,000 rows a process ("processes").
- new: `app.data.pipeline.ensure(cfg)` of this tree on a local Ray cluster of every CPU (`ray.init(num_cpus=...)`,
  timed apart as ray_start_s): Ray Data actors, units of 4,096 rows, compact arrays under <storage>/prepared/<key>/.

Seconds run from the config to the prepared data on disk (tokenizer load, reading the JSON Lines into Arrow,
rendering, tokenizing, packing, writing). Tokens are the blocks' real tokens (padding excluded); bytes a token are
the old cache folder's size, or the manifest's bytes, over them. Every block of both paths is hashed (input_ids,
labels, position_ids as int64) and compared position by position.

Each case is one JSON record appended to --out (default benchmarks/results/<date>-prepare-cpu.jsonl; the issue's
target is per node of the GPU host: see docs/benchmarks.md, Data preparation); a markdown table is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "afa43bd"
SPECIALS = ["</s>", "<|system|>", "<|user|>", "<|assistant|>"]
ROWS_PER_PROCESS = 4000  # the old tokenize(): fewer rows than 4 * num_proc * 1000 ran in one process


# ---- data ---------------------------------------------------------------------------------------------------


def make_words(n: int, rng: random.Random) -> list[str]:
    """n distinct made-up words, shortest first (the most frequent under Zipf)."""
    onsets = list("bcdfghjklmnprstvwz") + ["th", "ch", "sh", "st", "br", "cl", "gr", "pl", "tr"]
    vowels = list("aeiou") + ["ea", "ou", "ai", "io"]
    codas = [""] * 6 + list("nrstlm") + ["nd", "ng", "rk", "st"]
    words: set[str] = set()
    out = []
    while len(out) < n:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        word = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))
        if word not in words:
            words.add(word)
            out.append(word)
    return sorted(out, key=lambda w: (len(w), w))


class Writer:
    """Words drawn from a Zipf distribution (s = 1.07 over the vocabulary), in sentences."""

    def __init__(self, seed: int, vocabulary: int = 30000):
        import numpy as np

        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.words = np.array(make_words(vocabulary, self.rng), dtype=object)
        weights = 1.0 / (np.arange(vocabulary) + 2.7) ** 1.07
        # What Generator.choice(size, p) draws, with its cumulative distribution computed once, not per call.
        self.cdf = np.cumsum(weights / weights.sum())
        self.cdf /= self.cdf[-1]

    def text(self, words: int, end: str = ".") -> str:
        drawn = self.words[self.cdf.searchsorted(self.np.random(words), side="right")].tolist()
        out, i = [], 0
        while i < len(drawn):
            n = min(self.rng.randint(6, 18), len(drawn) - i)
            sentence = drawn[i : i + n]
            sentence[0] = sentence[0].capitalize()
            mid = self.rng.randrange(n) if n > 8 and self.rng.random() < 0.4 else -1
            if mid >= 0:
                sentence[mid] += ","
            out.append(" ".join(sentence) + (end if i + n >= len(drawn) else self.rng.choice(".....?!")))
            i += n
        return " ".join(out)


def write_data(folder: Path, docs: int, conversations: int, doc_words: tuple[int, int], seed: int) -> dict:
    """text.jsonl, chat.jsonl; what they hold."""
    writer = Writer(seed)
    rng = writer.rng
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "text.jsonl", "w") as f:
        for _ in range(docs):
            paragraphs = [writer.text(n) for n in split_words(rng.randint(*doc_words), rng)]
            f.write(json.dumps({"text": "\n\n".join(paragraphs)}) + "\n")
    with open(folder / "chat.jsonl", "w") as f:
        for _ in range(conversations):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": "You are " + writer.text(rng.randint(10, 40))})
            for _ in range(rng.randint(1, 4)):
                messages.append({"role": "user", "content": writer.text(rng.randint(8, 60), "?")})
                answer = [writer.text(n) for n in split_words(rng.randint(40, 250), rng)]
                messages.append({"role": "assistant", "content": "\n\n".join(answer)})
            f.write(json.dumps({"messages": messages}) + "\n")
    return {"text_bytes": (folder / "text.jsonl").stat().st_size, "chat_bytes": (folder / "chat.jsonl").stat().st_size}


def make_data(args, work: Path) -> dict:
    """The files and the tokenizer in `work`, made now unless an earlier run (--data-only) made them there with the
    same sizes and seed (data.json says so): made once, they need not be made again by the run that times the
    paths, which only reads them."""
    wanted = {k: getattr(args, k) for k in ("docs", "conversations", "doc_words", "seed", "vocab")}
    marker = work / "data.json"
    if marker.exists() and (found := json.loads(marker.read_text()))["wanted"] == wanted:
        print(f"data and tokenizer: made before in {work} ({found['data_s']} s, {found['tokenizer_s']} s)")
        return found
    started = time.perf_counter()
    lo, hi = (int(x) for x in args.doc_words.split(":"))
    write_data(work / "data", args.docs, args.conversations, (lo, hi), args.seed)  # both, whatever --kinds
    data_s = round(time.perf_counter() - started, 1)
    vocab = train_tokenizer(work / "tokenizer", work / "data", args.vocab)
    tokenizer_s = round(time.perf_counter() - started - data_s, 1)
    print(f"data: {args.docs:,} documents, {args.conversations:,} conversations: {data_s} s", end="; ")
    print(f"tokenizer, vocab {vocab:,}: {tokenizer_s} s")
    made = {"wanted": wanted, "data_s": data_s, "tokenizer_s": tokenizer_s, "vocab": vocab}
    marker.write_text(json.dumps(made))
    return made


def split_words(total: int, rng: random.Random) -> list[int]:
    """A document's words as paragraphs of 40-160 words."""
    out = []
    while total > 0:
        n = min(total, rng.randint(40, 160))
        out.append(n)
        total -= n
    return out


def train_tokenizer(folder: Path, data: Path, vocab: int, sample_rows: int = 4000) -> int:
    """A byte-level BPE trained on the first rows of both files, saved as a from_pretrained folder; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        for name in ("text.jsonl", "chat.jsonl"):
            with open(data / name) as f:
                for n, line in enumerate(f):
                    if n >= sample_rows:
                        break
                    row = json.loads(line)
                    yield row["text"] if "text" in row else "\n".join(m["content"] for m in row["messages"])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", bos_token="</s>", additional_special_tokens=SPECIALS[1:]
    )
    hf.save_pretrained(folder)
    return len(hf)


# ---- one path, in a process of its own (--worker) ----------------------------------------------------------


def config_dict(spec: dict, kind: str, storage: Path) -> dict:
    data = {"dataset": spec["data"][kind], "split": "train", "seq_length": spec["seq_length"], "packing": True}
    data |= {"format": "chat", "chat_template": "zephyr"} if kind == "chat" else {"format": "text"}
    data["num_proc"] = spec["num_proc"]
    return {
        "experiment": {"name": f"prepare-bench-{kind}", "storage_path": str(storage)},
        "model": {"name_or_path": spec["tokenizer"], "tokenizer": spec["tokenizer"]},
        "data": data,
        "scaling": {"num_workers": 1, "use_gpu": False},
    }


def timed(module, name: str, phases: dict[str, float], label: str, undo: list) -> None:
    """Adds the seconds spent in module.name (where it exists) to phases[label], until undo's functions run."""
    inner = getattr(module, name, None)
    if inner is None:
        return
    undo.append(lambda: setattr(module, name, inner))

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[label] = round(phases.get(label, 0.0) + time.perf_counter() - started, 2)

    setattr(module, name, wrapper)


def block_digest(block: dict) -> str:
    import numpy as np

    h = hashlib.blake2b(digest_size=8)
    for key in ("input_ids", "labels", "position_ids"):
        if key in block:
            h.update(np.ascontiguousarray(np.asarray(block[key]), dtype=np.int64).tobytes())
    return h.hexdigest()


def real_tokens(block: dict, seq: int, pad: int) -> int:
    """Tokens of a block but its trailing padding (packed chat: the last segment whose positions restart and whose
    ids are all padding; a conversation starts with a role marker, never with the padding id)."""
    import numpy as np

    if "position_ids" not in block:
        return seq
    starts = np.flatnonzero(np.asarray(block["position_ids"]) == 0)
    last = int(starts[-1])
    return last if last > 0 and bool((np.asarray(block["input_ids"])[last:] == pad).all()) else seq


def old_case(spec: dict, kind: str, case: Path) -> tuple[dict, Any, int]:
    import datasets

    from app import data
    from app.config import TrainingConfig
    from app.model import load_tokenizer

    datasets.config.HF_DATASETS_CACHE = case / "hf"
    phases: dict[str, float] = {}
    undo: list = []
    timed(data, "load_split", phases, "read", undo)
    timed(data, "tokenize", phases, "tokenize_pack", undo)
    timed(datasets.DatasetDict, "save_to_disk", phases, "write", undo)
    started = time.perf_counter()
    try:
        cfg = TrainingConfig.model_validate(config_dict(spec, kind, case / "storage"))
        tok = load_tokenizer(cfg.model)
        train, _ = data.prepare(cfg.data, tok, spec["tokenizer"], case / "cache", cfg.train.seed, 0, lambda: None)
        seconds = time.perf_counter() - started
    finally:
        for restore in reversed(undo):
            restore()
    (folder,) = [p for p in (case / "cache").iterdir() if p.name.startswith("tokenized-") and p.is_dir()]
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    blocks = train.with_format("numpy")

    def each():
        for lo in range(0, len(blocks), 1024):
            batch = blocks[lo : lo + 1024]
            for i in range(len(batch["input_ids"])):
                yield {k: v[i] for k, v in batch.items()}

    pad = tok.pad_token_id
    return {"seconds": seconds, "bytes": size, "rows": rows_of(spec, kind), "phases": dict(phases)}, each(), pad


def new_case(spec: dict, kind: str, case: Path) -> tuple[dict, Any, int]:
    import datasets

    from app.config import TrainingConfig
    from app.data import pipeline, store

    datasets.config.HF_DATASETS_CACHE = case / "hf"
    phases: dict[str, float] = {}
    undo: list = []
    timed(pipeline, "read_source" if hasattr(pipeline, "read_source") else "raw_splits", phases, "read", undo)
    timed(pipeline, "run_split", phases, "encode_write", undo)
    timed(pipeline, "_on_ray", phases, "ray_data", undo)
    progress = getattr(pipeline, "Progress", None)
    if progress is not None:

        class FirstUnit(progress):  # when the first unit came back from an actor (actors' start-up and one unit)
            def add(self, rows):
                phases.setdefault("first_unit_s", round(time.time() - self.started, 2))
                return super().add(rows)

        pipeline.Progress = FirstUnit
        undo.append(lambda: setattr(pipeline, "Progress", progress))
    started, cpu = time.perf_counter(), time.process_time()
    try:
        cfg = TrainingConfig.model_validate(config_dict(spec, kind, case / "storage"))
        folder, manifest = pipeline.ensure(cfg)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu  # the driver's own CPU (reading, planning, sending rows), not its actors'

    finally:
        for restore in reversed(undo):
            restore()
    size = sum(s["bytes"] for s in manifest["splits"].values())
    split = store.PreparedSplit.open(folder, "train")
    out = {"seconds": seconds, "bytes": size, "rows": manifest["splits"]["train"]["rows"], "phases": dict(phases)}
    out |= reuse(cfg, folder, case)
    out |= {"manifest_tokens": manifest["splits"]["train"]["tokens"], "manifest_seconds": manifest["seconds"]}
    out |= {"driver_cpu_s": round(cpu, 2), "rows_per_s": round(out["rows"] / seconds, 1)}
    out["units"] = len(manifest["splits"]["train"].get("units", []))
    out["nodes"] = manifest.get("nodes")
    return out, (split[i] for i in range(len(split))), manifest["pad_id"]


def reuse(cfg, folder: Path, case: Path) -> dict[str, Any]:
    """A second preparation of the same config finds the first's dataset on the volume: timed in this process (the
    key and the manifest read: `pipeline.ensure` again) and as a second `finetune prepare` of its own (launch to exit:
    the interpreter, the config checks, its own local Ray cluster's start, the key), which must say it reused it."""
    from app.data import pipeline

    started = time.perf_counter()
    again, _ = pipeline.ensure(cfg)
    out: dict[str, Any] = {"reuse_s": round(time.perf_counter() - started, 3), "reused_same": again == folder}
    # The command checks the config as a training run's start does, so its model must be one (a small one of the
    # tokenizer's vocabulary, built from its config: preparing builds no model); the tokenizer, so the key, is the same.
    from transformers import AutoTokenizer, LlamaConfig

    model = case / "model"
    vocab = len(AutoTokenizer.from_pretrained(cfg.model.tokenizer))
    LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2
    ).save_pretrained(model)
    doc = cfg.model_dump(mode="json", exclude_unset=True)
    doc["model"]["name_or_path"] = f"random-init:{model}"
    config = case / "prepare-again.yaml"
    config.write_text(json.dumps(doc))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "prepare", str(config)], capture_output=True, text=True, timeout=600
    )
    out["reuse_cli_s"] = round(time.perf_counter() - started, 2)
    said = done.stdout + done.stderr
    out["reuse_cli_reused"] = done.returncode == 0 and f"reusing {folder}" in said and f"prepared: {folder}" in said
    if not out["reuse_cli_reused"]:
        print(f"second prepare (exit {done.returncode}) did not reuse {folder}:\n{said[-3000:]}", file=sys.stderr)
    return out


def rows_of(spec: dict, kind: str) -> int:
    with open(spec["data"][kind], "rb") as f:
        return sum(1 for line in f if line.strip())


def worker(spec_file: Path) -> None:
    """One path over each kind of data: seconds, bytes, block hashes, into spec['result']."""
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    spec = json.loads(spec_file.read_text())
    import app

    assert Path(app.__file__).resolve().is_relative_to(Path(spec["tree"]).resolve()), app.__file__
    result: dict[str, Any] = {"cases": {}}
    if spec["path"] == "new":
        import ray

        started = time.perf_counter()
        ray.init(address="local", num_cpus=spec["cpus"], include_dashboard=False, log_to_driver=False)
        result["ray_start_s"] = round(time.perf_counter() - started, 2)
        result["ray_cpus"] = int(ray.cluster_resources().get("CPU", 0))
    for kind in spec["kinds"]:
        case = Path(spec["work"]) / kind
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir(parents=True)
        run = old_case if spec["path"] == "old" else new_case
        out, blocks, pad = run(spec, kind, case)
        digests, tokens = [], 0
        for block in blocks:
            digests.append(block_digest(block))
            tokens += real_tokens(block, spec["seq_length"], pad)
        out |= {"blocks": len(digests), "tokens": tokens, "digests": digests}
        result["cases"][kind] = out
        shutil.rmtree(case, ignore_errors=True)
        print(f"{spec['path']} {kind}: {out['seconds']:.1f} s, {len(digests):,} blocks", file=sys.stderr, flush=True)
    if spec["path"] == "new":
        import ray

        ray.shutdown()
    versions = {}
    for name in ("datasets", "transformers", "tokenizers", "ray", "pyarrow"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    result["versions"] = versions
    Path(spec["result"]).write_text(json.dumps(result))


# ---- the run -------------------------------------------------------------------------------------------------


def worker_env(tree: Path, parallelism: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if parallelism != "unset":
        env["TOKENIZERS_PARALLELISM"] = parallelism
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_DEDUP_LOGS": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "USE_JAX": "0",
            "USE_TF": "0",
            "USE_TORCH": "1",
        }
    )
    return env


def run_worker(name: str, spec: dict, work: Path, env: dict[str, str], timeout: float) -> dict:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "work": str(folder / "cases"), "result": str(folder / "result.json")}
    (folder / "spec.json").write_text(json.dumps(spec))
    log = folder / "worker.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(folder / "spec.json")],
            cwd=folder,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{name} failed (exit {proc.returncode}); the end of {log}:\n{tail}")
    return json.loads((folder / "result.json").read_text())


def compare(a: list[str], b: list[str]) -> dict:
    """Block hashes of one path against another's: equal, or where they part and how much they share."""
    if a == b:
        return {"equal": True}
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    from collections import Counter

    common = sum((Counter(a) & Counter(b)).values())
    return {"equal": False, "first_difference": first, "in_place": sum(x == y for x, y in zip(a, b)), "common": common}


def hardware() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024**2
    except (OSError, ValueError, IndexError):
        pass
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {"nproc": os.cpu_count(), "cpu": model, "memory_gib": mem, "host": platform.node(), "loadavg": load}


def git(*args: str) -> str:
    """git's output in this checkout; empty where there is no git or no repository (the GPU host's copy)."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def old_tree(args, work: Path) -> tuple[Path, bool]:
    """The old commit's tree: --old-tree as given, else a detached git worktree (removed at the end)."""
    if args.old_tree:
        return Path(args.old_tree).resolve(), False
    folder = work / f"old-{args.old_commit}"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(folder), args.old_commit],
        check=True,
    )
    return folder, True


# What a new path's case adds to its record: the driver's CPU seconds and rows a second show what it still does.
NEW_FIELDS = (
    "manifest_tokens",
    "manifest_seconds",
    "units",
    "nodes",
    "driver_cpu_s",
    "rows_per_s",
    "reuse_s",
    "reused_same",
    "reuse_cli_s",
    "reuse_cli_reused",
)


def records_of(args, results: dict, hw: dict, meta: dict) -> list[dict]:
    out = []
    new = results["new"]
    for name, res in results.items():
        for kind, case in res["cases"].items():
            rate = case["rows"] / case["seconds"] if kind == "chat" else case["tokens"] / case["seconds"]
            rec = {
                "bench": "prepare",
                "date": meta["date"],
                "path": res["path"],
                "commit": res["commit"],
                "kind": kind,
                "size": case["rows"],
                "cpus": args.cpus,
                "num_proc": res["num_proc"],
                "processes": res["processes"][kind],
                "seconds": round(case["seconds"], 2),
                "rate": round(rate, 1),
                "rate_unit": "conversations/s" if kind == "chat" else "tokens/s",
                "tokens_per_s": round(case["tokens"] / case["seconds"]),
                "bytes": case["bytes"],
                "bytes_per_token": round(case["bytes"] / max(case["tokens"], 1), 3),
                "bytes_per_position": round(case["bytes"] / max(case["blocks"] * args.seq_length, 1), 3),
                "blocks": case["blocks"],
                "tokens": case["tokens"],
                "phases": case.get("phases", {}),
                "seq_length": args.seq_length,
                "vocab": meta["vocab"],
                "tokenizers_parallelism": args.tokenizers_parallelism,
            }
            if res["path"] == "new":
                rec |= {k: res[k] for k in ("ray_start_s", "ray_cpus")}
                rec |= {k: case[k] for k in NEW_FIELDS if k in case}
                rec["equal_blocks_vs"] = {
                    other: compare(r["cases"][kind]["digests"], case["digests"])["equal"]
                    for other, r in results.items()
                    if r["path"] == "old" and kind in r["cases"]
                }
                rec["equal_blocks"] = all(rec["equal_blocks_vs"].values())  # equal to every old run's
            else:
                vs = compare(case["digests"], new["cases"][kind]["digests"])
                rec["equal_blocks"] = vs.pop("equal")
                rec["blocks_vs_new"] = vs
                rec["new_speedup"] = round(case["seconds"] / new["cases"][kind]["seconds"], 2)
            rec |= {"hardware": hw, "versions": res.get("versions", {}), "command": meta["command"]}
            rec |= {"data_s": meta["data_s"], "tokenizer_s": meta["tokenizer_s"], "note": args.note}
            out.append(rec)
    return out


def table(records: list[dict]) -> str:
    lines = [
        "| data | path | processes | seconds | rate | bytes a token | blocks | tokens | same blocks as new "
        "| new vs this |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["path"] == "new":
            who, speed = f"new (Ray Data, {r['ray_cpus']} CPUs)", "1.00x"
            same = "-"
        else:
            who, speed = f"old, num_proc {r['num_proc']}", f"{r['new_speedup']:.2f}x"
            vs = r.get("blocks_vs_new", {})
            same = "equal" if r["equal_blocks"] else f"differ from block {vs.get('first_difference')}"
        rate = f"{r['rate']:,.0f}/s" if r["kind"] == "chat" else f"{r['rate'] / 1e6:.2f}M tok/s"
        lines.append(
            f"| {r['kind']} {r['size']:,} | {who} | {r['processes']} | {r['seconds']:.1f} | {rate} | "
            f"{r['bytes_per_token']:.2f} | {r['blocks']:,} | {r['tokens']:,} | {same} | {speed} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prepare_bench",
        description="Data preparation before issue #47 (app.data.prepare of an old commit, datasets.map) against "
        "the current app.data.pipeline.ensure (Ray Data on every CPU), in one run on the same synthetic data.",
    )
    p.add_argument("--docs", type=int, default=400_000, help="text documents (default: the issue's 400,000)")
    p.add_argument("--conversations", type=int, default=200_000, help="chat conversations (default 200,000)")
    p.add_argument("--doc-words", default="200:800", help="words a document, LO:HI (default 200:800)")
    p.add_argument("--seq-length", type=int, default=2048, help="data.seq_length (packed blocks; default 2048)")
    p.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (default 32000)")
    p.add_argument("--kinds", default="text,chat", help="which data, comma-separated (default text,chat)")
    p.add_argument("--seed", type=int, default=0, help="data and tokenizer seed (default 0)")
    p.add_argument("--cpus", type=int, default=os.cpu_count(), help="the Ray cluster's CPUs (default: nproc)")
    p.add_argument(
        "--old-procs", default="", help="old path's data.num_proc values, comma-separated (default: 8 and --cpus)"
    )
    p.add_argument("--old-commit", default=OLD_COMMIT, help=f"the old path's commit (default {OLD_COMMIT})")
    p.add_argument(
        "--old-tree", help="a folder holding the old commit's app/ (where there is no git, e.g. the GPU host)"
    )
    p.add_argument(
        "--tokenizers-parallelism",
        default="false",
        choices=["false", "true", "unset"],
        help="TOKENIZERS_PARALLELISM in every process (default false, as the other suites run)",
    )
    p.add_argument("--out", help="results file to append to (default benchmarks/results/<date>-prepare-cpu.jsonl)")
    p.add_argument("--work", help="scratch folder (default: a new temporary folder, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (data, logs, prepared data)")
    p.add_argument(
        "--data-only",
        action="store_true",
        help="make the data and the tokenizer in --work (kept) and stop: a later run with the same --work and sizes "
        "reads them instead of making them again",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds a path may take (default 3600)")
    p.add_argument("--note", default="", help="a note stored in each record")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes for a plumbing check (1,000 short documents, 300 conversations, seq 1024, vocab 1,000: "
        "one unit each, encoded in the driver); writes records only with --out",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.data_only and not args.work:
        p.error("--data-only needs --work (the folder a later run reads the data from)")
    args.keep = args.keep or args.data_only
    if args.quick:
        args.docs, args.conversations, args.doc_words = 1000, 300, "20:60"
        args.seq_length, args.vocab = 1024, 1000
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0
    command = "python -m benchmarks.prepare_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else None if args.quick else REPO / f"benchmarks/results/{date}-prepare-cpu.jsonl"
    kinds = [k for k in args.kinds.split(",") if k]
    procs = [int(n) for n in args.old_procs.split(",") if n] or sorted({8, args.cpus})
    work = Path(args.work or tempfile.mkdtemp(prefix="prepare-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    worktree = None
    try:
        load_before = hardware()["loadavg"]
        data = make_data(args, work)
        data_s, tokenizer_s, vocab = data["data_s"], data["tokenizer_s"], data["vocab"]
        if args.data_only:
            return 0
        tree, made = old_tree(args, work)
        worktree = tree if made else None
        spec = {
            "kinds": kinds,
            "data": {"text": str(work / "data/text.jsonl"), "chat": str(work / "data/chat.jsonl")},
            "tokenizer": str(work / "tokenizer"),
            "seq_length": args.seq_length,
            "cpus": args.cpus,
        }
        rows = {"text": args.docs, "chat": args.conversations}
        results = {}
        for n in procs:
            spec_old = {**spec, "path": "old", "num_proc": n, "tree": str(tree)}
            res = run_worker(f"old-np{n}", spec_old, work, worker_env(tree, args.tokenizers_parallelism), args.timeout)
            res |= {"path": "old", "num_proc": n, "commit": args.old_commit}
            res["processes"] = {k: n if rows[k] >= ROWS_PER_PROCESS * n else 1 for k in kinds}
            results[f"old-np{n}"] = res
        commit = (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if git("status", "-s", "app") else "")
        spec_new = {**spec, "path": "new", "num_proc": None, "tree": str(REPO)}
        res = run_worker("new", spec_new, work, worker_env(REPO, args.tokenizers_parallelism), args.timeout)
        res |= {"path": "new", "num_proc": None, "commit": commit, "processes": {k: args.cpus for k in kinds}}
        results["new"] = res
        meta = {"date": date, "command": command, "data_s": data_s, "tokenizer_s": tokenizer_s, "vocab": vocab}
        hw = hardware() | {"loadavg_before": load_before}
        records = records_of(args, results, hw, meta)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a") as f:
                for rec in records:
                    f.write(json.dumps(rec) + "\n")
        print()
        print(table(records))
        print()
        print(f"command: {command}")
        print(f"hardware: nproc {hw['nproc']}, {hw['cpu']}, {hw['memory_gib']} GiB; date {date}")
        print(f"load average before / after: {' '.join(load_before)} / {' '.join(hw['loadavg'])}")
        print(f"Ray start (not in the new path's seconds): {results['new']['ray_start_s']} s")
        for rec in records:
            print(f"phases {rec['path']} np={rec['num_proc']} {rec['kind']}: {rec['phases']}")
            if "driver_cpu_s" in rec:
                print(f"driver {rec['kind']}: {rec['driver_cpu_s']} CPU s, {rec['rows_per_s']:,.0f} rows/s")
            if "reuse_s" in rec:
                print(
                    f"second prepare {rec['kind']}: ensure {rec['reuse_s']} s (same folder: {rec['reused_same']}); "
                    f"finetune prepare {rec['reuse_cli_s']} s launch to exit (reused: {rec['reuse_cli_reused']})"
                )
        if out is not None:
            print(f"records: {out}")
        return 0
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
