"""The side-by-side baseline: Hugging Face `Trainer` with the same DeepSpeed config, model, data and batch.

Run under torchrun (one process per GPU), from a training config YAML of this app:
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.hf_trainer --config C.yaml

What is shared with `finetune train`, so that only the training engine differs: the DeepSpeed config
(`app.ds_config.build`, every "auto" filled the same way), the model (`app.model.load_model`: same shape, same
init, same attention kernel and options), the data (`app.data.pipeline`: the same prepared, packed blocks),
the micro-batch, accumulation, world size, learning rate, clipping and a fused torch AdamW. Step times are
taken at each `on_step_end` after `torch.cuda.synchronize()`. Trainer's own logging runs every step, as the
app's does (both read the loss on the host each step).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def trainer_args(cfg, total: int, ds: dict | None) -> dict:
    """TrainingArguments of the app config's batch, optimizer, precision and loader, for `total` steps; one step
    logged each (as the app's loop reads the loss each step), nothing saved. Shared with benchmarks.trl_sft."""
    import torch

    t = cfg.train
    return dict(
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        max_steps=total,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1],
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm,
        lr_scheduler_type="constant",
        warmup_steps=0,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        deepspeed=ds,
        optim="adamw_torch_fused",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=t.seed,
        dataloader_num_workers=cfg.data.loader_workers,
        dataloader_pin_memory=True,
        dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(),
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from app import config as config_mod
    from app import data, ds_config, metrics, profiling
    from app.data import pipeline, store
    from app.model import hidden_size, load_model, load_model_config, load_tokenizer, model_facts
    from benchmarks.runner import settled_config

    launch = float(os.environ.get("BENCH_LAUNCH_T", time.time()))
    # The process group first (as Trainer's own DeepSpeed setup would), so every rank sees the world size.
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    cfg = settled_config(config_mod.resolve(config_mod.load(args.config))).config  # auto chosen as the app would
    t = cfg.train
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    mc = load_model_config(cfg.model)
    ds = ds_config.build(cfg, world_size=world, **model_facts(cfg, mc))
    total = args.warmup + args.steps
    out_dir = Path(tempfile.mkdtemp(prefix="hf-trainer-"))
    targs = TrainingArguments(
        output_dir=str(out_dir), **trainer_args(cfg, total, ds), remove_unused_columns=False
    )  # also makes the live HfDeepSpeedConfig that builds a ZeRO-3 model partitioned
    tokenizer = load_tokenizer(cfg.model)
    # The app's prepared dataset of this config (app.data.pipeline: made here by rank 0 when missing, as the app's
    # driver makes it before its workers start), read as the app's workers read it.
    if rank == 0:
        pipeline.ensure(cfg)
    dist.barrier()
    train_set, _ = store.open_splits(pipeline.folder_of(cfg))
    # The app's batches: packed documents kept apart (position ids, varlen attention) when the config says so.
    collate = data.collator(cfg.data, tokenizer)
    model = load_model(cfg.model, ds, separate_documents=collate is not None)  # checkpointing, Liger as configured
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", 0)
    fpt = metrics.flops_per_token(n_params, layers, hidden_size(mc), cfg.data.seq_length)

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(round(float(logs["loss"]), 4))

    clock = Clock()
    profiler = profiler_callback()(profiling.profiled_step() if rank == 0 else None)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train_set,
        callbacks=[profiler, clock],
        **({"data_collator": collate} if collate else {}),
    )
    trainer.train()
    if rank != 0:
        return
    times = [clock.ends[n - 1] - clock.ends[n - 2] for n in timed_steps(clock.ends, args.warmup, profiler.at)]
    per_step = t.micro_batch_size * t.gradient_accumulation_steps * (cfg.data.seq_length - 1)  # as the app counts
    step_s = sum(times) / len(times)
    tps = per_step / step_s
    peak = metrics.peak_flops()
    result = {
        **timing(clock, times, launch),
        "tokens_per_s_per_gpu": round(tps, 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    }
    if peak:
        result["mfu"] = round(tps * fpt / peak, 4)
    if profiler.summary:
        result["profile"] = {"step": profiler.at, **profiler.summary}
    Path(args.out).write_text(json.dumps(result))


def profiler_callback():
    """A TrainerCallback that profiles optimizer step `at` (app/profiling.py; FINETUNE_PROFILE_STEP), as the app's
    loop does: from the step's beginning to its end."""
    import contextlib

    from transformers import TrainerCallback

    from app import profiling

    class Profiler(TrainerCallback):
        def __init__(self, at: int | None):
            self.at, self.summary, self.stack = at, {}, contextlib.ExitStack()

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == self.at:
                self.summary = self.stack.enter_context(profiling.profile(True))

        def on_step_end(self, args, state, control, **kwargs):
            self.stack.close()

    return Profiler


def timed_steps(ends: list[float], warmup: int, profiled: int | None) -> list[int]:
    """The steps (from 1) to time, step n ending at ends[n - 1]: not the first `warmup`, nor the profiled one."""
    return [n for n in range(2, len(ends) + 1) if n > warmup and n != profiled]


def timing(clock, times: list[float], launch: float) -> dict:
    """The step-time fields every peer runner records: `clock` has `ends` (one time per step) and `losses`."""
    return {
        "steps_logged": len(clock.ends),
        "steps_timed": len(times),
        "losses": clock.losses,
        "time_to_first_step_s": round(clock.ends[0] - launch, 2),
        "step_s": round(sum(times) / len(times), 4),
        "step_s_median": round(sorted(times)[len(times) // 2], 4),
        "step_s_min": round(min(times), 4),
        "step_s_max": round(max(times), 4),
    }


if __name__ == "__main__":
    main()
