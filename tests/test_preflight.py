"""Mistakes that pass every field's own range check but can never run: incomplete model and tokenizer folders,
splits and fractions that select too little, DeepSpeed types DeepSpeed does not know, NVMe offload without a path,
data whose sample has no text, and workers this machine cannot hold. Each is refused by `finetune validate` and
`finetune train` with exit 2 in seconds, one line naming the field and the fix, before any Ray cluster starts, and
nothing is written (app/preflight.py)."""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CORPUS
from test_hostile import jsonl, refused_in_one_line, tree

from app import preflight
from app.cli import main


def _model(drop=(), add=None):
    """A copy of the tiny model folder without the files in `drop`, then `add(folder)`."""

    def make(path: Path, model: Path) -> None:
        shutil.copytree(model, path)
        for name in drop:
            (path / name).unlink()
        if add:
            add(path)

    return make


def _sharded(missing: int):
    """The tiny model's weights as an index over 3 shards (copies of the one file), `missing` of them absent."""

    def add(folder: Path) -> None:
        weights = folder / "model.safetensors"
        shards = [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
        for shard in shards[missing:]:
            shutil.copy(weights, folder / shard)
        weights.unlink()
        index = {"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return add


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _adapter(path: Path, _model: Path) -> None:
    """final/adapter/ of a LoRA run, as PEFT writes it."""
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "gpt2"}))
    (path / "adapter_model.safetensors").write_bytes(b"x")


def _gpt2_vocab_only(folder: Path) -> None:
    (folder / "tok").mkdir()
    (folder / "tok" / "vocab.json").write_text("{}")
    (folder / "tok" / "tokenizer_config.json").write_text("{}")


def _parquet(rows: int):
    def make(path: Path, _model: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": [f"row {i}" for i in range(rows)]}), path)

    return make


def _saved_dict(path: Path, _model: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b c"] * 8})}).save_to_disk(str(path))


def _parquet_empty_head(path: Path, _model: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [""] * 1500 + ["late text"] * 10}), path)


def _shape(model_type: str, **settings):
    """The tiny model's tokenizer beside a small config of `model_type` (for random-init)."""

    def add(folder: Path) -> None:
        from transformers import AutoConfig

        small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
        AutoConfig.for_model(model_type, **small, **settings).save_pretrained(folder)

    return _model(["model.safetensors"], add)


RANDOM_SHAPE = "model.name_or_path=random-init:{tmp}/m"  # the shape _shape writes, random weights


M = "model.name_or_path={tmp}/m"
EMPTY_HEAD = jsonl(*([{"text": ""}] * 1200 + [{"text": "text only from row 1201 on"}] * 5))

