"""Invalid training configs: exit 2, one line per problem naming field, value and fix, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CLI_ENV, REPO, run_cli

from app import ds_config
from app.cli import main
from app.config import load, parse


def snapshot(folder: Path) -> list[tuple[str, float]]:
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime) for p in folder.rglob("*"))


@pytest.fixture
def storage(tmp_path) -> Path:
    root = tmp_path / "storage"
    root.mkdir()
    (root / "someone-elses-file").write_text("keep me")
    return root


def base_args(storage: Path, model: Path) -> list[str]:
    return [
        "--set",
        f"experiment.storage_path={storage}",
        "--set",
        "experiment.name=exp1",
        "--set",
        f"model.name_or_path={model}",
        "--set",
        "scaling.use_gpu=false",
        "--set",
        "data.seq_length=64",
    ]


BAD = {
    "unknown key": (["train.learning_rat=1e-4"], "train.learning_rat: unknown key", "did you mean 'learning_rate'"),
    "unknown section": (["trian.epochs=2"], "trian: unknown key", "did you mean 'train'"),
    "bf16 and fp16": (
        ["deepspeed.bf16.enabled=true", "deepspeed.fp16.enabled=true"],
        "deepspeed.bf16.enabled",
        "both enabled",
    ),
    "zero stage": (["deepspeed.zero_optimization.stage=5"], "deepspeed.zero_optimization.stage", "0, 1, 2, 3 or auto"),
    "offload_param below stage 3": (
        ["deepspeed.zero_optimization.stage=2", "deepspeed.zero_optimization.offload_param={device: cpu}"],
        "deepspeed.zero_optimization.offload_param",
        "needs ZeRO stage 3",
    ),
    "top-level offload": (
        ["deepspeed.offload_optimizer={device: cpu}"],
        "deepspeed.offload_optimizer",
        "move it to deepspeed.zero_optimization.offload_optimizer",
    ),
    "train_batch_size": (["deepspeed.train_batch_size=7"], "deepspeed.train_batch_size", "= 2"),
    "seq_length above context": (["data.seq_length=1024"], "data.seq_length", "context of 256"),
    "name not DNS-1035": (["experiment.name=My_Exp"], "experiment.name", "DNS-1035"),
    "name too long": (["experiment.name=" + "a" * 41], "experiment.name", "at most 40"),
    "name traversal": (["experiment.name=../../etc"], "experiment.name", "DNS-1035"),
    "wrong type": (["train.epochs=many"], "train.epochs", "whole number"),
    "literal": (["train.precision=fp8"], "train.precision", "one of the listed values"),
    "null switch": (["model.fp8=null"], "model.fp8", "use true or false"),
    "null count": (["train.epochs=null"], "train.epochs", "use a whole number"),
    "a switch for a count": (["train.epochs=yes"], "train.epochs", "is a switch (true/false), not a number"),
    "a switch for a rate": (["train.learning_rate=true"], "train.learning_rate", "is a switch (true/false)"),
    "storage under a file": (
        ["experiment.storage_path={storage}/someone-elses-file/sub"],
        "experiment.storage_path",
        "not a folder",
    ),
    "leaf_module not a mapping": (
        ["deepspeed.zero_optimization.leaf_module=GPT2Block"],
        "deepspeed.zero_optimization.leaf_module",
        "{classes: auto}",
    ),
    "compile with Liger on ZeRO-3": (
        ["model.compile=true", "model.liger_kernels=true"],
        "model.compile",
        "model.liger_kernels=false",
    ),
    "fp8 inside model.compile": (
        ["model.fp8=true", "model.compile=true", "model.liger_kernels=false"],
        "model.fp8",
        "set model.compile=false, or model.fp8=false",
    ),
    "storage not writable": (
        ["experiment.storage_path=/sys/finetune-storage"],
        "experiment.storage_path",
        "not writable",
    ),
    "fp8 on GPT-2's Conv1D": (["model.fp8=true"], "model.fp8", "set model.fp8=false"),  # the meta-device model
    "Liger required on CPUs": (["model.liger_kernels=true"], "model.liger_kernels", "auto (GPUs only) or false"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_invalid_config_exits_2_and_writes_nothing(case, storage, tiny_model, capsys):
    sets, field, fix = BAD[case]
    args = base_args(storage, tiny_model)
    for s in sets:
        args += ["--set", s.replace("{storage}", str(storage))]
    before = snapshot(storage)
    for command in ("validate", "train"):
        assert main([command, *args]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert lines, err
        assert any(field in line and fix in line for line in lines), err
        assert "Traceback" not in err
    assert snapshot(storage) == before


def test_ray_starts_only_for_a_valid_config_while_the_model_is_counted(storage, tiny_model):
    """`finetune train` starts Ray (check's `meanwhile`) once every check has passed, beside the meta-device count
    of the model, and gets the same DeepSpeed config as without the overlap; an invalid config never starts it."""
    from app import driver
    from app.config import ConfigError

    sets = [
        f"experiment.storage_path={storage}",
        "experiment.name=exp1",
        f"model.name_or_path={tiny_model}",
        "scaling.use_gpu=false",
        "data.seq_length=64",
    ]
    started = []
    ds_plain, _ = driver.check(load(None, sets))
    ds_overlap, _ = driver.check(load(None, sets), meanwhile=lambda: started.append("valid"))
    assert started == ["valid"] and ds_overlap == ds_plain
    assert ds_overlap["zero_optimization"]["leaf_module"] == {"classes": ["GPT2Block"]}  # counted in the thread
    with pytest.raises(ConfigError, match="context of 256"):
        driver.check(load(None, [*sets, "data.seq_length=1024"]), meanwhile=lambda: started.append("invalid"))
    assert started == ["valid"]


def test_console_script_exit_code_and_single_line(storage, tiny_model):
    result = run_cli("train", *base_args(storage, tiny_model), "--set", "deepspeed.zero_optimization.stage=7")
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        "error: deepspeed.zero_optimization.stage: ZeRO stage must be 0, 1, 2, 3 or auto (got 7)"
    )
    assert "Traceback" not in result.stderr
    assert snapshot(storage) == [("someone-elses-file", (storage / "someone-elses-file").stat().st_mtime)]


def test_the_console_script_runs_the_exit_handlers_and_a_closed_pipe_is_no_traceback(storage, tiny_model, tmp_path):
    """`finetune` skips the interpreter's teardown (app.cli.run), not the exit handlers: one registered by a
    library still runs, with the command's exit code; a profiler still writes its file. A reader that stops early
    (`| head`) ends it quietly."""
    marker = tmp_path / "handler-ran"
    script = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
        "from app.cli import run\n"
        "sys.argv = ['finetune', *sys.argv[1:]]\n"
        "run()\n"
    )
    args = ["validate", *base_args(storage, tiny_model)]
    env = {**os.environ, **CLI_ENV}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and marker.read_text() == "yes", done.stderr[-3000:]
    assert "# deepspeed config" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-c", script, *args, "--set", "train.epochs=0"], cwd=REPO, env=env, capture_output=True
    )
    assert bad.returncode == 2 and b"train.epochs" in bad.stderr
    # Under a profiler the normal exit stays: cProfile writes its file then.
    profile = tmp_path / "validate.prof"
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", "app.cli", *args], cwd=REPO, env=env
    )
    assert done.returncode == 0 and profile.stat().st_size > 0
    # The reader is gone before the first line (the command is still importing).
    with subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        proc.stdout.close()
        err = proc.stderr.read()
    assert proc.returncode in (0, 1) and b"Traceback" not in err and b"Exception ignored" not in err, err[-3000:]


def test_several_problems_reported_together(storage, tiny_model, capsys):
    """Problems of shape (the typed models, the deepspeed block's included) come together from parsing; the
    problems that need the model, the data or the volume come together from the checks after it."""
    args = base_args(storage, tiny_model) + [
        "--set",
        "deepspeed.zero_optimization.stage=9",
        "--set",
        "deepspeed.offload_param={}",
        "--set",
        "train.epochs=many",
    ]
    assert main(["validate", *args]) == 2
    err = capsys.readouterr().err
    assert "deepspeed.offload_param" in err and "zero_optimization.stage" in err and "train.epochs" in err
    args = base_args(storage, tiny_model) + [
        "--set",
        "deepspeed.train_batch_size=7",
        "--set",
        "deepspeed.fp16.enabled=true",
        "--set",
        "data.seq_length=4096",
    ]
    assert main(["validate", *args]) == 2
    err = capsys.readouterr().err
    assert "deepspeed.train_batch_size" in err and "deepspeed.fp16.enabled" in err and "data.seq_length" in err


def test_bad_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert main(["validate", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    assert main(["validate", str(listy)]) == 2
    assert "mapping" in capsys.readouterr().err


def test_defaults_reproduce_the_tutorial():
    """Every constant of the tutorial, but the settings chosen from the GPUs (app/autoset.py): without the GPUs'
    memory they stand in as the tutorial's (ZeRO-3, fp32 master weights, no checkpointing)."""
    from app import autoset

    cfg = parse({})
    assert cfg.model.name_or_path == "gpt2"
    assert (cfg.data.dataset, cfg.data.split, cfg.data.seq_length) == ("ag_news", "train[:1%]", 512)
    assert (cfg.train.micro_batch_size, cfg.train.epochs, cfg.train.learning_rate) == (1, 1, 1e-6)
    assert cfg.train.max_steps_per_epoch == 30 and cfg.train.max_steps is None
    assert (cfg.scaling.num_workers, cfg.scaling.use_gpu) == (2, True)
    assert cfg.experiment.storage_path == "/mnt/cluster_storage/"
    assert (cfg.zero_stage, cfg.train.pure_bf16, cfg.model.gradient_checkpointing) == ("auto", "auto", "auto")
    settled = autoset.settle(cfg)
    assert settled.standing_in == autoset.FIELDS[:3] and "scaling.gpu_memory is unset" in settled.note
    ds = ds_config.build(settled.config, hidden_size=768)
    assert ds_config.build(cfg, hidden_size=768) == ds  # unsettled, built as before auto: with the same stand-ins
    # The tutorial's DeepSpeed config, with its constants in place.
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["train_batch_size"] == 2
    assert ds["bf16"] == {"enabled": True} and ds["fp16"] == {"enabled": False}
    assert ds["grad_accum_dtype"] == "bf16" and ds["gradient_clipping"] == 1.0
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["overlap_comm"] and z["contiguous_gradients"]
    # Hidden-size-derived values, as the Hugging Face integration fills them.
    assert z["reduce_bucket_size"] == 768 * 768
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 768 * 768)
    assert z["stage3_param_persistence_threshold"] == 7680


def test_generated_name_is_a_valid_kubernetes_name_and_printed(storage, tiny_model, capsys):
    args = [
        "--set",
        f"experiment.storage_path={storage}",
        "--set",
        f"model.name_or_path={tiny_model}",
        "--set",
        "data.seq_length=128",
    ]
    assert main(["validate", *args]) == 0
    out = capsys.readouterr().out
    name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("name:"))
    assert name.startswith("deepspeed-sample-") and len(name) == len("deepspeed-sample-") + 8


