"""The auto settings in the product (app/autoset.py over app/resolve.py): `finetune validate --gpus N --gpu-memory M`
on tiny and real-shaped models (Hugging Face configs written into model folders: no weights, no hub), what
`finetune train` does without the GPUs' memory, CPU workers' fixed values, what a redeploy over an experiment's
checkpoints keeps, and the chart's gpuMemory. Nothing here starts a cluster."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import CORPUS, REPO

from app import autoset, contract, driver, resolve
from app.cli import main, summary
from app.config import parse

CHAT = REPO / "examples" / "data" / "tiny-chat.jsonl"
GIB = resolve.GIB
# Llama-3-8B's and TinyLlama-1.1B's config.json fields (what app/resolve.py reads).
LLAMA_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
LLAMA_1B = {
    **LLAMA_8B,
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


def model_folder(root: Path, config: dict, tiny_model: Path) -> Path:
    """A model folder of `config`'s shape: its config.json, the tiny model's tokenizer and a weights file without
    tensors (validate reads no more than that the files are there and whole)."""
    folder = root / f"m-{config['hidden_size']}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, folder / name)
    (folder / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    return folder


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory, tiny_model) -> Path:
    return model_folder(tmp_path_factory.mktemp("shapes"), LLAMA_8B, tiny_model)


@pytest.fixture(scope="module")
def llama1b(tmp_path_factory, tiny_model) -> Path:
    return model_folder(tmp_path_factory.mktemp("shapes"), LLAMA_1B, tiny_model)


def chat_args(tmp_path: Path, model: Path, *sets: str, lora: bool = True) -> list[str]:
    """validate's arguments for chat SFT of `model` (LoRA r=16 on every projection, or full) at 2048 tokens."""
    values = [
        f"experiment.storage_path={tmp_path / 'storage'}",
        "experiment.name=auto",
        f"model.name_or_path={model}",
        "model.liger_kernels=true",
        f"data.dataset={CHAT}",
        "data.format=chat",
        "data.chat_template=zephyr",
        "data.seq_length=2048",
        "train.learning_rate=2e-4",
        "train.micro_batch_size=auto",
        *(["model.lora={r: 16}"] if lora else []),
        *sets,
    ]
    return [arg for value in values for arg in ("--set", value)]


def validate(capsys, *argv: str) -> tuple[int, dict, dict, list[str], str]:
    """(exit code, printed training config, DeepSpeed config, the lines of the auto settings, stderr)."""
    code = main(["validate", *argv])
    out, err = capsys.readouterr()
    if code:
        return code, {}, {}, [], err
    head, ds = out.split("# deepspeed config\n")
    lines = [line[2:] for line in head.splitlines() if line.startswith("# ") and "training config" not in line]
    return code, yaml.safe_load(head), json.loads(ds), lines, err


def chosen(lines: list[str], name: str) -> str:
    """The value of one choice line, e.g. 'ZeRO stage' -> '0 (auto)'."""
    line = next(line.strip() for line in lines if line.strip().startswith(f"{name}: "))
    return line.removeprefix(f"{name}: ").split(" - ")[0]


def expected(config: dict, gpus: int, memory_gib: float, **request) -> resolve.Resolved:
    base = {"seq_length": 2048, "micro_batch_size": "auto", "liger": True, "learning_rate": 2e-4}
    return resolve.resolve(config, gpus, int(memory_gib * GIB), resolve.Request(**{**base, **request}))


# --- finetune validate --gpus --gpu-memory -------------------------------------------------------------------


def test_lora_on_an_8b_on_one_80gib_gpu_takes_stage_0(capsys, tmp_path, llama8b):
    code, cfg, ds, lines, err = validate(capsys, *chat_args(tmp_path, llama8b), "--gpus", "1", "--gpu-memory", "80GiB")
    assert code == 0, err
    assert lines[0] == "settings for 1 GPU(s) of 80.0 GiB (scaling.gpu_memory):"
    want = expected(LLAMA_8B, 1, 80, lora=resolve.Lora())
    assert chosen(lines, "ZeRO stage") == "0 (auto)" == f"{want.zero_stage.value} (auto)"
    assert chosen(lines, "precision") == "pure bf16 (auto)" and "bf16 master weights" in lines[2]
    assert chosen(lines, "micro-batch") == f"{want.micro_batch_size.value} (auto)"
    assert any(line.strip().startswith("memory per GPU: ") and "(fits)" in line for line in lines)
    # The printed configs are the ones the run uses: the choices in place, the hardware in scaling.
    assert (cfg["deepspeed"]["zero_optimization"]["stage"], cfg["train"]["pure_bf16"]) == (0, True)
    assert cfg["train"]["micro_batch_size"] == want.micro_batch_size.value == ds["train_micro_batch_size_per_gpu"]
    assert (cfg["scaling"]["num_workers"], cfg["scaling"]["gpu_memory"]) == (1, "80GiB")
    assert ds["zero_optimization"]["stage"] == 0 and ds["bf16"]["enabled"] is False  # stage 0's own bf16 AdamW