# name: (--set overrides, files to create {name: bytes or callable(path, tiny model)}, (field, fix) of the line)
CASES = {
    # -- model and tokenizer folders
    "packed documents through Mamba layers (Bamba)": (
        [RANDOM_SHAPE],
        {"m": _shape("bamba")},
        ("data.packing", "data.packing=false"),
    ),
    "packed documents through gated delta-rule layers (Qwen3.5)": (
        [RANDOM_SHAPE],
        {"m": _shape("qwen3_5_text")},
        ("data.packing", "data.packing=false"),
    ),
    "config.json but no weights": ([M], {"m": _model(["model.safetensors"])}, ("model.name_or_path", "random-init")),
    "weights but no config.json": ([M], {"m": _model(["config.json"])}, ("model.name_or_path", "from_pretrained")),
    "a model at a URL": (
        ["model.name_or_path=s3://bucket/llama"],
        {},
        ("model.name_or_path", "onto the shared volume"),
    ),
    "data at a URL": (["data.dataset=gs://bucket/train.jsonl"], {}, ("data.dataset", "onto the shared volume")),
    "a LoRA adapter's folder": ([M], {"m": _adapter}, ("model.name_or_path", "point it at its base model (gpt2)")),
    "model path is a file": (["model.name_or_path={tmp}/f"], {"f": b"x"}, ("model.name_or_path", "from_pretrained")),
    "sharded index, one shard missing": (
        [M],
        {"m": _model(add=_sharded(1))},
        ("model.name_or_path", "download the missing shards"),
    ),
    "index that is not JSON": (
        [M],
        {"m": _model(["model.safetensors"], lambda f: (f / "model.safetensors.index.json").write_text("{oops"))},
        ("model.name_or_path", "download it again"),
    ),
    "truncated safetensors": ([M], {"m": _model(add=_truncate)}, ("model.name_or_path", "cut short")),
    "safetensors with a garbage header": (
        [M],
        {"m": _model(add=lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 64))},
        ("model.name_or_path", "download it again"),
    ),
    "tokenizer path missing": (["model.tokenizer={tmp}/no-tokenizer"], {}, ("model.tokenizer", "save_pretrained")),
    "tokenizer path is a file": (["model.tokenizer={tmp}/t.json"], {"t.json": b"{}"}, ("model.tokenizer", "folder")),
    "model folder without tokenizer files": (
        [M],
        {"m": _model(["tokenizer.json"])},
        ("model.name_or_path", "or set model.tokenizer"),
    ),
    "tokenizer with vocab.json but no merges.txt": (
        ["model.tokenizer={tmp}/m/tok", M],
        {"m": _model(add=_gpt2_vocab_only)},
        ("model.tokenizer", "save_pretrained"),
    ),
    "random-init folder without config.json": (
        ["model.name_or_path=random-init:{tmp}/m"],
        {"m": _model(["config.json"])},
        ("model.name_or_path", "from_pretrained"),
    ),
    # -- splits and fractions (the bundled corpus: 2,000 rows in one split, train)
    "split selecting no row": (["data.split=train[:0]"], {}, ("data.split", "non-empty range")),
    "split past the end": (["data.split=train[100%:]"], {}, ("data.split", "non-empty range")),
    "split the data lacks": (["data.split=validation"], {}, ("data.split", "use one of them")),
    "split expression typo": (["data.split=train[:10"], {}, ("data.split", "write e.g. train")),
    "eval_split the data lacks": (["data.eval_split=test"], {}, ("data.eval_split", "use one of them")),
    "eval_split selecting no row": (["data.eval_split=train[2000:]"], {}, ("data.eval_split", "non-empty range")),
    "eval_fraction leaving no row": (
        ["data.split=train[:2]", "data.eval_fraction=0.9"],
        {},
        ("data.eval_fraction", "data.eval_fraction <="),
    ),
    "eval_fraction leaving too few unpacked rows": (
        ["data.split=train[:10]", "data.eval_fraction=0.5", "data.packing=false", "train.micro_batch_size=8"],
        {},
        ("data.eval_fraction", "data.eval_fraction <= 0.2"),
    ),
    "unpacked split smaller than one step": (
        ["data.split=train[:7]", "data.packing=false", "train.micro_batch_size=4", "scaling.num_workers=2"],
        {},
        ("data.split", "select more rows"),
    ),
    "parquet split past the end": (
        ["data.dataset={tmp}/d.parquet", "data.split=train[5:]"],
        {"d.parquet": _parquet(5)},
        ("data.split", "train: 5 rows"),
    ),
    "json array split selecting no row": (
        ["data.dataset={tmp}/d.json", "data.split=train[3:]"],
        {"d.json": b'[{"text": "a"}, {"text": "b"}, {"text": "c"}]'},
        ("data.split", "train: 3 rows"),
    ),
    "txt split counting every line": (
        ["data.dataset={tmp}/d.txt", "data.split=train[4:]"],
        {"d.txt": b"a\n\nb\nc\n"},
        ("data.split", "train: 4 rows"),
    ),
    "saved DatasetDict without the eval split": (
        ["data.dataset={tmp}/saved", "data.eval_split=validation"],
        {"saved": _saved_dict},
        ("data.eval_split", "['train']"),
    ),
    "default 1% of a small file": (
        ["data.dataset={tmp}/d.jsonl", "data.split=train[:1%]"],
        {"d.jsonl": jsonl(*[{"text": "some words"}] * 40)},
        ("data.split", "train: 40 rows"),
    ),
    # -- the DeepSpeed block
    "optimizer type typo": (
        ["deepspeed.optimizer={type: AdamWW}"],
        {},
        ("deepspeed.optimizer.type", "did you mean 'adam'"),
    ),
    "optimizer without a type": (["deepspeed.optimizer={params: {lr: 0.1}}"], {}, ("deepspeed.optimizer.type", "set")),
    "scheduler type unknown": (
        ["deepspeed.scheduler={type: Cosine}"],
        {},
        ("deepspeed.scheduler.type", "WarmupCosineLR"),
    ),
    "NVMe optimizer offload without nvme_path": (
        ["deepspeed.zero_optimization.offload_optimizer={device: nvme}"],
        {},
        ("deepspeed.zero_optimization.offload_optimizer.nvme_path", "device: cpu"),
    ),
    "NVMe parameter offload without nvme_path": (
        ["deepspeed.zero_optimization.offload_param={device: nvme}"],
        {},
        ("deepspeed.zero_optimization.offload_param.nvme_path", "nvme_path=/local_nvme"),
    ),
    "ZeRO key typo": (
        ["deepspeed.zero_optimization.overlap_com=true"],
        {},
        ("deepspeed.zero_optimization.overlap_com", "did you mean 'overlap_comm'"),
    ),
    "offload key typo": (
        ["deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memroy: true}"],
        {},
        ("deepspeed.zero_optimization.offload_optimizer.pin_memroy", "did you mean 'pin_memory'"),
    ),
    "parameter-offload key of the optimizer's": (
        ["deepspeed.zero_optimization.offload_param={device: cpu, ratio: 0.5}"],
        {},
        ("deepspeed.zero_optimization.offload_param.ratio", "remove it"),
    ),
    # -- data whose sample has no text
    "first 1,200 JSON lines empty": (
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": EMPTY_HEAD},
        ("data.text_field", "shuffle the file"),
    ),
    "first 1,500 parquet rows empty": (
        ["data.dataset={tmp}/d.parquet"],
        {"d.parquet": _parquet_empty_head},
        ("data.text_field", "shuffle the file"),
    ),
    "first 1,000 text lines blank": (
        ["data.dataset={tmp}/d.txt"],
        {"d.txt": b"\n" * 1000 + b"late line\n" * 3},
        ("data.text_field", "shuffle the file"),
    ),
}


