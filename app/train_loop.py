"""The per-worker training loop: the tutorial's `train_loop`, with the machinery in the modules it calls."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from app import checkpoint, data, faults, logs, opbuild
from app.config import TrainingConfig
from app.metrics import MetricsLogger, flops_per_token
from app.nonfinite import NonFiniteGuard
from app.model import build_optimizer, build_scheduler, hidden_size, load_model, load_tokenizer

log = logging.getLogger("finetune")


def train_loop(loop_config: dict[str, Any]) -> None:
    marks = {**loop_config.get("startup", {}), "worker": time.time()}  # wall-clock start-up marks, in order
    import deepspeed
    import ray.train
    from ray.train.torch import prepare_data_loader

    cfg = TrainingConfig.model_validate(loop_config["config"])
    ds_config = loop_config["ds_config"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir = cfg.experiment_dir
    t = cfg.train
    logs.setup_worker(rank)
    opbuild.prepare(not cfg.scaling.use_gpu, cfg.deepspeed.optimizer_offloaded, announce=rank == 0)
    seed_everything(t.seed + rank)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the process group Ray created
    marks["imports"] = time.time()

    # Data: tokenized once into the shared cache, then a loader that can start mid-epoch.
    tokenizer = load_tokenizer(cfg.model)
    faults.maybe_raise("data", rank)  # test-only: off unless FINETUNE_FAULT_RAISE
    train_set, eval_set = data.prepare(cfg.data, tokenizer, cfg.model.tokenizer or cfg.model.name_or_path,
                                       run_dir / "cache", t.seed, rank, barrier=dist.barrier)
    collate = data.collator(cfg.data, tokenizer)
    train_loader = data.make_loader(train_set, t.micro_batch_size, world, rank, cfg.data.shuffle, t.seed,
                                    cfg.data.loader_workers, collate)
    sampler = train_loader.sampler
    train_loader = prepare_data_loader(train_loader, add_dist_sampler=False)
    steps_per_epoch = data.batches_per_epoch(len(train_set), t.micro_batch_size, world) // t.gradient_accumulation_steps
    if t.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, t.max_steps_per_epoch)
    total_steps = steps_per_epoch * t.epochs if t.max_steps is None else min(t.max_steps, steps_per_epoch * t.epochs)
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_set)} sequences are too few for one step of {world} workers x "
                         f"{t.micro_batch_size} x {t.gradient_accumulation_steps}: use more data or smaller batches")

    # Model and DeepSpeed engine.
    marks["data"] = time.time()
    started = time.perf_counter()
    model = load_model(cfg.model, ds_config, separate_documents=collate is not None)
    marks["model"] = time.time()
    optimizer = None if "optimizer" in ds_config else build_optimizer(model, t, cfg.deepspeed.optimizer_offloaded)
    # A callable: DeepSpeed wraps the optimizer first, and the schedule must drive the wrapper's groups.
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           lr_scheduler=lambda opt: build_scheduler(opt, t, total_steps))
    if cfg.model.compile:
        engine.compile()  # compiles lazily, at the first forward pass
    device = engine.device
    log.info(f"model and DeepSpeed engine ready in {time.perf_counter() - started:.1f}s")
    marks["engine"] = time.time()

    # Resume: the last checkpoint Ray registered for this experiment name (or, when it is missing or broken,
    # the newest older complete one), at the exact batch.
    position = checkpoint.resume(engine, ray.train.get_checkpoint(), run_dir, rank, world)
    if position["global_step"] == 0:
        log.info(f"starting {cfg.experiment.name} from scratch: {total_steps} steps")
    step = position["global_step"]

    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    mc = model.config
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", 0)
    metrics = MetricsLogger(run_dir, total_steps, step, flops_per_token(n_params, layers, hidden_size(mc) or 0, cfg.data.seq_length),
                            world, position.get("resumed_from")) if rank == 0 else None
    if metrics:
        metrics.startup(marks)

    def save(epoch: int, step_in_epoch: int, extra: dict[str, Any]) -> None:
        state = {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": step, "world_size": world,
                 "micro_batch_size": t.micro_batch_size, "gradient_accumulation_steps": t.gradient_accumulation_steps,
                 "precision": t.precision, "experiment": cfg.experiment.name}
        path = checkpoint.checkpoint_dir(run_dir, step)
        checkpoint.save(engine, path, state, rank, dist.barrier, lambda p: (mc.save_pretrained(p), tokenizer.save_pretrained(p)))
        ray.train.report({**extra, **state, "checkpoint": str(path)}, checkpoint=ray.train.Checkpoint.from_directory(str(path)),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
        if metrics:
            metrics.checkpoint(path, step)

    engine.train()
    window_loss = torch.zeros((), device=device)
    window_tokens = torch.zeros((), device=device)
    window_steps, window_start = 0, time.perf_counter()
    loader_clock = data.LoaderClock()
    guard = NonFiniteGuard(t.nonfinite_steps_limit, t.precision, t.learning_rate)
    step_loss = torch.zeros((), device=device)
    last: dict[str, Any] = {}
    stop = step >= total_steps
    for epoch in range(position["epoch"], t.epochs):
        if stop:
            break
        step_in_epoch = position["step_in_epoch"] if epoch == position["epoch"] else 0
        sampler.set_position(epoch, step_in_epoch * t.gradient_accumulation_steps * t.micro_batch_size)
        micro = 0
        for batch in loader_clock.timed(train_loader):
            if step_in_epoch >= steps_per_epoch:
                break
            loss = faults.maybe_poison(engine(**batch).loss, step + 1)  # test-only: off unless set
            engine.backward(loss)
            engine.step()
            window_loss += loss.detach()
            step_loss += loss.detach()
            window_tokens += (batch["labels"][:, 1:] != -100).sum()
            micro += 1
            if micro % t.gradient_accumulation_steps:
                continue
            step += 1
            step_in_epoch += 1
            window_steps += 1
            guard.check(step, step_loss, engine.get_global_grad_norm())  # raises after too many non-finite steps
            step_loss.zero_()

            if step % t.log_every_steps == 0 or step == total_steps:
                stats = torch.stack([window_loss / (window_steps * t.gradient_accumulation_steps), window_tokens])
                dist.all_reduce(stats)
                elapsed = time.perf_counter() - window_start
                loss_avg, tokens = stats[0].item() / world, stats[1].item()
                last = {"loss": loss_avg}
                if metrics:
                    metrics.step(step, epoch, loss_avg, engine.get_lr()[0], _grad_norm(engine),
                                 tokens / elapsed / world, elapsed / window_steps, loader_clock.take() / window_steps)
                window_loss.zero_(), window_tokens.zero_()
                window_steps, window_start = 0, time.perf_counter()

            if t.eval_every_steps and step % t.eval_every_steps == 0 and eval_set is not None:
                last["eval_loss"] = evaluate(engine, eval_set, cfg, world, rank, metrics, step, collate)

            stop = step >= total_steps or (t.stop_after_steps is not None and step >= t.stop_after_steps)
            epoch_done = step_in_epoch >= steps_per_epoch
            every = cfg.checkpoint.every_steps
            if ((every and step % every == 0) or stop or epoch_done) and guard.healthy:
                if epoch_done:
                    save(epoch + 1, 0, last)
                else:
                    save(epoch, step_in_epoch, last)
            faults.maybe_kill(step, rank, world, run_dir)  # test-only: off unless FINETUNE_FAULT_KILL_AT_STEP
            faults.maybe_raise("step", rank, step)  # test-only: off unless FINETUNE_FAULT_RAISE
            if stop:
                break

    finished = step >= total_steps
    evaluated_last = t.eval_every_steps and step % t.eval_every_steps == 0
    if finished and eval_set is not None and not evaluated_last:
        evaluate(engine, eval_set, cfg, world, rank, metrics, step, collate)
    if metrics:
        metrics.close()
    if finished and rank == 0 and cfg.checkpoint.export_final:
        final = checkpoint.export(checkpoint.checkpoint_dir(run_dir, step), run_dir / "final", t.precision)
        log.info(f"exported Hugging Face model to {final}")
    elif not finished and rank == 0:
        log.info(f"stopped at step {step} of {total_steps}; deploy again as {cfg.experiment.name} to resume")


def evaluate(engine, eval_set, cfg: TrainingConfig, world: int, rank: int, metrics, step: int, collate=None) -> float:
    """Token-weighted mean loss over the eval split, on all ranks."""
    loader = data.make_loader(eval_set, cfg.train.micro_batch_size, world, rank, False, 0, 0, collate)
    engine.eval()
    totals = torch.zeros(2, device=engine.device)
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if cfg.train.eval_max_batches and i >= cfg.train.eval_max_batches:
                break
            batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            n = (batch["labels"][:, 1:] != -100).sum()
            totals += torch.stack([engine(**batch).loss.float() * n, n.float()])
    engine.train()
    dist.all_reduce(totals)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    if metrics:
        metrics.eval(step, loss)
    return loss


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