def test_full_8b_on_one_80gib_gpu_is_what_the_resolver_says_and_refused_with_fp32_master_weights(
    capsys, tmp_path, llama8b
):
    args = chat_args(tmp_path, llama8b, lora=False)
    code, cfg, _, lines, err = validate(capsys, *args, "--gpus", "1", "--gpu-memory", "80GiB")
    want = expected(LLAMA_8B, 1, 80)
    assert code == 0 and want.fits, err
    assert chosen(lines, "ZeRO stage") == "0 (auto)" and chosen(lines, "precision") == "pure bf16 (auto)"
    assert cfg["model"]["gradient_checkpointing"] is want.gradient_checkpointing.value is True
    # With fp32 master weights it cannot fit: refused in one line with the figures and the ways out.
    code, *_, err = validate(capsys, *args, "--set", "train.pure_bf16=false", "--gpus", "1", "--gpu-memory", "80GiB")
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: scaling.gpu_memory: the run needs ") and "(got '80GiB')" in errors[0]
    assert "optimizer states" in errors[0] and "offload_optimizer" in errors[0] and "GPUs of this memory" in errors[0]


def test_two_gpus_take_stage_2_for_full_fine_tuning_and_stage_0_for_lora(capsys, tmp_path, llama8b):
    full = chat_args(tmp_path, llama8b, lora=False)
    code, cfg, ds, lines, err = validate(capsys, *full, "--gpus", "2", "--gpu-memory", "80GiB")
    assert code == 0, err
    assert expected(LLAMA_8B, 2, 80).zero_stage.value == 2
    assert chosen(lines, "ZeRO stage") == "2 (auto)" and ds["zero_optimization"]["stage"] == 2
    assert ds["train_batch_size"] == 2 * cfg["train"]["micro_batch_size"]
    code, _, ds, lines, err = validate(capsys, *chat_args(tmp_path, llama8b), "--gpus", "2", "--gpu-memory", "80GiB")
    assert code == 0 and chosen(lines, "ZeRO stage") == "0 (auto)" and ds["zero_optimization"]["stage"] == 0, err


def test_explicit_values_win_and_are_only_checked(capsys, tmp_path, llama8b):
    sets = [
        "deepspeed.zero_optimization.stage=3",
        "train.pure_bf16=false",
        "model.gradient_checkpointing=true",
        "train.micro_batch_size=2",
    ]
    args = chat_args(tmp_path, llama8b, *sets)
    code, cfg, ds, lines, err = validate(capsys, *args, "--gpus", "1", "--gpu-memory", "80GiB")
    assert code == 0, err
    for name in ("ZeRO stage", "precision", "activation checkpointing", "micro-batch"):
        assert chosen(lines, name).endswith("(set)"), lines
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] == 2
    # An explicit micro-batch too large for the memory: refused with the figures, the fix naming auto.
    too_many = ["--set", "train.micro_batch_size=64"]
    code, *_, err = validate(capsys, *args, *too_many, "--gpus", "1", "--gpu-memory", "80GiB")
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and "micro-batch 64 x 2048" in line and "GiB a GPU" in line, err
    assert "train.micro_batch_size to auto" in line.split("Fix: ")[1], line


def test_a_tiny_model_on_gpus_and_the_flags_on_a_cpu_config(capsys, tmp_path, tiny_model):
    base = [f"experiment.storage_path={tmp_path}", f"model.name_or_path={tiny_model}", f"data.dataset={CORPUS}"]
    base += ["data.split=train", "data.seq_length=64"]
    args = [arg for value in base for arg in ("--set", value)]
    code, cfg, ds, lines, err = validate(capsys, *args, "--gpus", "4", "--gpu-memory", "24GiB")
    assert code == 0, err
    assert chosen(lines, "ZeRO stage") == "2 (auto)" and cfg["scaling"]["num_workers"] == 4
    assert chosen(lines, "precision") == "mixed bf16 (fp32 master weights) (auto)"  # the default rate, 1e-6
    code, *_, err = validate(capsys, *args, "--set", "scaling.use_gpu=false", "--gpus", "2")
    assert code == 2 and "error: --gpus: " in err and "CPU workers" in err, err