def _write(folder: Path, files: dict, model: Path) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(path, model)
        else:
            path.write_bytes(content)


def _args(storage: Path, inputs: Path, model: Path, sets: list[str]) -> list[str]:
    base = [
        f"experiment.storage_path={storage}",
        "experiment.name=preflight",
        f"model.name_or_path={model}",
        "scaling.use_gpu=false",
        "scaling.num_workers=1",
        "data.seq_length=32",
        f"data.dataset={CORPUS}",
        "data.split=train",
    ]
    args = []
    for s in base + [s.replace("{tmp}", str(inputs)) for s in sets]:
        args += ["--set", s]
    return args


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_refused_before_any_cluster(case, tmp_path, tiny_model, capsys, monkeypatch):
    sets, files, (field, fix) = CASES[case]
    inputs, storage = tmp_path / "inputs", tmp_path / "storage"
    inputs.mkdir()
    storage.mkdir()
    _write(inputs, files, tiny_model)
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    refused_in_one_line(_args(storage, inputs, tiny_model, sets), field, fix, capsys)
    assert tree(tmp_path) == before


def test_at_least_twenty_five_cases():
    assert len(CASES) >= 25


ACCEPTED = {
    "a complete sharded index": ([M], {"m": _model(add=_sharded(0))}),
    "random-init folder without weights": (
        ["model.name_or_path=random-init:{tmp}/m"],
        {"m": _model(["model.safetensors"])},
    ),
    "torch's SGD as DeepSpeed's optimizer": (["deepspeed.optimizer={type: SGD, params: {lr: 0.1}}"], {}),
    "DeepSpeed's WarmupLR and Adam": (
        ["deepspeed.optimizer={type: Adam, params: {lr: auto}}", "deepspeed.scheduler={type: WarmupLR}"],
        {},
    ),
    "torch's StepLR": (["deepspeed.scheduler={type: StepLR, params: {step_size: 2}}"], {}),
    "NVMe offload with a path": (
        ["deepspeed.zero_optimization.offload_optimizer={device: nvme, nvme_path: /local_nvme}"],
        {},
    ),
    "eval_fraction leaving one packed row": (["data.split=train[:2]", "data.eval_fraction=0.5"], {}),
    "text after 1,000 rows within a complete small sample": (
        ["data.dataset={tmp}/d.jsonl"],
        {"d.jsonl": jsonl(*([{"text": ""}] * 999 + [{"text": "words"}]))},
    ),
    "a split expression summing slices": (["data.split=train[:1]+train[-1:]"], {}),
    "a recurrent model trained unpacked": ([RANDOM_SHAPE, "data.packing=false"], {"m": _shape("bamba")}),
    "a recurrent model's packed documents left to see each other": (
        [RANDOM_SHAPE, "data.separate_documents=false"],
        {"m": _shape("qwen3_5_text")},
    ),
    "packed documents through attention and short convolutions (LFM2)": ([RANDOM_SHAPE], {"m": _shape("lfm2")}),
}