def test_auto_values_follow_the_other_sections():
    cfg = parse(
        {
            "train": {
                "micro_batch_size": 4,
                "gradient_accumulation_steps": 3,
                "max_grad_norm": 0.5,
                "precision": "fp16",
            },
            "scaling": {"num_workers": 8},
            "deepspeed": {"zero_optimization": {"stage": 2}},
        }
    )
    ds = ds_config.build(cfg, hidden_size=2048)
    assert ds["train_batch_size"] == 96 and ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False and ds["grad_accum_dtype"] == "fp16"
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2048 * 2048
    assert "stage3_prefetch_bucket_size" not in ds["zero_optimization"]
    # Without the model, hidden-size values stay "auto" (filled at run start); everything else is filled.
    offline = ds_config.build(cfg, hidden_size=None)
    assert offline["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert offline["train_batch_size"] == 96


def test_set_override_parses_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 1\n")
    cfg = load(
        path,
        [
            "train.epochs=3",
            "deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memory: true}",
            "data.packing=false",
        ],
    )
    assert cfg.train.epochs == 3 and cfg.data.packing is False
    block = cfg.deepspeed.to_dict()
    assert block["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}  # passed through
    assert block["zero_optimization"]["overlap_comm"] is True  # merged over the tutorial's block
    assert cfg.deepspeed.optimizer_offloaded and cfg.zero_stage == "auto"  # app.autoset chooses it (2 or 3)


def test_validate_prints_resolved_config_and_ds_json(tiny_model, storage, capsys):
    assert main(["validate", *base_args(storage, tiny_model), "--ds-config-only"]) == 0
    ds = json.loads(capsys.readouterr().out)
    # Two and a quarter GPT-2 blocks prefetched, twice that per gradient reduction (over the hidden-size rule).
    block = 12 * 64 * 64 + 13 * 64  # attention and MLP weights and biases, two layer norms
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2 * int(2.25 * block) > 64 * 64
    # ZeRO-3 fetches each decoder layer whole: the layer class comes from the model (GPT-2's block here).
    assert ds["zero_optimization"]["leaf_module"] == {"classes": ["GPT2Block"]}


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["deepspeed.zero_optimization.stage=2"], None),  # a ZeRO-3 knob only
        (
            ["deepspeed.zero_optimization.leaf_module={classes: [GPT2MLP]}"],
            {"classes": ["GPT2MLP"]},
        ),  # the user's choice
        (
            ["deepspeed.zero_optimization.leaf_module={names: [transformer.h.0]}"],
            {"classes": ["GPT2Block"], "names": ["transformer.h.0"]},
        ),  # merged over the default "auto"
    ],
)
def test_leaf_module_auto_rule(sets, expected, tiny_model, storage, capsys):
    args = base_args(storage, tiny_model)
    for s in sets:
        args += ["--set", s]
    assert main(["validate", *args, "--ds-config-only"]) == 0
    ds = json.loads(capsys.readouterr().out)
    assert ds["zero_optimization"].get("leaf_module") == expected