def test_without_the_gpus_memory_validate_notes_it_and_shows_auto(capsys, tmp_path, llama8b):
    code, cfg, ds, lines, err = validate(capsys, *chat_args(tmp_path, llama8b))
    assert code == 0 and lines == [], err
    assert "note: deepspeed.zero_optimization.stage, train.pure_bf16, model.gradient_checkpointing, " in err
    assert "--gpu-memory 80GiB chooses them" in err
    assert cfg["deepspeed"]["zero_optimization"]["stage"] == "auto" == cfg["train"]["micro_batch_size"]
    assert ds["zero_optimization"]["stage"] == "auto" == ds["train_micro_batch_size_per_gpu"]


def test_an_auto_micro_batch_beside_an_invalid_key_is_checked_as_the_least(capsys, tmp_path, tiny_model):
    """validate of a config with an invalid key still checks the rest (cli._more_problems), an auto micro-batch
    there as its stand-in, 1: one line for the invalid key, no traceback."""
    base = [f"experiment.storage_path={tmp_path}", f"model.name_or_path={tiny_model}", f"data.dataset={CORPUS}"]
    base += ["data.split=train", "data.seq_length=64", "scaling.use_gpu=false", "train.micro_batch_size=auto"]
    base += ["data.packing=false"]
    code, *_, err = validate(capsys, *[a for v in [*base, "train.epochs=0"] for a in ("--set", v)])
    assert code == 2 and [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: train.epochs: Input should be greater than or equal to 1 (got 0). Fix: see the field's description "
        "in docs/configuration.md"
    ], err


def test_validate_help_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    out = capsys.readouterr().out
    assert "--gpus N" in out and "--gpu-memory SIZE" in out and "80GiB" in out
    with pytest.raises(SystemExit) as exited:
        main(["validate", "--gpu-memory", "lots"])
    assert exited.value.code == 2 and "is not a memory size" in capsys.readouterr().err


# --- finetune train, CPU workers, the summary line ------------------------------------------------------------


def gpu_config(storage: Path, model: Path, **sets) -> dict:
    doc = {
        "experiment": {"name": "exp1", "storage_path": str(storage)},
        "model": {"name_or_path": str(model), "liger_kernels": True},
        "data": {"dataset": str(CHAT), "format": "chat", "chat_template": "zephyr", "seq_length": 2048},
        "train": {"learning_rate": 2e-4},
        "scaling": {"num_workers": 1},
    }
    for key, value in sets.items():
        section, leaf = key.split(".", 1)
        doc.setdefault(section, {})[leaf] = value
    return doc


def test_train_refuses_auto_when_no_memory_is_known_and_asks_the_cluster_first(tmp_path, llama1b):
    cfg = parse(gpu_config(tmp_path, llama1b))
    strict = autoset.Hardware(detect=lambda: None, strict=True)
    (problem,) = autoset.settle(cfg, hardware=strict).problems
    assert problem.field == "scaling.gpu_memory" and problem.value is None
    assert "set scaling.gpu_memory" in problem.fix and "workers.<group>.gpuMemory" in problem.fix
    told = autoset.settle(cfg, hardware=autoset.Hardware(detect=lambda: (143_771 * 2**20, "the H200"), strict=True))
    assert not told.problems and told.lines[0] == "settings for 1 GPU(s) of 140.4 GiB (the H200):"
    assert told.values == {
        "deepspeed.zero_optimization.stage": 0,
        "train.pure_bf16": True,
        "model.gradient_checkpointing": False,
    }
    assert told.config.train.micro_batch_size == 1  # the config's own (an int default): checked, not chosen
    # scaling.gpu_memory wins over the cluster, which is then not asked.
    own = parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "80GiB"}))
    unasked = autoset.Hardware(detect=lambda: 1 / 0, strict=True)
    assert autoset.settle(own, hardware=unasked).resolved.gpu_memory == 80 * GIB


def test_the_clusters_gpu_type_gives_the_memory():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 8.0}},
        {"Alive": True, "Resources": {"GPU": 8.0, "accelerator_type:H100": 1.0}},
        {"Alive": False, "Resources": {"GPU": 8.0, "accelerator_type:L4": 1.0}},
    ]
    assert driver.gpu_node_types(nodes) == ["H100"]
    assert autoset.memory_of_types(["H100", "H200"]) == (81_559 * 2**20, "the cluster's H100/H200 GPUs")
    assert autoset.memory_of_types(["H100", "?"]) is None and autoset.memory_of_types([]) is None