@pytest.mark.parametrize("case", list(ACCEPTED), ids=list(ACCEPTED))
def test_accepted_neighbours(case, tmp_path, tiny_model, capsys):
    """The valid neighbours of the refused cases pass validate: the checks refuse only what cannot run."""
    sets, files = ACCEPTED[case]
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    _write(inputs, files, tiny_model)
    assert main(["validate", *_args(tmp_path / "storage", inputs, tiny_model, sets)]) == 0, capsys.readouterr().err


# --- one pass -------------------------------------------------------------------------------------------------

CHECK_NAME = re.compile(r"(problems?|^check(_\w+)?|^read_model_config)$")


class BeforeTheCluster(Exception):
    pass


def counted_checks(monkeypatch) -> collections.Counter:
    """Every check function of the app's loaded modules (named *problems, *problem, check*, read_model_config),
    wrapped wherever a module binds it, counting its calls."""
    import app.cli
    import app.driver  # noqa: F401 - loads every module the checks before a run live in

    modules = [m for name, m in list(sys.modules.items()) if name == "app" or name.startswith("app.")]
    counts: collections.Counter = collections.Counter()
    for fn in {id(f): f for m in modules for n, f in vars(m).items() if inspect.isfunction(f)}.values():
        if not (fn.__module__.startswith("app") and CHECK_NAME.search(fn.__name__)):
            continue
        name = f"{fn.__module__}.{fn.__qualname__}"

        def counting(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        for module in modules:
            for attr, value in list(vars(module).items()):
                if value is fn:
                    monkeypatch.setattr(module, attr, counting)
    return counts


@pytest.mark.parametrize("command", ["validate", "validate with an invalid key", "train"])
def test_each_check_runs_once_per_command(command, tmp_path, tiny_model, monkeypatch):
    """The checks before a run are one pass (preflight.problems): for `finetune validate`, for `validate` of a config
    with an invalid key and for `finetune train` up to the start of its cluster, no check runs twice (a model
    folder was read twice, the DeepSpeed block's rules checked again by the builder)."""
    counts = counted_checks(monkeypatch)
    monkeypatch.setattr("app.driver.start_ray", lambda cfg: (_ for _ in ()).throw(BeforeTheCluster()))
    sets = ["train.epochs=0"] if "invalid" in command else []
    argv = [command.split()[0], *_args(tmp_path / "storage", tmp_path, tiny_model, sets)]
    if command == "train":
        with pytest.raises(BeforeTheCluster):
            main(argv)
    else:
        assert main(argv) == (2 if sets else 0)
    assert {name: n for name, n in counts.items() if n > 1} == {}
    ran = {"app.preflight.problems", "app.preflight.storage_problems", "app.preflight.model_folder_problems"}
    ran |= {"app.preflight.split_problems", "app.preflight.read_model_config", "app.model.check_seq_length"}
    if not sets:
        ran |= {"app.ds_config.check", "app.model.compile_problems", "app.model.packed_documents_problems"}
    assert ran <= set(counts), sorted(counts)


# --- resources of a local cluster ---------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["gpus", "cpus"])
def test_local_cluster_that_cannot_hold_the_workers_is_refused(what, tmp_path, tiny_model, capsys, monkeypatch):
    """With no RAY_ADDRESS, `finetune train` starts Ray here: one GPU per worker more than this machine has, or more
    CPUs than it has, is refused before Ray starts (it used to wait 60 s and retry for ever); `validate`, which may
    check a config meant for a cluster, passes with a note saying what `train` here would refuse."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if what == "gpus":
        sets, field, fix = [f"scaling.num_workers={preflight.local_gpus() + 1}", "scaling.use_gpu=true"], "use_gpu", ""
        fix = "scaling.use_gpu=false"
    else:
        sets, field, fix = [f"scaling.num_workers={2 * preflight.local_cpus()}"], "num_workers", ""
        fix = f"scaling.num_workers <= {preflight.local_cpus()}"
    args = _args(tmp_path / "storage", tmp_path, tiny_model, sets + ["model.liger_kernels=false"])
    refused_in_one_line(args, f"scaling.{field}", fix, capsys, commands=("train",))
    assert not (tmp_path / "storage").exists()
    assert main(["validate", *args]) == 0
    assert f"note: `finetune train` on this machine (no RAY_ADDRESS) would refuse: scaling.{field}" in (
        capsys.readouterr().err
    )


RAY_START_TIMES_OUT_ONCE = """
import logging, os, time, types
import psutil, ray
from ray._private import node, services
from app import driver

logging.basicConfig(level=logging.INFO, format="%(message)s")
real_get_node, calls, jumped = services.get_node, [], []
def get_node(*args, **kwargs):  # the first attempt's node never registers: Ray's own loop gives up after its 30 s
    calls.append(1)
    if len(calls) == 1:
        jumped.append(31.0)
        raise RuntimeError("node not registered yet")
    return real_get_node(*args, **kwargs)
services.get_node = get_node
node.time = types.SimpleNamespace(**{**vars(time), "monotonic": lambda: time.monotonic() + sum(jumped)})
me = psutil.Process()
driver._init_local_ray(num_cpus=1, include_dashboard=False)
servers = [p for p in me.children(recursive=True) if p.name().startswith("gcs_server")]
print("attempts", 1 + (len(calls) > 1), "gcs servers", len(servers), "cpus", ray.cluster_resources()["CPU"])
ray.shutdown()
"""


def test_a_local_ray_that_does_not_register_in_time_is_stopped_and_started_again(tmp_path):
    """Ray gives a local node a fixed 30 s to register (ray/_private/node.py); on 2 busy cores ray.init failed so in
    CI. The driver stops what that attempt started and tries again: one warning, one cluster, no traceback."""
    r = subprocess.run(
        [sys.executable, "-c", RAY_START_TIMES_OUT_ONCE],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"},
        cwd=Path(__file__).parent.parent,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "attempts 2 gcs servers 1 cpus 1.0" in r.stdout, r.stdout + r.stderr[-3000:]
    warning = [line for line in r.stderr.splitlines() if "did not start within Ray's 30 s" in line]
    assert len(warning) == 1 and "starting it again (2 of 3)" in warning[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_a_local_cluster_asks_ray_for_no_drain_watcher_and_the_users_value_wins(monkeypatch):
    """Ray Train's PreemptionWatcher waits for node drains, which a cluster the app starts for one run never has:
    such a cluster is started with Ray's switch for it off; a user's value wins, and a joined cluster (RAY_ADDRESS)
    is left as it is. The switch's name is Ray's own, and its controller still reads it with env_bool. (That no
    watcher process then runs was checked by hand on a real local run, not here: it would cost a training run.)"""
    import ray
    from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR
    from ray.train.v2._internal.execution.controller import controller

    from app import driver
    from app.config import parse

    assert ENABLE_PREEMPTION_WATCHER_ENV_VAR in driver.LOCAL_RAY_ENV
    assert re.search(r"env_bool\(\s*ENABLE_PREEMPTION_WATCHER_ENV_VAR", inspect.getsource(controller))
    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: started.append("joined"))
    monkeypatch.setattr(driver, "_init_local_ray", lambda **kw: started.append("local"))
    monkeypatch.setattr(driver, "_create_autoscaling_coordinator", lambda: None)
    monkeypatch.setattr(driver.logs, "after_ray_init", lambda: None)
    monkeypatch.setattr(driver, "prestart_for", lambda cfg: None)  # it reaches Ray: the ray.init stub counted here
    cfg = parse({"scaling": {"num_workers": 1, "use_gpu": False}})
    for environ, expected in [({}, "0"), ({ENABLE_PREEMPTION_WATCHER_ENV_VAR: "1"}, "1"), ({"RAY_ADDRESS": "h"}, None)]:
        monkeypatch.setattr(os, "environ", dict(environ))  # start_ray writes the environment: a copy, restored
        driver.start_ray(cfg)
        assert os.environ.get(ENABLE_PREEMPTION_WATCHER_ENV_VAR) == expected, (environ, os.environ)
    assert started == ["local", "local", "joined"]


def test_a_joined_cluster_is_not_judged_by_this_machine(tmp_path, tiny_model, monkeypatch):
    """With RAY_ADDRESS set the workers run elsewhere: no local resource check (the placement wait is bounded)."""
    from app.config import parse

    cfg = parse({"scaling": {"num_workers": 4096, "use_gpu": True}})
    assert preflight.resource_problems(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert preflight.resource_problems(cfg) == []


def test_an_unreachable_hub_is_left_to_the_workers(monkeypatch):
    """Hub names are checked only when the hub answers: a closed port answers nothing, and nothing is refused."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    started = time.monotonic()
    assert preflight.hub_problems("openai-community/gpt2", "model.name_or_path", weights=True) == []
    assert time.monotonic() - started < 10


# --- the DeepSpeed rules are DeepSpeed's ----------------------------------------------------------------------


def test_deepspeed_rules_match_deepspeed(tiny_model):
    """The names the app accepts are DeepSpeed's own lists, and DeepSpeed's own code refuses what the app refuses:
    its config class accepts the resolved config, then the engine's optimizer and scheduler lookups (called on that
    config) fail for the refused types and succeed for the accepted ones; its ZeRO-3 partitioner's rule for NVMe
    asserts nvme_path."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS, DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partition_parameters

    from app import ds_config
    from app.config import parse

    assert tuple(DEEPSPEED_OPTIMIZERS) == preflight.DEEPSPEED_OPTIMIZERS
    assert tuple(lr_schedules.VALID_LR_SCHEDULES) == preflight.DEEPSPEED_SCHEDULERS
    assert '"nvme_path" in DeepSpeed Config cannot be None' in inspect.getsource(partition_parameters)

    class Engine:  # the two methods DeepSpeed's engine reads its optimizer and scheduler settings through
        def __init__(self, resolved: dict):
            self.config = DeepSpeedConfig(resolved)

        def optimizer_name(self):
            return self.config.optimizer_name

        def optimizer_params(self):
            return self.config.optimizer_params

        def scheduler_name(self):
            return self.config.scheduler_name

        def scheduler_params(self):
            return self.config.scheduler_params

    params = [torch.nn.Parameter(torch.zeros(2))]
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    def keys(model) -> tuple[str, ...]:
        return tuple(sorted({n for name, f in model.model_fields.items() for n in (name, f.alias) if n}))

    assert keys(DeepSpeedZeroConfig) == preflight.ZERO_KEYS
    assert keys(DeepSpeedZeroOffloadParamConfig) == preflight.OFFLOAD_KEYS["offload_param"]
    assert keys(DeepSpeedZeroOffloadOptimizerConfig) == preflight.OFFLOAD_KEYS["offload_optimizer"]
    for zero, refused in (
        ({"overlap_com": True}, True),
        ({"offload_optimizer": {"device": "cpu", "pin_memroy": True}}, True),
        ({"offload_param": {"device": "cpu", "ratio": 0.5}}, True),
        ({"offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.5}}, False),
        ({"stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 10**8}, False),
    ):
        cfg = parse({"scaling": {"num_workers": 1, "use_gpu": False}, "deepspeed": {"zero_optimization": zero}})
        assert bool(preflight.deepspeed_problems(cfg)) == refused, zero
        resolved = ds_config.build(cfg, hidden_size=64, layer_classes=[], layer_params=0)
        try:
            DeepSpeedConfig(resolved)
            deepspeed_refused = False
        except ValueError:  # pydantic's ValidationError: "Extra inputs are not permitted"
            deepspeed_refused = True
        assert deepspeed_refused == refused, zero

    for block, refused in (
        ({"optimizer": {"type": "AdamWW", "params": {"lr": 0.1}}}, True),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, False),
        ({"optimizer": {"type": "RMSprop", "params": {"lr": 0.1}}}, False),
        ({"scheduler": {"type": "Cosine", "params": {}}}, True),
        ({"scheduler": {"type": "StepLR", "params": {"step_size": 2}}}, False),
        ({"scheduler": {"type": "WarmupLR", "params": {}}}, False),
    ):
        cfg = parse({"scaling": {"num_workers": 1, "use_gpu": False}, "deepspeed": block})
        assert bool(preflight.deepspeed_problems(cfg)) == refused, block
        engine = Engine(ds_config.build(cfg, hidden_size=64, layer_classes=[], layer_params=0))
        try:
            if "optimizer" in block:
                DeepSpeedEngine._configure_basic_optimizer(engine, params)
            else:
                DeepSpeedEngine._scheduler_from_config(engine, torch.optim.SGD(params, lr=0.1))
            deepspeed_refused = False
        except (AttributeError, AssertionError):
            deepspeed_refused = True
        assert deepspeed_refused == refused, block


def test_a_worker_group_a_joined_cluster_cannot_place_ends_after_the_bounded_wait(tmp_path, tiny_model):
    """On a cluster the run joins (RAY_ADDRESS; here a 2-CPU cluster without GPUs that this test starts), 2 GPU
    workers can never be placed: the run ends after scaling.placement_timeout_s (5 s), once, with exit 1 and one
    line naming the request and what the cluster offers; Ray's own retry every 60 s without limit is off."""
    import ray
    from conftest import run_cli, tiny_overrides

    address = ray.init(num_cpus=2, include_dashboard=False).address_info["gcs_address"]
    try:
        started = time.monotonic()
        # gpu_memory: the auto settings are chosen for it, without asking this cluster (which has no GPU node).
        sets = {"scaling.use_gpu": True, "scaling.placement_timeout_s": 5, "model.liger_kernels": False}
        sets["scaling.gpu_memory"] = "80GiB"
        result = run_cli(
            "train",
            *tiny_overrides(tmp_path, "unplaceable", tiny_model, **sets),
            env={"RAY_ADDRESS": address},
            timeout=300,
        )
        elapsed = time.monotonic() - started
    finally:
        ray.shutdown()
    assert result.returncode == 1, result.stderr[-4000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-4000:]
    assert (
        "scaling: 2 workers x {CPU: 1, GPU: 1} could not be placed within scaling.placement_timeout_s=5 s" in (lines[0])
    ), lines[0]
    assert "the cluster offers {CPU: 2} in all" in lines[0] and "Fix: " in lines[0], lines[0]
    assert "max allowed: inf" not in result.stdout + result.stderr
    assert elapsed < 120, f"took {elapsed:.0f}s"


# --- failures after the cluster started -------------------------------------------------------------------


def test_failures_after_start_name_the_cause_and_the_fix():
    """The failures a run meets most, as Ray's WorkerGroupError carries them from a worker: out of memory (Ray's
    memory monitor or torch's allocator), a worker killed beyond scaling.max_failures, a gloo/NCCL timeout. Each
    becomes one line with the cause and the setting to change; anything else stays the worker's own line."""
    import ray.exceptions
    import torch
    from ray.train.v2.api.exceptions import WorkerGroupError

    from app import driver

    def line(failure, max_failures=0):
        return str(driver.worker_error(WorkerGroupError("...", {0: failure}), max_failures))

    ray_oom = ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory.")
    assert "Fix: a node ran out of host memory" in line(ray_oom) and "resources.limits.memory" in line(ray_oom)
    assert "model.gradient_checkpointing=true" in line(torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"))
    died = ray.exceptions.ActorDiedError()
    assert "a worker process died" in line(died) and "no restart is allowed (scaling.max_failures)" in line(died)
    assert "its 2 restart(s) are used up" in line(died, 2)
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error: Timed out after 1800s")
    assert "Fix: a collective (NCCL/gloo) timed out" in line(timeout)
    assert line(ValueError("bad row")) == "ValueError: bad row [rank 0]"
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    checked = line(WorkerHealthCheckFailedError("A worker health check failed.", died))  # how Ray reports a kill
    assert checked.startswith("ActorDiedError: ") and "Fix: a worker process died" in checked, checked
    # the rank that died is the cause, not the rank whose gloo connection it reset
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:14261: Connection reset by peer.")
    both = str(driver.worker_error(WorkerGroupError("...", {0: reset, 1: died})))
    assert both.startswith("ActorDiedError: ") and "[rank 1]. Fix: a worker process died" in both
    for text in (line(ray_oom), line(died), line(timeout)):
        assert "\n" not in text


def test_a_failed_controller_is_its_cause_in_one_line():
    """Ray Train's ControllerError (seen when Ray's memory monitor killed the workers the controller was
    starting on a pod at its memory limit): its own message is a bare "... controller error:" first line; the
    run's error line is the cause with its fix."""
    import ray.exceptions
    from ray.train import ControllerError

    from app import driver

    oom = ray.exceptions.OutOfMemoryError("2 worker(s) were killed due to the node running low on memory.")
    failed = ControllerError(oom)
    assert str(failed).splitlines()[0] == "Training failed due to controller error:"
    got = str(driver.controller_error(failed))
    assert got.startswith("Ray Train's controller failed: OutOfMemoryError: 2 worker(s) were killed"), got
    assert "Fix: a node ran out of host memory" in got and "\n" not in got
    assert driver.controller_error(RuntimeError("x")) is None


def test_a_bad_row_beyond_the_sample_is_named_by_file_and_line(tmp_path, caplog):
    """`datasets` says 'JSON parse error ... in row 1200' of a batch; the run says the file and its line, once
    (datasets' own log of the same error is not written)."""
    from app import data
    from app.config import DataConfig

    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(*[{"text": f"row {i}"} for i in range(1200)]) + b"\n{oops\n" + jsonl({"text": "x"}))
    cfg = DataConfig(dataset=str(path), split="train")
    assert data.check_source(cfg) == []  # the sample (the first 1,000 rows) is fine
    with pytest.raises(preflight.Problem) as caught:
        data.load_split(cfg, "train")
    assert str(caught.value).startswith("data.dataset: line 1202 is not JSON: ") and str(path) in str(caught.value)
    assert not [r for r in caplog.records if "Failed to load JSON" in r.getMessage()], caplog.text
    csv = tmp_path / "d.csv"
    csv.write_text("text,label\n" + "".join(f"r{i},1\n" for i in range(1200)) + "a,b,c,d\n")
    with pytest.raises(preflight.Problem, match="Expected 2 fields in line 1202"):
        data.load_split(DataConfig(dataset=str(csv), split="train"), "train")


def test_a_bad_row_found_by_the_workers_ends_the_run_with_its_line(tmp_path, tiny_model):
    """Real Ray and DeepSpeed, one CPU worker: line 1,501 of the data is broken, beyond what validate samples. The run
    ends as its data is prepared, before any training worker starts, with exit 2 and one line naming the file and
    the line, no parser traceback in the error; no half-written prepared dataset is left and the lease is released."""
    from conftest import run_cli, tiny_overrides

    path = tmp_path / "d.jsonl"
    path.write_bytes(_head(1500) + b"{oops\n")
    result = run_cli(
        "train",
        *tiny_overrides(tmp_path / "s", "badrow", tiny_model, **{"data.dataset": path, "scaling.num_workers": 1}),
    )
    assert result.returncode == 2, result.stderr[-4000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-4000:]
    assert "data.dataset: line 1501 is not JSON: " in lines[0] and str(path) in lines[0]
    assert "starting 1 training workers" not in result.stderr
    run_dir = tmp_path / "s" / "badrow"
    prepared = tmp_path / "s" / "prepared"
    assert not prepared.exists() or list(prepared.iterdir()) == []
    assert not (run_dir / ".lease").exists()


def _head(rows: int) -> bytes:
    return b"".join(CORPUS.read_bytes().splitlines(keepends=True)[:rows])


@pytest.mark.slow
def test_a_killed_worker_beyond_max_failures_ends_the_run_in_one_line(tmp_path, tiny_model):
    """Real Ray and DeepSpeed, 2 CPU workers, scaling.max_failures=0: rank 1 SIGKILLs itself after step 2. The run
    ends within a minute with exit 1 and one line naming the dead worker and the setting to change (not rank 0's
    gloo 'Connection reset by peer', nor Ray's health-check wrapper); the lease is released."""
    from conftest import run_cli, tiny_overrides

    sets = {"train.max_steps_per_epoch": 4, "scaling.max_failures": 0}
    result = run_cli(
        "train", *tiny_overrides(tmp_path, "killed", tiny_model, **sets), env={"FINETUNE_FAULT_KILL_AT_STEP": "2"}
    )
    ended = time.time()
    assert result.returncode == 1, result.stderr[-4000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "ActorDiedError: " in lines[0] and "[rank 1]. Fix: a worker process died" in lines[0]
    assert "no restart is allowed (scaling.max_failures)" in lines[0], lines[0]
    killed_at = (tmp_path / "killed" / ".fault-killed-step-2").stat().st_mtime
    assert ended - killed_at < 60, f"{ended - killed_at:.0f}s from the kill to the end"
    assert not (tmp_path / "killed" / ".lease").exists()


@pytest.mark.parametrize("spec", ["train", "validation", "train.v2", "test"])
def test_a_plain_split_name_is_judged_as_datasets_judges_it_without_importing_it(spec):
    # The driver checks the split before Ray starts; importing datasets for a plain name cost a second there.
    import subprocess
    import sys

    sizes = {"train": 7, "train.v2": 3, "test": 0}
    code = (
        "import sys; from app import preflight; "
        f"r = preflight._selected('data.split', {spec!r}, {sizes!r}); print(repr((r[0], [p.fix for p in r[1]])), "
        "'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False"
    rows, problems = preflight._selected("data.split", spec, sizes)
    # What datasets' own parser of split expressions makes of the same name.
    parsed, error = preflight._rows_of_expression(spec, sizes)
    assert rows == parsed and (error is None) == (spec in sizes)
    assert bool(problems) == (spec not in sizes or sizes[spec] == 0)
