"""The benchmark harness (benchmarks/): every GPU case is a config the app accepts, with the ds_config the
workers would get; the CPU smoke suite runs every runner end to end (slow)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import pytest
import yaml

from app.config import ConfigError
from app.data import chat
from benchmarks import assets, bench
from benchmarks.make_weights import weights_folder


def _stand_in_weights(root, shape_name):
    """What make_weights writes, with a safetensors file of no tensors: the config checks read its header only (the
    harness writes the real one before them; 16 GB for the 8B shape is too much for a unit test)."""
    shape = assets.SHAPES[shape_name]
    folder = weights_folder(root, shape)
    shutil.copytree(assets.model_folder(root, shape), folder, dirs_exist_ok=True)
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def _configs(tmp_path, cases, gpu_memory=None):
    for case in cases:
        case = dataclasses.replace(case, corpus_tokens=5_000)
        if case.weights:
            _stand_in_weights(tmp_path, case.shape)
        doc, shape = bench.case_config(case, tmp_path)
        path = tmp_path / "configs" / f"{case.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        try:
            yield case, bench._knobs(doc, shape, path, case.runner, gpu_memory)
        except ConfigError as exc:
            yield case, exc


def test_suites_are_few_and_each_case_name_means_one_config():
    """One suite per table of docs/benchmarks.md (and the CPU smoke suite); a case of the same name in two suites is
    the same case, so a figure can be traced to its config by name."""
    assert len(bench.SUITES) <= 10  # one a table of docs/benchmarks.md (issue #48); smoke is bench.PLUMBING's
    by_name = {}
    for suite, cases in {**bench.SUITES, **bench.PLUMBING}.items():
        assert cases and len({c.name for c in cases}) == len(cases), suite
        for case in cases:
            assert by_name.setdefault(case.name, case) == case, (suite, case.name)


def test_every_gpu_case_is_a_valid_config_with_the_defaults_ds_config(tmp_path):
    cases = {c.name: c for cases in bench.SUITES.values() for c in cases}
    seen = 0
    for case, knobs in _configs(tmp_path, cases.values()):
        seen += 1
        assert not isinstance(knobs, ConfigError), (case.name, knobs)
        zero = knobs["ds_config"]["zero_optimization"]
        assert knobs["workers"] == case.sets.get("scaling.num_workers", 2)
        if (
            knobs["stage"] == 3
            and "deepspeed.zero_optimization.leaf_module" not in case.sets
            and case.shape.startswith("llama")
        ):
            # The defaults: whole Llama layers, and a prefetch bucket of at least one of them.
            assert zero["leaf_module"]["classes"] == ["LlamaDecoderLayer"], (case.name, zero)
            assert zero["stage3_prefetch_bucket_size"] >= (44_044_288 if case.shape == "llama-1.1b" else 218_112_000)
    assert seen == len(cases)


def test_chat_cases_pair_the_app_with_trl_on_the_same_config(tmp_path):
    chat = [c for c in [*bench.SUITES["trl"], *bench.SUITES["trl-8b"]] if c.lengths == "chat"]
    knobs = {case.name: k for case, k in _configs(tmp_path, chat)}
    for name, k in knobs.items():
        assert k["workers"] == 1 and k["format"] == "chat" and k["liger"] is True and k["packing"], (name, k)
        assert (k["lora"] is not None) == ("lora" in name), name
        if "lora" in name:
            assert k["lora"]["r"] == 16 and k["lora"]["target_modules"] == "auto", name
        if name.startswith("trl"):
            kind = name[name.index("chat-") :].split("-")[:3]  # e.g. chat, l1b, lora
            app_twin = next(n for n in knobs if not n.startswith("trl") and n.split("-")[:3] == kind)
            same = ("micro_batch", "seq", "grad_accum", "lora", "liger", "act_ckpt")
            assert {key: k[key] for key in same} == {key: knobs[app_twin][key] for key in same}, (name, app_twin)
            assert "-m benchmarks.trl_sft" in k["command"] and "--deepspeed" not in k["command"], name
    assert sum(name.startswith("trl") for name in knobs) == 5


def test_dpo_cases_pair_the_app_with_trls_dpo_trainer_on_the_same_config(tmp_path):
    """Issue #51 item 6: DPO with LoRA r=16 and full-parameter of the 1.1B and 8B shapes on one GPU, the settings
    the app's auto cannot choose for preference runs set (stage 0, pure bf16, the micro-batch; checkpointing only for
    the 8B's full-parameter pair), each beside TRL's DPOTrainer on the same config file."""
    cases = [c for c in bench.SUITES["trl"] if c.lengths == "preference"]
    assert sorted((c.shape, c.runner, "-full" in c.name) for c in cases) == sorted(
        (shape, runner, full)
        for shape in ("llama-1.1b", "llama-8b")
        for full in (False, True)
        for runner in ("app", "trl-dpo")
    )
    knobs = {case.name: k for case, k in _configs(tmp_path, cases, gpu_memory=143_771 * 2**20)}
    for case in cases:
        k = knobs[case.name]
        assert not isinstance(k, ConfigError), (case.name, k)
        assert (k["format"], k["method"], k["workers"], k["seq"], k["packing"], k["liger"]) == (
            "preference",
            "dpo",
            1,
            2048,
            True,
            True,
        ), (case.name, k)
        checkpointed = case.shape == "llama-8b" and "-full" in case.name
        assert (k["stage"], k["pure_bf16"], k["act_ckpt"], k["defaults"]) == (0, True, checkpointed, False), case.name
        assert (k["lora"] is None) if "-full" in case.name else (k["lora"]["r"], k["lora"]["dropout"]) == (16, 0.0)
        if case.runner == "trl-dpo":
            app = knobs[case.name.removeprefix("trl-dpo-").join(["dpo-", "-z0-pure"])]
            same = ("micro_batch", "seq", "grad_accum", "lora", "liger", "act_ckpt", "ds_config")
            assert {key: k[key] for key in same} == {key: app[key] for key in same}, case.name
            assert "-m benchmarks.trl_dpo" in k["command"] and "--deepspeed" not in k["command"], case.name


def test_the_dpo_peer_takes_the_apps_reference_as_a_dpo_config(tmp_path):
    """TRL's reference as the app's `reference: auto`: the peft model with its adapters off for LoRA (no
    precomputation), the log-probabilities of the loaded model stored by a pass before training for full-parameter;
    DPOConfig accepts what the peer passes it."""
    from trl import DPOConfig

    from app import config
    from benchmarks import trl_dpo

    cases = [c for c in bench.SUITES["trl"] if c.runner == "trl-dpo" and c.shape == "llama-1.1b"]
    for case, _ in _configs(tmp_path, cases):
        cfg = config.load(tmp_path / "configs" / f"{case.name}.yaml")
        args, full = trl_dpo.dpo_args(cfg), "-full" in case.name
        assert args.get("precompute_ref_log_probs", False) == full, case.name
        assert DPOConfig(output_dir=str(tmp_path / "o"), bf16=False, **args).precompute_ref_log_probs == full


def test_preference_corpus_is_deterministic_and_one_pair_fills_more_than_half_a_block(tmp_path):
    """Each pair, as the app encodes it (its two sequences packed together), is more than half a block and fits it:
    a packed block holds one pair, so the app's micro-batch of blocks is one of pairs, as TRL's is; no sequence is
    cut on either side."""
    from transformers import AutoTokenizer

    from app.data import pairs

    shape = assets.SHAPES["llama-1.1b"]
    path = assets.preference_corpus(tmp_path / "a", shape.vocab, 60_000, 2048)
    assert path.read_text() == assets.preference_corpus(tmp_path / "b", shape.vocab, 60_000, 2048).read_text()
    tok = AutoTokenizer.from_pretrained(assets.tokenizer_folder(assets.model_folder(tmp_path, shape)))
    template = chat.TEMPLATES["zephyr"]
    for line in path.read_text().splitlines()[:60]:
        row = json.loads(line)
        assert pairs.row_problem(row) is None and row["prompt"][-1]["role"] == "user", row
        chosen, rejected = pairs.encode(row, lambda: template, tok)
        assert 1024 < len(chosen[0]) + len(rejected[0]) <= 2048, row
        assert pairs.fit(chosen, rejected, 2048, packed=True) == ((chosen, rejected), False)


def test_the_peer_table_compares_dpo_with_dpo_only():
    def row(case, runner, method, tps, **kw):
        base = {"case": case, "runner": runner, "shape": "llama-1.1b", "lora": {"r": 16}, "method": method}
        fmt = "preference" if method == "dpo" else "chat"
        return {**base, "format": fmt, "tokens_per_s_per_gpu": tps, "losses": [0.69, 0.68], **kw}

    dpo = {"pairs_per_s_per_gpu": 8.0, "step_s": 1.0, "steps_timed": 2}
    results = [
        row("sft-app", "app", "sft", 100.0),
        row("dpo-app", "app", "dpo", 60.0, metrics={"rewards/accuracies": [0.1, 0.5, 0.7]}, **dpo),
        row("trl-sft", "trl", "sft", 50.0),
        row(
            "trl-dpo",
            "trl-dpo",
            "dpo",
            40.0,
            pairs_per_s_per_gpu=4.0,
            step_s=2.0,
            metrics={"rewards/accuracies": [0.5]},
        ),
    ]
    lines = [
        line for line in bench.peer_table(results).splitlines() if line.startswith("| ") and "app case" not in line
    ]
    assert [line.split(" | ")[:4] for line in lines] == [
        ["| sft-app", "trl-sft", "sft", "2.00x"],
        ["| dpo-app", "trl-dpo", "dpo", "1.50x"],
    ]
    assert lines[1].split(" | ")[4] == "2.00x" and lines[1].endswith("| 0.600 / 0.500 |"), lines[1]


def test_the_defaults_suite_sets_nothing_the_app_chooses_and_records_what_it_chose(tmp_path):
    """Issue #50: the shipped defaults beside TRL on one H200 (143,771 MiB, as the app reads it there), full and LoRA
    chat SFT of the four shapes (Qwen3-1.7B: one no other suite tuned on, issue #60); each app case sets none of the
    settings the app chooses, its record says so and what the app chose; TRL's twin runs the same micro-batch and
    checkpointing; every other suite's cases keep the values they measured before auto existed."""
    from app.config import AUTO_FIELDS, BEFORE_AUTO

    cases = [c for c in bench.SUITES["defaults"] if c not in bench.STARTUP]  # the Start-up table's text cases
    wanted = {
        (shape, lora) for shape in ("llama-1.1b", "llama-8b", "qwen2-0.5b", "qwen3-1.7b") for lora in (False, True)
    }
    assert {(c.shape, "lora" in c.name) for c in cases if c.runner == "app"} == wanted
    knobs = {case.name: k for case, k in _configs(tmp_path, cases, gpu_memory=143_771 * 2**20)}
    for case in cases:
        k = knobs[case.name]
        assert not isinstance(k, ConfigError), (case.name, k)
        assert k["workers"] == 1 and k["format"] == "chat" and k["seq"] == 2048 and k["packing"], (case.name, k)
        if case.fallback_for:  # TRL again, with checkpointing, should the twin run out of memory
            assert k["act_ckpt"] is True and not k["defaults"] and case.runner == "trl", case.name
            continue
        assert k["defaults"] is True and set(k["resolved"]) == set(AUTO_FIELDS), (case.name, k["resolved"])
        assert k["stage"] == 0 == k["resolved"]["deepspeed.zero_optimization.stage"], case.name  # one GPU
        assert k["pure_bf16"] is True and k["micro_batch"] >= 1, case.name  # learning rates of 2e-5 and above
        if case.runner == "trl":
            app = knobs[case.name.removeprefix("trl-")]
            assert (k["micro_batch"], k["act_ckpt"]) == (app["micro_batch"], app["act_ckpt"]), case.name
            assert "-m benchmarks.trl_sft" in k["command"] and "--deepspeed" not in k["command"], case.name
    (other,) = [k for case, k in _configs(tmp_path, [bench.L1B_1GPU])]
    assert other["defaults"] is False and other["resolved"] == {} and other["pure_bf16"] is BEFORE_AUTO[AUTO_FIELDS[1]]


def test_chat_corpus_is_deterministic_and_every_row_trains(tmp_path):
    path = assets.chat_corpus(tmp_path / "a", 32000, 60_000)
    again = assets.chat_corpus(tmp_path / "b", 32000, 60_000)
    assert path.read_text() == again.read_text()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    words = [sum(len(m["content"].split()) for m in r["messages"]) for r in rows]
    assert all(chat.row_problem(r, "chat") is None and r["messages"][-1]["role"] == "assistant" for r in rows)
    assert max(words) <= assets.CHAT_MAX and min(words) < 100 < sorted(words)[len(words) // 2] < 1000 < max(words)
    assert any(len(r["messages"]) >= 6 for r in rows) and any(r["messages"][0]["role"] == "system" for r in rows)


def test_chat_rows_are_one_token_per_word_and_each_marker_its_own_token(tmp_path):
    """The model folder's tokenizer has the zephyr markers (as unknown tokens, i.e. the zero-embedding padding token,
    every conversation's first token gave the 1.1B chat cases non-finite gradients) and every corpus word."""
    from transformers import AutoTokenizer

    shape = assets.SHAPES["llama-1.1b"]
    tok = AutoTokenizer.from_pretrained(assets.model_folder(tmp_path, shape))
    assert len(tok) == shape.vocab
    rows = [json.loads(line) for line in assets.chat_corpus(tmp_path, shape.vocab, 20_000).read_text().splitlines()]
    template, cfg = chat.TEMPLATES["zephyr"], SimpleNamespace(chat_template="zephyr")
    for row in rows[:50]:
        assert chat.markers_problem(cfg, "row", row["messages"], template, tok) is None
        text, _ = chat.render_chat(row["messages"], template, tok)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        words = sum(len(m["content"].split()) for m in row["messages"])
        assert len(ids) == words + 2 * len(row["messages"]) and ids.count(tok.unk_token_id) == len(row["messages"])
    assert [tok.convert_ids_to_tokens(i) for i in range(shape.vocab - 4, shape.vocab)] == list(assets.MARKERS)


@pytest.mark.slow
def test_smoke_suite_runs_every_runner_on_cpu(tmp_path):
    """About 6 minutes on 2 cores: the tutorial, ZeRO-2, ZeRO-3 with checkpoint and resume, and HF Trainer."""
    out = tmp_path / "out"
    assert bench.main(["--suite", "smoke", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == [c.name for c in bench.PLUMBING["smoke"]]
    for r in rows:
        assert not r.get("error"), r["error"]
        assert r["steps_timed"] >= 3 and r["tokens_per_s_per_gpu"] > 0, r
        if r["runner"] == "app":  # the start-up, phase by phase, from launch to the first step
            phases = r["startup"]
            assert list(phases)[:2] == ["launch_to_driver", "ray_started"] and list(phases)[-2:] == [
                "engine",
                "first_step",
            ]
            assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= r["time_to_first_step_s"] + 0.5, r
    ckpt = next(r["checkpoint"] for r in rows if r.get("checkpoint"))
    assert ckpt["bytes"] > 0 and ckpt["resumed_at_step"] == 5 and ckpt["load_s"] >= 0, ckpt  # tiny: 0.0 s


def test_longest_finds_the_length_where_the_memory_model_stops_and_says_why(capsys):
    """benchmarks/longest.py (issue #60 item 4: the longest length the memory model allows on the GPU that came): on
    an 80 GiB GPU and a 125 GiB host, a step of 64k tokens, the 8B chat LoRA fits at 256k and no longer at the next
    step, refused for the host's memory (the offloaded checkpoints), in the app's own words; more host memory never
    makes the longest shorter."""
    from benchmarks import longest

    found = []
    for host in ("125GiB", "250GiB"):
        args = ["--gpu-memory", "80GiB", "--host-memory", host, "--step", "65536", "--high", "524288"]
        assert longest.main(args) == 0
        found.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    small, large = found
    assert small["longest"] % 65536 == 0 and small["next"] == small["longest"] + 65536
    assert small["longest"] >= 262144 and small["long_sequence"]["offload_checkpoints"] > 0, small
    assert "scaling.host_memory" in small["refused_next"], small
    assert large["longest"] >= small["longest"]


def test_driver_profile_sums_the_driver_or_the_stacks_through_a_function(tmp_path, capsys):
    from benchmarks import driver_profile

    stacks = tmp_path / "stacks.txt"
    driver = 'process 1:"python -m app.cli"'
    worker = f'{driver};process 2:"ray::worker"'
    stacks.write_text(
        f"{driver};_run_module_as_main (<frozen runpy>:198);<module> (app/cli.py:5);main (app/cli.py:9) 30\n"
        f"{worker};_bootstrap (threading.py:1);train_loop (app/train_loop.py:70);"
        "build_model (app/train_loop.py:180);from_pretrained (transformers/modeling_utils.py:5) 120\n"
        f"{worker};_bootstrap (threading.py:1);poll (ray/x.py:1) 50\n"
    )
    assert driver_profile.main([str(stacks)]) == 0
    out = capsys.readouterr().out
    assert "0.30s  cli.<module> > cli.main" in out and "train_loop" not in out
    assert driver_profile.main([str(stacks), "--through", "train_loop.train_loop"]) == 0
    out = capsys.readouterr().out
    assert "1.20s  train_loop.train_loop > train_loop.build_model > transformers:from_pretrained" in out
    assert "1.20s  stacks through train_loop.train_loop in all" in out and "cli" not in out
