"""Chat SFT with LoRA on real Ray Train and DeepSpeed (CPU): only the adapters train and are checkpointed, final/ is
the merged model and final/adapter/ the PEFT adapter, and `finetune export` of a LoRA checkpoint needs no GPU. One
ZeRO-3 run serves every assertion. A stopped run resuming at the exact batch is a slow test, at every stage (ZeRO-3
included): in make test, LoRA under ZeRO-3 resumes at the exact batch in tests/test_preference_train.py (the `lora`
experiment: the same adapter checkpoints, restored by the same train loop, after a SIGTERM instead of a stop)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, losses, run_cli, tiny_overrides

CHAT = {
    "data.dataset": str(REPO / "examples/data/tiny-chat.jsonl"),
    "data.seq_length": 128,
    "data.chat_template": "zephyr",
    "model.lora": "{r: 8, alpha: 16}",
    "train.max_steps_per_epoch": 8,
    "train.log_every_steps": 1,
    "model.dropout": 0.1,
}


def train(storage: Path, name: str, model: Path, **extra) -> str:
    result = run_cli("train", *tiny_overrides(storage, name, model, **{**CHAT, **extra}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def stop_and_resume(storage: Path, model: Path, **extra) -> tuple[str, str]:
    """The run stopped after step 3, then resumed by a new driver (exporting final/ at its end)."""
    stopped = train(storage, "resumed", model, **extra, **{"train.stop_after_steps": 3})
    resumed = train(storage, "resumed", model, **extra, **{"checkpoint.export_final": True})
    return stopped, resumed


def assert_resumed_exactly(storage: Path, resumed: str) -> None:
    assert "at global step 3 (epoch 0, step 3 of the epoch)" in resumed, resumed[-3000:]
    full, part = losses(storage / "full"), losses(storage / "resumed")
    assert sorted(part) == list(range(1, 9)) and full[8] < 0.95 * full[1], (full, part)
    worst = max(abs(full[s] - part[s]) for s in range(4, 9))
    assert worst <= 1e-5, {s: (full[s], part[s]) for s in range(4, 9)}


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, tiny_model):
    """One uninterrupted ZeRO-3 run of 8 steps, which exports final/."""
    storage = tmp_path_factory.mktemp("storage")
    return storage, train(storage, "full", tiny_model, **{"checkpoint.export_final": True})


def test_only_the_adapters_train_and_are_checkpointed(zero3, tiny_model):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    storage, full = zero3
    assert "LoRA r=8 on " in full and "of 165,632 parameters train" in full, full[-3000:]
    assert "data format: chat (data.format auto, from the columns)" in full
    assert "fan_in_fan_out" not in full  # PEFT's warning for each of GPT-2's transposed (Conv1D) layers
    assert "sample: 'Which section is this headline for?" in full  # asked in the chat template trained with
    seen = losses(storage / "full")
    assert sorted(seen) == list(range(1, 9)) and seen[8] < 0.95 * seen[1], seen
    last = sorted((storage / "full" / "checkpoints").iterdir())[-1]
    weights = get_fp32_state_dict_from_zero_checkpoint(str(last), tag="ds", exclude_frozen_parameters=True)
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), sorted(weights)[:5]
    # The adapters, their optimizer state and the rest: far less than the base model's own weights.
    saved = sum(f.stat().st_size for f in (last / "ds").iterdir())
    assert saved < (tiny_model / "model.safetensors").stat().st_size, saved


def test_final_is_merged_and_the_adapter_gives_the_same_logits(zero3, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from app.data import chat

    storage, _ = zero3
    final = storage / "full" / "final"
    ids = torch.arange(1, 33)[None]
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert merged.dtype == torch.bfloat16 and not any("lora" in k for k in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), final / "adapter").eval()
    with torch.no_grad():
        a, b, untrained = (m(ids).logits.float() for m in (merged.eval(), adapted, base.eval()))
    assert not torch.allclose(a, untrained, atol=5e-2)  # the adapters changed the model
    assert torch.allclose(a, b, atol=5e-2), (a - b).abs().max()  # bf16 merged against fp32 base + adapter
    # The base tokenizer has no chat template: final/ has the one the run trained with (data.chat_template).
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template == chat.TEMPLATES["zephyr"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt) == "<|user|>\nHi<|endoftext|>\n<|assistant|>\n"
    # `finetune export` of the LoRA checkpoint, with no GPU visible: the same folder as final/.
    last = sorted((storage / "full" / "checkpoints").iterdir())[-1]
    done = run_cli("export", str(last), str(tmp_path / "out"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits.float()
    assert torch.equal(exported, a) and (tmp_path / "out" / "adapter" / "adapter_model.safetensors").exists()
    # --model: the base weights from another copy of the base model.
    copy = tmp_path / "base-copy"
    shutil.copytree(tiny_model, copy)
    done = run_cli("export", str(last), str(tmp_path / "out2"), "--model", str(copy))
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "out2").eval()(ids).logits.float(), a)


@pytest.mark.slow  # one experiment of three runs a stage (zero3-offload also builds DeepSpeed's CPU Adam)
@pytest.mark.parametrize(
    "stage",
    [
        pytest.param({}, id="zero3"),
        pytest.param({"deepspeed.zero_optimization.stage": 2}, id="zero2"),
        pytest.param({"deepspeed.zero_optimization.stage": 0, "train.pure_bf16": True}, id="zero0-pure-bf16"),
        pytest.param(
            {
                "deepspeed.zero_optimization.offload_optimizer": "{device: cpu}",
                "deepspeed.zero_optimization.offload_param": "{device: cpu}",
            },
            id="zero3-offload",
        ),
    ],
)
def test_other_stages_resume_exactly(stage, tmp_path, tiny_model):
    full = train(tmp_path, "full", tiny_model, **stage)
    assert "parameters train" in full
    _, resumed = stop_and_resume(tmp_path, tiny_model, **stage)
    assert_resumed_exactly(tmp_path, resumed)
    assert (tmp_path / "resumed" / "final" / "adapter" / "adapter_config.json").exists()


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
EXPERTS = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}


def small_model(model_type: str, **settings):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=64, **{**SMALL, "num_key_value_heads": 2, "pad_token_id": 0, **settings}
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type, settings",
    [
        ("mixtral", EXPERTS),
        ("qwen3_moe", {**EXPERTS, "moe_intermediate_size": 32}),
        ("gpt_oss", EXPERTS),
        ("phimoe", EXPERTS),
        ("deepseek_v3", {**EXPERTS, "num_key_value_heads": 4, "q_lora_rank": None, "n_group": 1, "topk_group": 1}),
        ("phi", {}),
        ("starcoder2", {}),
        ("glm4", {}),
    ],
)
def test_auto_adapts_every_linear_layer_but_the_head_and_routers_where_no_family_is_complete(model_type, settings):
    # MoE models (experts fused into tensors: only attention and shared layers are linear), DeepSeek's latent
    # attention, Phi-2, StarCoder2 and GLM-4 name their projections otherwise; "auto" used to refuse them all.
    from app import lora

    model = small_model(model_type, **settings)
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = lora.target_modules(model, "auto")
    assert set(targets) == linear - {"lm_head"} - lora.ROUTERS and targets, (targets, linear)
    assert not any(set(family) <= linear for family in lora.PROJECTIONS)


def test_auto_keeps_a_complete_family_and_moe_adapters_train_alone():
    from app import lora
    from app.config import LoraConfig

    assert lora.target_modules(small_model("qwen2_moe", **EXPERTS), "auto") == list(lora.PROJECTIONS[0])
    model = lora.wrap(small_model("qwen3_moe", **EXPERTS, moe_intermediate_size=32), LoraConfig(r=4), "base")
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all(lora.ADAPTER_KEY in n for n in trained)
    assert not any("router" in n or n.endswith(".gate.weight") for n in trained)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained
