"""What the TRL peers (benchmarks.trl_sft: SFTTrainer; benchmarks.trl_dpo: DPOTrainer) share: the app config's LoRA
as peft's LoraConfig, the clock callback that times each logged window after a device sync and reads the counters
the trainer adds to on the device, and the result record both write (the same fields as the app's records, so
bench.peer_table compares them).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def arguments() -> argparse.Namespace:
    """The peers' command line (bench's runner.run_hf passes --warmup, --steps and --out)."""
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--deepspeed", action="store_true", help="TRL with the app's DeepSpeed config")
    p.add_argument("--out", required=True)
    return p.parse_args()


def setup(args: argparse.Namespace) -> SimpleNamespace:
    """What a peer reads from the app's config before it builds its trainer: the config with its auto settings chosen
    as the app chooses them (the same micro-batch and checkpointing on both sides), the ds_config (--deepspeed), the
    attention kernel (the app's variable-length FlashAttention on GPUs, registered under its name), the tokenizer with
    the config's chat template, the LoRA config (before the TRL config: with a ZeRO-3 ds_config that makes a live
    HfDeepSpeedConfig, under which no meta model builds) and the steps: `every` (train.log_every_steps: step times
    taken and the loss logged every that many steps, as the app's loop reads them; --warmup and --steps count such
    windows) and `total`."""
    import torch

    from app import attention, ds_config
    from app import config as config_mod
    from app.data import chat
    from app.model import load_model_config, load_tokenizer, model_facts
    from benchmarks.runner import settled_config

    launch = float(os.environ.get("BENCH_LAUNCH_T", time.time()))
    cfg = settled_config(config_mod.resolve(config_mod.load(args.config))).config
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    ds = None
    if args.deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl")
        ds = ds_config.build(cfg, world_size=world, **model_facts(cfg, load_model_config(cfg.model)))
    attn = attention.register() if torch.cuda.is_available() and attention.available() else "sdpa"
    tokenizer = load_tokenizer(cfg.model)
    tokenizer.chat_template = chat.template_of(cfg.data, tokenizer)
    every = cfg.train.log_every_steps
    return SimpleNamespace(
        args=args,
        launch=launch,
        cfg=cfg,
        rank=rank,
        ds=ds,
        attn=attn,
        tokenizer=tokenizer,
        peft=lora_config(cfg) if cfg.model.lora is not None else None,
        every=every,
        total=(args.warmup + args.steps) * every,
    )


def config_args(run: SimpleNamespace, prefix: str) -> dict:
    """The TRL config's arguments both peers set alike: the model loaded in bf16 with the attention kernel,
    max_length (data.seq_length), Liger's kernels and checkpointing as configured, the app's batch, optimizer and
    precision (hf_trainer.trainer_args), logging every window (beyond one step a window, TRL's per-step NaN check of
    the loss, a host sync each step, is off too: both sides then run without a host sync between logged steps)."""
    from app.model import use_liger
    from benchmarks.hf_trainer import trainer_args

    cfg = run.cfg
    return dict(
        output_dir=tempfile.mkdtemp(prefix=prefix),
        model_init_kwargs={"dtype": "bfloat16", "attn_implementation": run.attn},
        max_length=cfg.data.seq_length,
        use_liger_kernel=use_liger(cfg.model),  # as the app decides it: auto is on a GPU with liger-kernel
        gradient_checkpointing=bool(cfg.model.gradient_checkpointing),
        **{
            **trainer_args(cfg, run.total, run.ds),
            "logging_steps": run.every,
            "logging_nan_inf_filter": run.every == 1,
        },
        dataset_num_proc=4,
    )


def train(run: SimpleNamespace, trainer_class, config, train_set, counted, logged: tuple[str, ...] = (), **fields):
    """`trainer_class` (a TRL trainer that adds its micro-batches' counts to `counted`) on the config's model with
    the clock and the profiler, then rank 0's record (write_result, given `fields`)."""
    from app import profiling
    from benchmarks.hf_trainer import profiler_callback

    timer = clock(run.every, counted, logged)
    profiler = profiler_callback()(profiling.profiled_step() if run.rank == 0 else None)
    trainer = trainer_class(
        model=run.cfg.model.name_or_path,
        args=config,
        train_dataset=train_set,
        processing_class=run.tokenizer,
        peft_config=run.peft,
        callbacks=[profiler, timer],
    )
    trainer.train()
    if run.rank == 0:
        write_result(run.args, run.cfg, timer, run.launch, trainer.model, run.attn, profiler, run.every, **fields)


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


def counters(n: int):
    """`n` counters on the device the trainer steps on (a trainer adds each micro-batch's counts to them without a
    host sync; the clock reads and clears them once a window, after its sync)."""
    import torch

    return torch.zeros(n, dtype=torch.long, device="cuda" if torch.cuda.is_available() else "cpu")


def clock(every: int, counted, logged: tuple[str, ...] = ()):
    """A TrainerCallback timing every `every`-th step (after torch.cuda.synchronize()), with `counted`'s values at
    that step (then zeroed): `ends`, `counts` (one list per window); the logged loss as `losses`, and each name of
    `logged` (e.g. DPO's rewards/accuracies) under `metrics`."""
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.counts: list[list[int]] = []
            self.losses: list[float] = []
            self.metrics: dict[str, list[float]] = {name: [] for name in logged}

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % every:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.time())
            self.counts.append(counted.tolist())
            counted.zero_()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(round(float(logs["loss"]), 4))
                for name in logged:
                    if name in logs:
                        self.metrics[name].append(round(float(logs[name]), 4))

    return Clock()


