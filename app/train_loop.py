"""The per-worker training loop: the tutorial's `train_loop`, with the machinery in the modules it calls.

Read `train_loop` top to bottom: data (`Batches`, a loader that starts at any batch), model and engine, resume,
then epochs of `train_step` (one optimizer step, which owns gradient accumulation), progress (`Window`),
evaluation (`Evaluator`) and checkpoints (`CheckpointManager`: the save policy, `SavePolicy`, the one place that
decides when a checkpoint is written and when the run stops; the saves, in the background; their reports to Ray).
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import random
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from app import (
    attention,
    checkpoint,
    data,
    faults,
    logs,
    lora,
    opbuild,
    preemption,
    preference_train,
    prestart,
    profiling,
    sequence_parallel,
)
from app.config import TrainConfig, TrainingConfig
from app.data import chat
from app.ds_config import plain_bf16
from app.errors import Problem
from app.metrics import MetricsLogger, flops_per_token
from app.model import (
    DECAY_GROUPS_LAYOUT,
    build_optimizer,
    build_scheduler,
    calls_attention_functions,
    hidden_size,
    load_model,
    load_tokenizer,
    loss_options,
)
from app.nonfinite import NonFiniteGuard

log = logging.getLogger("finetune")


def train_loop(loop_config: dict[str, Any]) -> None:
    marks = {**loop_config.get("startup", {}), "worker": time.time()}  # wall-clock start-up marks, in order
    import ray.train

    cfg = TrainingConfig.model_validate(loop_config["config"])
    ds_config, lease_token = loop_config["ds_config"], loop_config.get("lease_token")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    run_dir, t = cfg.experiment_dir, cfg.train
    start_worker(cfg, rank)
    marks["imports"] = time.time()

    # Data, opened in a thread while the model loads: prepared before the workers started (app.data.pipeline), a
    # loader that can start at any batch. Then the DeepSpeed engine.
    with ThreadPoolExecutor(1, thread_name_prefix="data") as pool:
        opening = pool.submit(open_data, cfg, loop_config["data"], rank, world)
        model = build_model(cfg, ds_config, marks)
        tokenizer, batches = opening.result()
    marks["data"] = time.time()
    policy = SavePolicy.of(cfg, batches.sequences, batches.replicas)
    model, engine, shards = build_engine(cfg, ds_config, policy.total_steps, batches.packed, marks, model)
    options = loss_options(model, micro_batch_tokens(cfg))
    # Preference tuning: its reference in place (a pass stores it, before a resume loads any checkpoint).
    objective = preference_train.setup(cfg, engine, ds_config, batches.splits(), loop_config["data"], rank)

    # Resume: the last checkpoint Ray registered for this experiment name (or, when it is missing or broken,
    # the newest older complete one), at the exact batch.
    position = checkpoint.resume(engine, ray.train.get_checkpoint(), run_dir, rank, world)
    step = position["global_step"]
    if step == 0:
        log.info(f"starting {cfg.experiment.name} from scratch: {policy.total_steps} steps")
    metrics = start_metrics(model, cfg, policy.total_steps, position, world, marks) if rank == 0 else None
    window = Window(engine.device, objective)
    evaluator = Evaluator(engine, batches, cfg, batches.replicas, batches.replica, metrics, objective, shards)
    step_ended = faults.step_hook(rank, world, run_dir)  # test-only fault drills; does nothing otherwise
    preempt = preemption.RankWatch(run_dir, lease_token, world, cfg.scaling.use_gpu)
    checkpoints = CheckpointManager.of(
        engine, functools.partial(lora.save_files, model, tokenizer), preempt, policy, cfg, metrics
    )
    # All ranks raise together; a save of the last healthy step being written completes first.
    guard = NonFiniteGuard(t.nonfinite_steps_limit, t.precision, t.learning_rate, before_raise=checkpoints.drain)

    enter_training(engine)
    profiler = profiling.StepProfiler.of(rank, metrics)  # a diagnostic, off unless asked for
    last: dict[str, Any] = {}
    preempted = False
    for epoch in range(position["epoch"], t.epochs):
        if step >= policy.total_steps:
            break
        first = position["step_in_epoch"] if epoch == position["epoch"] else 0
        for step_in_epoch, micro_batches in batches.epoch(epoch, first, policy.steps_per_epoch, window.clock):
            loss, tokens = train_step(engine, micro_batches, step + 1, profiler, options, objective, shards)
            step += 1
            checkpoints.prepare()  # once, now that the optimizer's state exists: host buffers for background saves
            faults.maybe_sigterm(step, rank, world, run_dir)  # test-only: off unless FINETUNE_FAULT_SIGTERM_AT_STEP
            guard.check(step, loss, engine.get_global_grad_norm())  # raises after too many non-finite steps
            window.add(loss, tokens)
            if step % t.log_every_steps == 0 or step == policy.total_steps:
                last = {"loss": window.report(engine, step, epoch, t, world, metrics)}
            if evaluator.due(step) and (eval_loss := evaluator.run(step)) is not None:
                last["eval_loss"] = eval_loss
            # Asked to stop (a SIGTERM, the notice file) on any rank? Then every rank saves this step and stops.
            preempted = checkpoints.exchange(preempt) and step < policy.total_steps
            if checkpoints.due(step, step_in_epoch, preempted) and guard.healthy:  # never save weights NaN touched
                checkpoints.save(step, epoch, step_in_epoch, last, preempted)
            step_ended(step)
            if preempted or policy.stop(step):
                break
        if preempted or policy.stop(step):
            break  # the last step, train.stop_after_steps (a drill's preemption) or a preemption: no further epoch

    healthy = guard.finish()  # every rank reads the last step's flags (it may raise, on all ranks alike)
    checkpoints.drain()  # a save still in flight (its step's successors were not healthy) completes
    finished = step >= policy.total_steps
    if finished and batches.eval_set is not None and not evaluator.due(step):
        evaluator.run(step)
    if metrics:
        metrics.close()
    if rank == 0:
        conclude(cfg, step, policy.total_steps, preempted, healthy, checkpoints.saves)


def start_worker(cfg: TrainingConfig, rank: int) -> None:
    """This worker's logging, DeepSpeed's ops, the seeds, and DeepSpeed on the process group Ray created."""
    import deepspeed

    logs.setup_worker(rank)
    opbuild.prepare(not cfg.scaling.use_gpu, cfg.deepspeed.optimizer_offloaded, announce=rank == 0)
    seed_everything(cfg.train.seed + rank)
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the process group Ray created


def enter_training(engine) -> None:
    """The engine in training mode, and every Python object alive now (the libraries', the model's modules and
    parameters, the engine's: about 600k in a worker) moved out of reach of Python's cycle collector: otherwise its
    full collection, which comes every so often as the loop allocates, walks them all in the middle of a step (0.3-0.7
    s each on the 2-core CPU machine). Cycles made from here on are still collected."""
    engine.train()
    gc.collect()
    gc.freeze()


def micro_batch_tokens(cfg: TrainingConfig) -> int:
    """The tokens of a micro-batch on one worker (a shard of each sequence under sequence parallelism): what the loss's
    chunks and FP8's choice of layers are sized for."""
    return cfg.train.micro_batch_size * cfg.data.seq_length // cfg.scaling.sequence_parallel


def open_data(cfg: TrainingConfig, where: dict[str, str], rank: int, world: int) -> tuple[Any, Batches]:
    """(the tokenizer, the batches): no collective, nothing on the GPU, so a thread opens them while the model
    loads (the tokenizer's files and the dataset's are read meanwhile)."""
    tokenizer = load_tokenizer(cfg.model)
    chat.keep_template(tokenizer, cfg.data)
    return tokenizer, Batches.prepare(cfg, tokenizer, where, rank, world)


def build_model(cfg: TrainingConfig, ds_config: dict[str, Any], marks: dict):
    """The model this worker trains (partitioned under ZeRO-3), in bf16 where DeepSpeed does not cast it; `marks`
    gets the time it was ready."""
    model = load_model(
        preference_train.policy_model(cfg),
        ds_config,
        separate_documents=data.keeps_documents_apart(cfg.data),
        tokens=micro_batch_tokens(cfg),
    )
    if plain_bf16(cfg):
        model = model.to(torch.bfloat16)  # DeepSpeed's mixed precision is off: nothing else casts it
    marks["model"] = time.time()
    return model


def build_engine(
    cfg: TrainingConfig, ds_config: dict[str, Any], total_steps: int, packed: bool, marks: dict, model=None
):
    """(the model, the DeepSpeed engine over it, this worker's sequence shards or None), with the app's AdamW and
    schedule unless the block names its own; the model built here unless given; `marks` gets the time the engine
    was ready."""
    import deepspeed

    started = time.perf_counter()
    model = build_model(cfg, ds_config, marks) if model is None else model
    plain = plain_bf16(cfg)
    t = cfg.train
    offloaded = cfg.deepspeed.optimizer_offloaded
    optimizer = None if "optimizer" in ds_config else build_optimizer(model, t, offloaded, clips=plain)
    mpu, shards = sequence_parallel.setup(model, cfg, ds_config)  # the attention wrapped, the groups made (None: off)
    # A callable: DeepSpeed wraps the optimizer first, and the schedule must drive the wrapper's groups.
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=ds_config,
        lr_scheduler=lambda opt: build_scheduler(opt, t, total_steps),
        mpu=mpu,
    )
    if plain:  # stage 0: averaging one worker's gradients would only copy them twice (a group's shards: summed)
        engine.enable_backward_allreduce = engine.seq_dp_world_size > 1
    # Under sequence parallelism the probe's one short row cannot be cut into the run's shards; the attention it
    # would check is transformers' own over the whole batch's boundaries (app.sequence_parallel.problems).
    if packed and shards is None and model.config._attn_implementation != attention.VARLEN:
        refuse_leaking_attention(engine, model.config)
    if cfg.model.compile:
        engine.compile()  # compiles lazily, at the first forward pass
    # From the loop's imports: the model loaded (and the data opened meanwhile), then the engine.
    took = time.time() - marks["imports"] if "imports" in marks else time.perf_counter() - started
    log.info(f"model and DeepSpeed engine ready in {took:.1f}s")
    marks["engine"] = time.time()
    return model, engine, shards


# Of the logits' scale: a document kept apart moves by exactly 0, one that sees the one before by 4e-3 or more.
LEAK_TOLERANCE = 1e-4


def refuse_leaking_attention(engine, model_config) -> None:
    """Packed documents through attention other than the app's (a model that computes its own, or an
    attn_implementation chosen): the run stops here, on every rank alike, unless they stay apart."""
    engine.eval()
    try:
        moved = packed_documents_leak(engine, model_config.get_text_config().vocab_size, engine.device)
    finally:
        engine.train()
    if moved > LEAK_TOLERANCE:
        attn = model_config._attn_implementation
        own = not calls_attention_functions(model_config)
        raise Problem(
            "data.packing",
            True,
            f"{model_config.model_type}'s {'own ' if own else ''}{attn} attention lets a packed document see the one "
            f"before it (its logits moved by {moved:.1%} when that document changed)",
            "set data.packing=false (each example padded on its own)"
            + ("" if own else ", or model.attn_implementation=sdpa"),
        )


def packed_documents_leak(forward, vocab_size: int, device) -> float:
    """How far a packed document's logits move, relative to their largest, when the tokens of the document before
    it change: two documents of 8 tokens in one row, the first one's tokens drawn again. Exactly 0 in a model that
    keeps them apart, in any precision (masked positions add exact zeros, and every other layer works token by
    token); measured on CPUs: 0 for Llama, Gemma 2, StableLM and OPT through the app's attention, 0.4-100% for
    BioGPT, Bloom, MPT, XGLM and OpenAI GPT through transformers' attention, and for OPT through its eager one."""
    draw = torch.Generator().manual_seed(0)
    first = torch.randint(1, vocab_size, (1, 16), generator=draw)
    second = first.clone()
    second[0, :8] = torch.randint(1, vocab_size, (8,), generator=draw)
    starts = torch.zeros(1, 16, dtype=torch.bool)
    starts[0, [0, 8]] = True
    logits = []
    with torch.no_grad():
        for ids in (first, second):
            batch = data.packed_batch(ids, ids.clone(), 0, starts)
            fields = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items() if k != "labels"}
            logits.append(forward(**fields).logits[0, 8:].float())
    return float((logits[0] - logits[1]).abs().max() / logits[0].abs().max().clamp(min=1e-12))