def test_train_reads_the_memory_of_its_own_gpus_or_of_the_joined_clusters(monkeypatch, tmp_path, llama1b):
    """No RAY_ADDRESS: the smallest GPU torch sees here (the local cluster's workers get them). RAY_ADDRESS: the
    GPU nodes' accelerator type, once the driver is connected (which starts nothing)."""
    from types import SimpleNamespace

    import ray
    import torch

    cfg = parse(gpu_config(tmp_path, llama1b, **{"scaling.placement_timeout_s": 1}))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sizes = [143_771 * 2**20, 81_559 * 2**20]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=sizes[i]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert driver.cluster_gpu_memory(cfg) == (81_559 * 2**20, "the NVIDIA H200 this machine's workers get")
    monkeypatch.setenv("RAY_ADDRESS", "ray://nowhere:10001")
    connected = []
    monkeypatch.setattr(driver, "start_ray", lambda c: connected.append(c))
    monkeypatch.setattr(
        ray, "nodes", lambda: [{"Alive": True, "Resources": {"GPU": 1.0, "accelerator_type:H200": 1.0}}]
    )
    assert driver.cluster_gpu_memory(cfg) == (143_771 * 2**20, "the cluster's H200 GPUs") and connected == [cfg]
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])  # no GPU node joins
    assert driver.cluster_gpu_memory(cfg) is None


def test_cpu_workers_take_fixed_values_without_the_memory_model(tmp_path, tiny_model):
    cfg = parse({"model": {"name_or_path": str(tiny_model)}, "scaling": {"use_gpu": False}})
    settled = autoset.settle(cfg)
    assert settled.values == {
        "deepspeed.zero_optimization.stage": 3,
        "train.pure_bf16": False,
        "model.gradient_checkpointing": False,
    }
    assert settled.model is None and settled.resolved is None  # no model config read, no memory model
    assert settled.lines == [
        "auto settings on CPU workers (scaling.use_gpu: false), fixed, without the GPU memory model: ZeRO stage 3, "
        "fp32 master weights, activation checkpointing off, tiled MLP, tiled loss and offloaded checkpoints off"
    ]


def test_the_summary_line_says_pure_bf16_and_its_numerics(tmp_path, llama1b):
    cfg = autoset.settle(parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "140GiB"}))).config
    ds = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    assert "ZeRO-0, pure bf16 (bf16 master weights), micro-batch 1" in summary(cfg, ds)


def test_preference_training_on_gpus_must_write_its_settings_out(tmp_path, llama1b):
    cfg = parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "140GiB"}) | {"preference": {}})
    (problem,) = autoset.settle(cfg).problems
    assert problem.field == "preference" and "train.micro_batch_size explicitly" in problem.fix


# --- a redeploy keeps what the checkpoints depend on --------------------------------------------------------


def checkpoint(storage: Path, contract_pure: bool | None = None, **state) -> None:
    """A complete-looking checkpoint of experiment exp1, and its contract.json."""
    folder = storage / "exp1" / "checkpoints" / "step-00000004"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "a.bin").write_bytes(b"x" * 10)
    state = {"global_step": 4, "world_size": 1, "files": {"ds/a.bin": 10}, **state}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    if contract_pure is not None:
        record = {"depends_on": {"train.pure_bf16": contract_pure}, "config": {}}
        (storage / "exp1" / contract.RECORD).write_text(json.dumps(record))


def test_a_resume_keeps_the_recorded_pure_bf16_rather_than_refusing(tmp_path, llama1b):
    """The rule: auto resolution on a resume takes the recorded choice of a contract dependency (train.pure_bf16),
    where it fits; --accept-changed train.pure_bf16 lets auto choose again."""
    checkpoint(tmp_path, contract_pure=False, micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=0)
    cfg = parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "140GiB"}))
    settled = autoset.settle(cfg)
    assert settled.values["train.pure_bf16"] is False and not settled.problems
    assert "precision: mixed bf16 (fp32 master weights) (auto) - kept: the experiment's checkpoints" in "".join(
        settled.lines
    )
    assert not [p for p in contract.plan(settled.config) if p.field == "train.pure_bf16"]
    again = autoset.settle(cfg, accepted=("train.pure_bf16",))
    assert again.values["train.pure_bf16"] is True