def write_result(
    args, cfg, clock, launch, model, attn, profiler, every: int, per_step: str = "target_tokens_per_step", **fields
) -> None:
    """The peer's record at args.out: timing over the timed windows (bench's fields), tokens/s from the clock's first
    counter (a step's mean under the name `per_step`); with a second counter, pairs (DPO) per step and per second;
    `fields` added as they are."""
    import torch

    from app import metrics
    from app.model import hidden_size, load_model_config
    from benchmarks.hf_trainer import timed_steps, timing

    timed = timed_steps(clock.ends, args.warmup, profiler.at)
    times = [(clock.ends[n - 1] - clock.ends[n - 2]) / every for n in timed]  # a window's mean step time
    counts = [clock.counts[n - 1] for n in timed]
    tokens = sum(c[0] for c in counts)
    tps = tokens / sum(times) / every
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    mc = load_model_config(cfg.model)
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", 0)
    fpt = metrics.flops_per_token(n_params, layers, hidden_size(mc), cfg.data.seq_length)
    result = {
        **timing(clock, times, launch),
        "tokens_per_s_per_gpu": round(tps, 1),
        per_step: round(tokens / len(counts) / every, 1),
        "steps_per_window": every,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "peak_host_gib": round(metrics.peak_host_gib(), 2),
        "trainable_params": trainable,
        "params": n_params,
        "attn_implementation": attn,
        "weights_dtype": "bfloat16",
        "deepspeed": getattr(args, "deepspeed", False),
        **fields,
    }
    if len(counts[0]) > 1:  # pairs: the window's steps' pairs, over its time
        pairs = sum(c[1] for c in counts)
        result |= {
            "pairs_per_step": round(pairs / len(counts) / every, 2),
            "pairs_per_s_per_gpu": round(pairs / sum(times) / every, 2),
        }
    if clock.metrics:
        result["metrics"] = clock.metrics
    if profiler.summary:
        result["profile"] = {"step": profiler.at, **profiler.summary}
    peak = metrics.peak_flops()
    if peak:
        result["mfu"] = round(tps * fpt / peak, 4)
    Path(args.out).write_text(json.dumps(result))