def test_leaf_classes_from_the_model_shape():
    from transformers import LlamaConfig, MixtralConfig

    from app.model import model_facts, zero3_leaf_layers

    llama = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000
    )
    per_layer = 4 * 256 * 256 + 3 * 256 * 512 + 2 * 256  # attention, MLP, two norms
    assert zero3_leaf_layers(llama) == (["LlamaDecoderLayer"], per_layer)
    # A layer over DeepSpeed's 1e9-parameter leaf cap (Mixtral 8x7B's) is left to DeepSpeed's own hooks.
    assert zero3_leaf_layers(MixtralConfig()) == ([], 0)
    # The prefetch bucket holds about two whole layers, so the next ones are fetched while this one computes;
    # a gradient reduction, about four.
    cfg = parse({})
    ds = ds_config.build(cfg, **model_facts(cfg, llama))
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == int(2.25 * per_layer) > int(0.9 * 256 * 256)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 2 * int(2.25 * per_layer)
    assert ds["zero_optimization"]["leaf_module"] == {"classes": ["LlamaDecoderLayer"]}
    # Set by hand, the bucket is the user's.
    cfg = parse({"deepspeed": {"zero_optimization": {"stage3_prefetch_bucket_size": 1000}}})
    assert ds_config.build(cfg, **model_facts(cfg, llama))["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000


def test_a_folder_too_big_to_be_a_dataset_is_refused_without_walking_it_all(
    storage, tiny_model, tmp_path, monkeypatch, capsys
):
    """data.dataset=/ used to make validate walk the whole disk; the walk now stops at a bound."""
    from app.data import files as data_files

    big = tmp_path / "big"
    for i in range(12):
        (big / f"d{i}").mkdir(parents=True)
        (big / f"d{i}" / "part.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.setattr(data_files, "MAX_FOLDER_ENTRIES", 10)
    assert main(["validate", *base_args(storage, tiny_model), "--set", f"data.dataset={big}"]) == 2
    err = capsys.readouterr().err
    assert "data.dataset: the folder holds more than 10 files and folders" in err and "Traceback" not in err
    monkeypatch.setattr(data_files, "MAX_FOLDER_ENTRIES", 100)
    whole = ["--set", "data.split=train"]  # the default train[:1%] of 12 rows selects none (refused too)
    assert main(["validate", *base_args(storage, tiny_model), "--set", f"data.dataset={big}", *whole]) == 0


def fake_checkpoint(storage: Path, step: int, world_size: int, **state) -> Path:
    """A complete-looking checkpoint of experiment exp1 (its manifest matches its one file)."""
    folder = storage / "exp1" / "checkpoints" / f"step-{step:08d}"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "a.bin").write_bytes(b"x" * 10)
    (folder / "trainer_state.json").write_text(
        json.dumps({"global_step": step, "world_size": world_size, "files": {"ds/a.bin": 10}, **state})
    )
    return folder


def test_bad_stage_with_a_checkpoint_of_another_world_size_exits_2(storage, tiny_model, capsys):
    """Issue 14.6: the stage is checked by the typed block before any resume planning reads it."""
    fake_checkpoint(storage, 4, world_size=4)
    before = snapshot(storage)
    for command in ("validate", "train"):
        assert main([command, *base_args(storage, tiny_model), "--set", "deepspeed.zero_optimization.stage=three"]) == 2
        err = capsys.readouterr().err
        stage = "error: deepspeed.zero_optimization.stage: ZeRO stage must be 0, 1, 2, 3 or auto (got 'three')"
        assert stage in err, err
        assert "Traceback" not in err
    assert snapshot(storage) == before


def test_the_resume_plan_is_applied_before_the_checks(storage, tiny_model, capsys):
    """A checkpoint of 4 workers x 4 sequences (16 a step) resumed by 2 workers: the plan doubles the accumulation
    first, so an explicit train_batch_size of 16 is checked against the config the run will use."""
    import yaml

    fake_checkpoint(storage, 4, world_size=4, micro_batch_size=4, gradient_accumulation_steps=1)
    args = [
        *base_args(storage, tiny_model),
        "--set",
        "train.micro_batch_size=4",
        "--set",
        "deepspeed.train_batch_size=16",
    ]
    assert main(["validate", *args]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out.split("# deepspeed config")[0])
    assert resolved["train"]["gradient_accumulation_steps"] == 2
    fake_checkpoint(storage, 8, world_size=3, micro_batch_size=4, gradient_accumulation_steps=1)  # 12: 2 x 4 can't
    assert main(["validate", *args]) == 2
    assert "error: scaling.num_workers: the experiment's last checkpoint (step-00000008)" in capsys.readouterr().err


def test_a_problem_raised_in_a_worker_reaches_the_driver_whole():
    # Ray pickles a worker's exception to the driver; a Problem must arrive as itself (field, value, fix).
    import pickle

    from app.config import ConfigError, Problem

    problem = Problem("model.fp8", True, "no FP8 tensor cores", "set model.fp8=false")
    got = pickle.loads(pickle.dumps(problem))
    assert (got.field, got.value, got.fix) == ("model.fp8", True, "set model.fp8=false")
    assert str(got) == "model.fp8: no FP8 tensor cores (got True). Fix: set model.fp8=false"
    both = pickle.loads(pickle.dumps(ConfigError([problem, Problem("train.epochs", 0, "must be positive")])))
    assert [p.field for p in both.problems] == ["model.fp8", "train.epochs"] and str(both) == str(
        ConfigError(both.problems)
    )


def test_a_worker_problem_is_the_runs_error_line_and_says_deploying_unchanged_would_not_help():
    """Ray's WorkerGroupError, as `trainer.fit()` raises it: the failing rank's own exception comes first, a rank
    that only lost its peer (closed connection) does not; a Problem becomes a WorkerProblem, the CLI's cue to say
    "change the setting it names" rather than only "deploy again"."""
    from ray.train.v2.api.exceptions import WorkerGroupError

    from app import driver
    from app.config import Problem

    problem = Problem("model.fp8", True, "no FP8 tensor cores", "set model.fp8=false")
    lost_peer = RuntimeError("Connection closed by peer")
    got = driver.worker_error(WorkerGroupError("...", {0: lost_peer, 1: problem}))
    assert type(got) is driver.WorkerProblem
    assert str(got) == "model.fp8: no FP8 tensor cores (got True). Fix: set model.fp8=false [rank 1]"
    got = driver.worker_error(WorkerGroupError("...", {0: ValueError("bad row"), 1: lost_peer}))
    assert type(got) is RuntimeError and str(got) == "ValueError: bad row [rank 0]"
    assert driver.worker_error(RuntimeError("the controller died")) is None


def test_tiny_builds_quietly_and_refuses_bad_paths_in_one_line(tmp_path):
    """`finetune tiny` (make run's first step): two lines of output when it works; a corpus that is not JSON lines
    with "text", or a folder it cannot write, is one line naming the option, exit 2, no traceback."""
    (tmp_path / "rows.jsonl").write_text('{"title": "no text field"}\n')
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "m"
    result = run_cli("tiny", "--model-dir", str(out), "--corpus", str(tmp_path / "new" / "c.jsonl"))
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).strip().splitlines() == [
        f"tiny model: {out}",
        f"corpus: {tmp_path}/new/c.jsonl",
    ]
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    for args, option in (
        (["--model-dir", str(tmp_path / "x"), "--corpus", str(tmp_path / "rows.jsonl")], "--corpus"),
        (["--model-dir", str(tmp_path / "x"), "--corpus", str(tmp_path)], "--corpus"),
        (["--model-dir", str(tmp_path / "a-file" / "m"), "--corpus", str(tmp_path / "new" / "c.jsonl")], "--model-dir"),
    ):
        result = run_cli("tiny", *args)
        lines = (result.stdout + result.stderr).strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {option}: "), lines
        assert "Fix: " in lines[0]