def start_metrics(model, cfg: TrainingConfig, total_steps: int, position: dict[str, Any], world: int, marks: dict):
    """Rank 0's metrics logger, the start-up marks (and how its worker process began) written first."""
    flops = _flops_per_token(model, cfg)
    metrics = MetricsLogger(
        cfg.experiment_dir, total_steps, position["global_step"], flops, world, position.get("resumed_from")
    )
    metrics.startup(marks, prestart.this_process(marks.get("trainer", marks["worker"])))
    return metrics


def conclude(cfg: TrainingConfig, step: int, total_steps: int, preempted: bool, healthy: bool, saves: list[float]):
    """Rank 0, once the loop is over: the exported model of a finished run, or why it stopped and how to resume."""
    finished = step >= total_steps
    if finished and cfg.checkpoint.export_final:
        final = checkpoint.export(
            checkpoint.checkpoint_dir(cfg.experiment_dir, step), cfg.experiment_dir / "final", cfg.train.precision
        )
        log.info(f"exported Hugging Face model to {final}")
    elif preempted:
        written = (
            f"checkpoint written in {preemption.seconds(saves[-1])}" if healthy else "no checkpoint (non-finite step)"
        )
        log.warning(f"preempted at step {step}, {written}; deploy again as {cfg.experiment.name} to resume")
    elif not finished:
        log.info(f"stopped at step {step} of {total_steps}; deploy again as {cfg.experiment.name} to resume")


