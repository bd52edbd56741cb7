"""The chat SFT peer: TRL's `SFTTrainer` on the same model, LoRA settings, chat template, data and batch as a chat
training config of this app (`data.format: chat`, optionally `model.lora`).

Run under torchrun (one process per GPU), from a training config YAML of this app:
    python -m torch.distributed.run --standalone --nproc_per_node 1 -m benchmarks.trl_sft --config C.yaml [--deepspeed]

What is shared with `finetune train`: the model folder (TRL loads it itself, bf16, as its docs do), the attention
kernel (the app's variable-length FlashAttention, registered under the same name: TRL's padding-free batches carry
the `cu_seq_lens_q/k` it reads), the chat template (`data.chat_template`, the app's `{% generation %}` templates),
the jsonl of conversations, the loss on assistant turns only (`assistant_only_loss` unless `data.train_on_prompt`),
packing into `data.seq_length` blocks (TRL's best-fit-decreasing packing, padding-free), the LoRA r/alpha/dropout
and the target modules the app resolves (`app.lora.target_modules`), Liger's kernels (TRL's `use_liger_kernel`,
with its own chunked LM-head loss), micro-batch, accumulation, learning rate, clipping and a fused torch AdamW.
Without `--deepspeed` TRL runs plain PyTorch on one GPU (its fastest setting there); with it, the app's ds_config.
Step times are taken at each `on_step_end` after `torch.cuda.synchronize()`, or every `train.log_every_steps` steps
of the config (its window's mean; TRL's per-step NaN check of the loss then off, as the app reads nothing on the host
between its logged steps either); tokens/s counts the targets (labels other than -100 after the shift), as the
app's loop counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def lora_config(cfg):
    """peft.LoraConfig with the app's r, alpha, dropout and resolved target modules (from the meta-device model)."""
    from peft import LoraConfig

    from app import lora
    from app.model import load_model_config, meta_model

    model = meta_model(load_model_config(cfg.model), cfg.model.trust_remote_code)
    spec = cfg.model.lora
    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=lora.target_modules(model, spec.target_modules),
        task_type="CAUSAL_LM",
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--deepspeed", action="store_true", help="TRL with the app's DeepSpeed config")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from app import attention, ds_config, metrics, profiling
    from app import config as config_mod
    from app.data import chat
    from app.model import hidden_size, load_model_config, load_tokenizer, model_facts
    from benchmarks.hf_trainer import profiler_callback, trainer_args
    from benchmarks.runner import settled_config

    launch = float(os.environ.get("BENCH_LAUNCH_T", time.time()))
    # The app's choice of what the config leaves to auto: the same micro-batch and checkpointing on both sides.
    cfg = settled_config(config_mod.resolve(config_mod.load(args.config))).config
    d = cfg.data
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    mc = load_model_config(cfg.model)
    ds = None
    if args.deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl")
        ds = ds_config.build(cfg, world_size=world, **model_facts(cfg, mc))
    attn = attention.register() if torch.cuda.is_available() and attention.available() else "sdpa"
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.chat_template = chat.template_of(d, tokenizer)
    train_set = datasets.load_dataset("json", data_files=d.dataset, split="train").select_columns(["messages"])
    # The config's train.log_every_steps: the step times are taken (and the loss logged) every that many steps, as
    # the app's loop reads them; --warmup and --steps count such windows. Beyond one, TRL's per-step check of the loss
    # for NaN (a host sync each step) is off too: both sides then run without a host sync between their logged steps.
    every = cfg.train.log_every_steps
    total = (args.warmup + args.steps) * every
    # Before SFTConfig: with a ZeRO-3 ds_config it makes a live HfDeepSpeedConfig, under which no meta model builds.
    peft = lora_config(cfg) if cfg.model.lora is not None else None
    sft = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-sft-"),
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": attn},
        max_length=d.seq_length,
        packing=d.packing,
        packing_strategy="bfd",
        assistant_only_loss=not d.train_on_prompt,
        use_liger_kernel=bool(cfg.model.liger_kernels),
        gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
        **{**trainer_args(cfg, total, ds), "logging_steps": every, "logging_nan_inf_filter": every == 1},
        dataset_num_proc=4,
    )

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.losses: list[float] = []
            self.targets: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.time())
            self.targets.append(int(counted.item()))
            counted.zero_()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(round(float(logs["loss"]), 4))

    counted = torch.zeros((), dtype=torch.long, device="cuda" if torch.cuda.is_available() else "cpu")

    class Counting(SFTTrainer):
        """SFTTrainer, counting each micro-batch's targets on the device (read once per step, after the sync)."""

        def training_step(self, model, inputs, *rest, **kw):
            counted.add_((inputs["labels"][..., 1:] != -100).sum())
            return super().training_step(model, inputs, *rest, **kw)

    clock = Clock()
    profiler = profiler_callback()(profiling.profiled_step() if rank == 0 else None)
    trainer = Counting(
        model=cfg.model.name_or_path,
        args=sft,
        train_dataset=train_set,
        processing_class=tokenizer,
        peft_config=peft,
        callbacks=[profiler, clock],
    )
    trainer.train()
    if rank != 0:
        return
    write_result(args, cfg, clock, launch, trainer.model, mc, attn, metrics, hidden_size, profiler, every)


def write_result(args, cfg, clock, launch, model, mc, attn, metrics, hidden_size, profiler, every: int) -> None:
    import torch

    from benchmarks.hf_trainer import timed_steps, timing

    timed = timed_steps(clock.ends, args.warmup, profiler.at)
    times = [(clock.ends[n - 1] - clock.ends[n - 2]) / every for n in timed]  # a window's mean step time
    targets = [clock.targets[n - 1] for n in timed]
    tps = sum(targets) / sum(times) / every
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", 0)
    fpt = metrics.flops_per_token(n_params, layers, hidden_size(mc), cfg.data.seq_length)
    result = {
        **timing(clock, times, launch),
        "tokens_per_s_per_gpu": round(tps, 1),
        "target_tokens_per_step": round(sum(targets) / len(targets) / every, 1),
        "steps_per_window": every,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "peak_host_gib": round(metrics.peak_host_gib(), 2),
        "trainable_params": trainable,
        "params": n_params,
        "attn_implementation": attn,
        "weights_dtype": "bfloat16",
        "deepspeed": args.deepspeed,
    }
    if profiler.summary:
        result["profile"] = {"step": profiler.at, **profiler.summary}
    peak = metrics.peak_flops()
    if peak:
        result["mfu"] = round(tps * fpt / peak, 4)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