def test_validate_of_a_redeploy_on_other_gpus_keeps_the_contracts_pure_bf16(capsys, tmp_path, llama1b):
    """The same rule end to end: an experiment started with fp32 master weights (its contract.json, as the first run
    records it), redeployed with pure_bf16 auto on an H200, where auto alone would choose pure bf16: validate passes
    and says why; naming the field in --accept-changed lets auto choose, and the contract then names the change."""
    args = chat_args(tmp_path, llama1b, "experiment.name=exp1", "scaling.num_workers=1", "scaling.gpu_memory=140GiB")
    first = autoset.settle(main_config(args, "train.pure_bf16=false")).config
    checkpoint(tmp_path / "storage", micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=0)
    record = {"depends_on": contract.dependencies(first), "config": first.model_dump(mode="json")}
    (tmp_path / "storage" / "exp1" / contract.RECORD).write_text(json.dumps(record))
    code, cfg, _, lines, err = validate(capsys, *args)
    assert code == 0 and cfg["train"]["pure_bf16"] is False, err
    assert chosen(lines, "precision") == "mixed bf16 (fp32 master weights) (auto)" and "kept: " in "".join(lines)
    code, cfg, _, lines, err = validate(capsys, *args, "--accept-changed", "train.pure_bf16")
    assert code == 0 and cfg["train"]["pure_bf16"] is True, err
    assert "continuing exp1's checkpoints with changed train.pure_bf16 (--accept-changed)" in err


def main_config(args: list[str], *sets: str):
    """The config `finetune validate ARGS --set SETS` reads (its storage path made absolute, its name kept)."""
    from app import config as config_mod

    overrides = [a for a in args if a != "--set"] + list(sets)
    return config_mod.resolve(config_mod.load(None, overrides))


def test_a_resume_keeps_the_checkpoints_micro_batch_halving_it_to_fit(tmp_path, llama1b):
    checkpoint(tmp_path, micro_batch_size=32, gradient_accumulation_steps=1, zero_stage=0)
    cfg = parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "16GiB", "train.micro_batch_size": "auto"}))
    settled = autoset.settle(cfg)
    mb, accumulation = settled.config.train.micro_batch_size, settled.config.train.gradient_accumulation_steps
    assert mb * accumulation == 32 and mb < 32 and settled.resolved.fits, settled.lines
    assert "kept from step-00000004" in "".join(settled.lines) and "accumulation doubled" in "".join(settled.lines)


def test_a_resume_chooses_the_stage_afresh_even_to_or_from_stage_0(tmp_path, llama1b):
    """Every stage change converts the checkpoint, to or from stage 0 too (app.checkpoint.ResumePlan): a stage-0
    checkpoint's redeploy on 2 GPUs takes the stage that 2 GPUs get, and a stage-2 checkpoint's on one GPU stage 0,
    neither kept from the checkpoint."""
    checkpoint(tmp_path, micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=0)
    two = autoset.settle(
        parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "140GiB", "scaling.num_workers": 2}))
    )
    assert two.values["deepspeed.zero_optimization.stage"] != 0, two.lines
    shutil.rmtree(tmp_path / "exp1")
    checkpoint(tmp_path, micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=2)
    one = autoset.settle(parse(gpu_config(tmp_path, llama1b, **{"scaling.gpu_memory": "140GiB"})))
    assert one.values["deepspeed.zero_optimization.stage"] == 0 and one.values["train.pure_bf16"] is True
    assert "stage" not in "".join(line for line in one.lines + two.lines if "kept from" in line), one.lines


# --- the chart ------------------------------------------------------------------------------------------------


def test_the_chart_passes_the_groups_gpu_memory_and_refuses_two_sizes():
    from k8s_support import config_files, helm, render, template_args

    def scaling(objects) -> dict:
        return yaml.safe_load(config_files(objects)["training.yaml"]).get("scaling", {})

    assert scaling(render(sets=["workers.gpu.gpuMemory=80GiB"]))["gpu_memory"] == "80GiB"
    own = render(sets=["workers.gpu.gpuMemory=80GiB", "training.scaling.gpu_memory=40GiB"])
    assert scaling(own)["gpu_memory"] == "40GiB"  # the training config's own value wins
    assert "gpu_memory" not in scaling(render())
    two = ['workers.extra={"replicas": 1, "gpus": 2, "gpuMemory": "40GiB"}']
    out = helm(*template_args(sets=["workers.gpu.gpuMemory=80GiB"], set_json=two), check=False)
    assert out.returncode != 0 and "the GPU groups give different gpuMemory" in out.stderr, out.stderr