def optimizer_steps(batches: Iterable[dict[str, Any]], accumulation: int) -> Iterator[list[dict[str, Any]]]:
    """The loader's micro-batches, `accumulation` at a time: one list per optimizer step (a short tail is dropped)."""
    it = iter(batches)
    while len(group := list(itertools.islice(it, accumulation))) == accumulation:
        yield group


def train_step(
    engine,
    micro_batches: list[dict[str, Any]],
    step: int,
    profiler: profiling.StepProfiler = profiling.OFF,
    options: dict[str, Any] | None = None,
    objective: preference_train.Objective | None = None,
    shards: sequence_parallel.Shards | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step `step` over its micro-batches (DeepSpeed steps the optimizer after the last of them);
    `options`: more keyword arguments for the forward (app.model.loss_options); `objective`: preference tuning's
    loss instead of the model's own; `shards`: this worker's part of each sequence (sequence parallelism). Returns
    the summed micro-batch losses (each the whole sequence's, under sequence parallelism) and the number of tokens
    that counted in the loss on this worker (preference pairs: every token of their sequences, which the loss
    reads)."""
    options = options or {}
    losses = torch.zeros((), device=engine.device)
    tokens = torch.zeros((), device=engine.device)
    with profiler.step(step):
        for batch in micro_batches:
            shown = None  # the micro-batch's loss, where this worker's loss is a part of it
            if objective is not None:
                loss, _, read, _ = objective.loss(engine, batch)
            elif shards is not None:
                loss, read, shown = shards.loss(engine, batch, options)
            else:
                loss, read = engine(**batch, **options).loss, (batch["labels"][:, 1:] != -100).sum()
            loss = faults.maybe_poison(loss, step)  # test-only NaN drill: off unless set
            engine.backward(loss)
            engine.step()
            losses += loss.detach() if shown is None else shown
            tokens += read
    return losses, tokens


@dataclass(frozen=True)
class SavePolicy:
    """When to save and when to stop: every `every` steps, at each epoch's end, and at the last step (the run's,
    or `stop_after`'s, which stops the run as a preemption would)."""

    steps_per_epoch: int
    total_steps: int
    every: int | None
    stop_after: int | None

    @classmethod
    def of(cls, cfg: TrainingConfig, sequences: int, world: int) -> SavePolicy:
        t = cfg.train
        per_epoch = data.batches_per_epoch(sequences, t.micro_batch_size, world) // t.gradient_accumulation_steps
        if t.max_steps_per_epoch:
            per_epoch = min(per_epoch, t.max_steps_per_epoch)
        if per_epoch == 0:
            raise ValueError(
                f"{sequences} sequences are too few for one step of {world} workers x "
                f"{t.micro_batch_size} x {t.gradient_accumulation_steps}: use more data or smaller batches"
            )
        total = per_epoch * t.epochs if t.max_steps is None else min(t.max_steps, per_epoch * t.epochs)
        return cls(per_epoch, total, cfg.checkpoint.every_steps, t.stop_after_steps)

    def stop(self, step: int) -> bool:
        return step >= self.total_steps or (self.stop_after is not None and step >= self.stop_after)

    def due(self, step: int, step_in_epoch: int) -> bool:
        return bool(self.every and step % self.every == 0) or self.stop(step) or step_in_epoch >= self.steps_per_epoch

    def position(self, epoch: int, step_in_epoch: int) -> tuple[int, int]:
        """Where a resume from this step starts: the next epoch's start after an epoch's last step."""
        return (epoch + 1, 0) if step_in_epoch >= self.steps_per_epoch else (epoch, step_in_epoch)


@dataclass(frozen=True)
class Batches:
    """This rank's data: the training loader, which can start at any micro-batch of any epoch, the eval split
    (None without one) and the collate function (None: padded batches; else packed documents kept apart)."""

    loader: Any
    sampler: Any
    train_set: Any
    eval_set: Any
    collate: Any
    packed: bool  # documents packed into blocks and kept apart (the collator says where each begins)
    sequences: int
    micro_batch_size: int
    accumulation: int
    replicas: int  # data-parallel: the workers over scaling.sequence_parallel (a group's workers share its batches)
    replica: int  # this worker's group

    @classmethod
    def prepare(cls, cfg: TrainingConfig, tokenizer, where: dict[str, str], rank: int, world: int) -> Batches:
        """The prepared dataset the driver made or found (`where`: {"prepared": folder}, or {"cache": folder} for an
        experiment that started on its own tokenized cache), opened memory-mapped: no rank waits for another."""
        from ray.train.torch import prepare_data_loader

        from app.data.store import open_splits

        t = cfg.train
        faults.maybe_raise("data", rank)  # test-only: off unless FINETUNE_FAULT_RAISE
        # The workers of one sequence-parallel group read the same batches: the data is split over the groups
        # (consecutive ranks, as DeepSpeed's parallel state builds them), not over the workers.
        replicas, replica = world // cfg.scaling.sequence_parallel, rank // cfg.scaling.sequence_parallel
        if "cache" in where:
            train_set, eval_set = data.load_cache(Path(where["cache"]))
        else:
            train_set, eval_set = open_splits(Path(where["prepared"]))
        collate = data.collator(cfg.data, tokenizer)
        packed = collate is not None
        if cfg.preference is not None:  # pairs: their answers found in every batch, packed or not
            collate = data.PairCollator(tokenizer.eos_token_id, cfg.data.packing)
        loader = data.make_loader(
            train_set, t.micro_batch_size, replicas, replica, cfg.data.shuffle, t.seed, cfg.data.loader_workers, collate
        )
        sampler = loader.sampler
        loader = prepare_data_loader(loader, add_dist_sampler=False)
        return cls(
            loader,
            sampler,
            train_set,
            eval_set,
            collate,
            packed,
            len(train_set),
            t.micro_batch_size,
            t.gradient_accumulation_steps,
            replicas,
            replica,
        )

    def splits(self) -> dict[str, Any]:
        return {"train": self.train_set} | ({"eval": self.eval_set} if self.eval_set is not None else {})

    def epoch(
        self, epoch: int, first: int, steps_per_epoch: int, clock: data.LoaderClock
    ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(step in the epoch, its micro-batches) for the optimizer steps after the epoch's `first`, up to
        `steps_per_epoch`; the loader starts at the next step's first micro-batch, the same order as a run that
        never stopped."""
        self.sampler.set_position(epoch, first * self.accumulation * self.micro_batch_size)
        steps = optimizer_steps(clock.timed(self.loader), self.accumulation)
        return enumerate(itertools.islice(steps, steps_per_epoch - first), first + 1)


class CheckpointManager:
    """Every rank: when to save (`SavePolicy`), the save (`checkpoint.Saver`: in the background unless
    checkpoint.async_save is false) and the report to Ray of each checkpoint once it is complete on every rank."""

    @classmethod
    def of(cls, engine, hf_files, preempt: preemption.RankWatch, policy: SavePolicy, cfg: TrainingConfig, metrics):
        """Over this rank's saver (its engine, the Hugging Face files each checkpoint carries, the preemption
        watch's process group)."""
        rank, world, lease_token = dist.get_rank(), dist.get_world_size(), preempt.token
        saver = checkpoint.Saver(
            engine, rank, world, dist.barrier, hf_files, lease_token, cfg.checkpoint.async_save, preempt.group
        )
        return cls(saver, policy, cfg, rank, world, metrics)

    def __init__(
        self, saver: checkpoint.Saver, policy: SavePolicy, cfg: TrainingConfig, rank: int, world: int, metrics
    ):
        self.saver, self.policy, self.rank, self.metrics = saver, policy, rank, metrics
        self.run_dir = cfg.experiment_dir
        t = cfg.train
        self.run = {  # what each checkpoint's state records besides its position
            "world_size": world,
            "sequence_parallel": cfg.scaling.sequence_parallel,  # with world_size, the data-parallel replicas
            "micro_batch_size": t.micro_batch_size,
            "gradient_accumulation_steps": t.gradient_accumulation_steps,
            "precision": t.precision,
            "zero_stage": cfg.zero_stage,  # a resume at another stage converts (checkpoint.ResumePlan)
            "pure_bf16": t.pure_bf16 is True,  # bf16 master weights: a resume that changes it says so
            "decay_groups": DECAY_GROUPS_LAYOUT,  # the optimizer's groups; absent: a stage-3 resume may regroup
            "experiment": cfg.experiment.name,
        }
        self.saves: list[float] = []  # seconds each save of this attempt took, from its start until it was complete

    def prepare(self) -> None:
        self.saver.prepare()

    def exchange(self, preempt: preemption.RankWatch) -> bool:
        """A collective after every step: whether any rank was asked to stop; reports a background save that
        every rank has now written."""
        asked, writes = preempt.agreed(self.saver.status())
        self._report(self.saver.settle(writes))
        return asked

    def due(self, step: int, step_in_epoch: int, preempted: bool) -> bool:
        """Whether this step is saved: the policy says so, or the run is preempted."""
        return self.policy.due(step, step_in_epoch) or preempted

    def save(self, step: int, epoch: int, step_in_epoch: int, last: dict[str, Any], preempted: bool) -> None:
        """The last save and a preemption's wait until the checkpoint is complete; the others go on in the
        background."""
        wait = preempted or self.policy.stop(step)
        resume_epoch, resume_step = self.policy.position(epoch, step_in_epoch)
        state = {"epoch": resume_epoch, "step_in_epoch": resume_step, "global_step": step, **self.run}
        path = checkpoint.checkpoint_dir(self.run_dir, step)
        self._report(self.saver.save(path, state, {**last, "preempted": preempted}, wait=wait))

    def drain(self) -> None:
        """Waits for the save in flight, and reports it."""
        self._report(self.saver.drain())

    def _report(self, completed: list[checkpoint.Saved]) -> None:
        """Every rank: register checkpoints that have just become complete with Ray (it does once all ranks have)."""
        import ray.train

        for done in completed:
            self.saves.append(round(done.total_s, 2))
            if self.rank == 0 and len(self.saves) == 1 and (note := preemption.grace_note(self.saves[0])):
                (log.info if note[0] else log.warning)(note[1] if note[0] else f"WARNING: {note[1]}")
            ray.train.report(
                {
                    **done.extra,
                    **done.state,
                    "checkpoint": str(done.path),
                    "save_s": self.saves[-1],
                    "save_stall_s": round(done.stall_s, 2),
                },
                checkpoint=ray.train.Checkpoint.from_directory(str(done.path)),
                checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
            )
            if self.metrics:
                self.metrics.checkpoint(
                    done.path, done.state["global_step"], done.stall_s, done.total_s, done.background
                )


class Window:
    """Loss, tokens and time since the last progress line (kept on the device: one sync per line), and preference
    tuning's metrics (`objective`)."""

    def __init__(self, device, objective: preference_train.Objective | None = None):
        self.loss = torch.zeros((), device=device)
        self.tokens = torch.zeros((), device=device)
        self.steps, self.start = 0, time.perf_counter()
        self.clock = data.LoaderClock()
        self.objective = objective

    def add(self, loss: torch.Tensor, tokens: torch.Tensor) -> None:
        self.loss += loss
        self.tokens += tokens
        self.steps += 1

    def report(self, engine, step: int, epoch: int, t: TrainConfig, world: int, metrics) -> float:
        """The window's mean loss over every rank (logged on rank 0, with the objective's metrics, each averaged over
        the window and the ranks too); starts a new window."""
        extra = self.objective.take() if self.objective is not None else {}
        names = sorted(extra)
        stats = [self.loss / (self.steps * t.gradient_accumulation_steps), self.tokens]
        stats = torch.stack(stats + [extra[name].to(self.loss.device, self.loss.dtype) for name in names])
        dist.all_reduce(stats)
        elapsed = time.perf_counter() - self.start
        loss, tokens = stats[0].item() / world, stats[1].item()
        values = {name: value / world for name, value in zip(names, stats[2:].tolist())}
        if metrics:
            metrics.step(
                step,
                epoch,
                loss,
                engine.get_lr()[0],
                _grad_norm(engine),
                tokens / elapsed / world,
                elapsed / self.steps,
                self.clock.take() / self.steps,
                values,
            )
        self.loss.zero_(), self.tokens.zero_()
        self.steps, self.start = 0, time.perf_counter()
        return loss


@dataclass(frozen=True)
class Evaluator:
    """The token-weighted mean loss over the eval split, on all ranks, every train.eval_every_steps."""

    engine: Any
    batches: Batches
    cfg: TrainingConfig
    world: int
    rank: int
    metrics: MetricsLogger | None
    objective: preference_train.Objective | None = None
    shards: sequence_parallel.Shards | None = None

    def due(self, step: int) -> bool:
        every = self.cfg.train.eval_every_steps
        return bool(every and step % every == 0 and self.batches.eval_set is not None)

    def run(self, step: int) -> float | None:
        """The loss; None, with a warning, when the eval split holds no target token."""
        engine, t, eval_set = self.engine, self.cfg.train, self.batches.eval_set
        loader = data.make_eval_loader(
            eval_set, t.micro_batch_size, self.world, self.rank, self.batches.collate, self.shards is not None
        )
        if self.objective is not None:
            return self.run_pairs(step, loader)
        engine.eval()
        totals = torch.zeros(2, device=engine.device)
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if t.eval_max_batches and i >= t.eval_max_batches:
                    break
                batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                if self.shards is not None:  # the whole sequence's loss; n: this shard's targets (summed: all)
                    _, n, loss = self.shards.loss(engine, batch, {})
                    loss = torch.where(n > 0, loss.float(), float("nan"))
                else:
                    n = (batch["labels"][:, 1:] != -100).sum()
                    loss = engine(**batch).loss.float()  # a batch without targets (EvalShard's wrap-around): NaN
                totals += torch.stack([torch.where(n > 0, loss * n, 0.0), n.float()])
        engine.train()
        dist.all_reduce(totals)
        if totals[1] == 0:
            if self.rank == 0:
                log.warning(
                    f"eval at step {step}: the eval split ({len(eval_set):,} sequences) holds no target token, so "
                    "there is no eval loss; give it more rows (data.eval_fraction, data.eval_split)"
                )
            return None
        loss = (totals[0] / totals[1]).item()
        if self.metrics:
            self.metrics.eval(step, loss)
        return loss

    def run_pairs(self, step: int, loader) -> float | None:
        """Preference tuning's loss and metrics over the eval split's pairs, each pair weighing the same."""
        engine, limit = self.engine, self.cfg.train.eval_max_batches
        engine.eval()
        sums: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if limit and i >= limit:
                    break
                batch = {k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                loss, metrics, _, pairs = self.objective.loss(engine, batch, keep=False)
                if not pairs:  # EvalShard's repeated samples only: their values are NaN
                    continue
                for name, value in {"loss": loss, **metrics, "pairs": torch.ones((), device=engine.device)}.items():
                    sums[name] = sums.get(name, 0.0) + value.float() * pairs
        engine.train()
        names = ["loss", "pairs", *sorted(self.objective.cfg_metrics())]
        totals = preference_train.averaged({n: sums.get(n, 0.0) for n in names}, 1, engine.device)  # over the ranks
        pairs = totals.pop("pairs", 0.0)
        if not pairs:
            if self.rank == 0:
                log.warning(f"eval at step {step}: the eval split holds no preference pair to score")
            return None
        means = {name: value / pairs for name, value in totals.items()}
        loss = means.pop("loss")
        if self.metrics:
            self.metrics.eval(step, loss, means)
        return loss


def _flops_per_token(model, cfg: TrainingConfig) -> float:
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    mc = model.config
    layers = getattr(mc, "num_hidden_layers", None) or getattr(mc, "n_layer", 0)
    return flops_per_token(n_params, layers, hidden_size(mc) or 0, cfg.data.seq_length)


def _grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
