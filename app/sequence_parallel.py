"""Ulysses sequence parallelism (scaling.sequence_parallel): the workers of one group share each sequence.

Every worker of a group reads the same micro-batch (the sampler runs over the data-parallel ranks, app.train_loop),
cuts its labels shifted by one (so the target of a shard's last token, the next shard's first, is kept) and keeps
its own contiguous slice of the tokens. DeepSpeed's `UlyssesSPAttentionHF` exchanges the shards for a share of the
attention heads (an all-to-all) around each attention call, so attention sees the whole sequence: the position ids
of every shard are gathered, and packed documents stay apart through the whole batch's document boundaries
(`cu_seq_lens_*`), which each shard carries uncut. Each worker sums its shard's token losses and divides by the
target tokens of the whole micro-batch (counted over the group), so the group's parts add up to the mean over
target tokens, not a mean of shard means; DeepSpeed then sums the gradients over the group and averages them over
the data-parallel replicas.

The checks (`problems`) run before any cluster starts: the degree divides the workers, the sequence and the heads,
and the model's attention is one the adapter can wrap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from app.errors import Problem
from app.model import calls_attention_functions

if TYPE_CHECKING:
    from app.config import TrainingConfig

# The batch fields that describe the whole micro-batch (its documents' boundaries in the batch flattened to one
# row): attention reads them after the exchange, over the gathered sequence, so every shard carries them uncut.
WHOLE_SEQUENCE_FIELDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
IGNORE = -100


def problems(cfg: TrainingConfig, model_config: Any | None) -> list[Problem]:
    """What sequence parallelism cannot run with this config (and the model's config, None when it cannot be read
    yet): nothing when it is off."""
    sp = cfg.scaling.sequence_parallel
    if sp == 1:
        return []
    found = config_problems(cfg)
    if model_config is not None:
        found += model_problems(cfg, model_config)
    return found


def config_problems(cfg: TrainingConfig) -> list[Problem]:
    sp, workers, field = cfg.scaling.sequence_parallel, cfg.scaling.num_workers, "scaling.sequence_parallel"
    found = []
    if workers % sp:
        divisors = [d for d in range(1, workers + 1) if workers % d == 0]
        found.append(
            Problem(
                field,
                sp,
                f"does not divide scaling.num_workers={workers} (each group of sequence_parallel workers shares "
                "one sequence)",
                f"set it to one of {', '.join(map(str, divisors))}, or scaling.num_workers to a multiple of {sp}",
            )
        )
    seq = cfg.data.seq_length
    if seq % sp:
        found.append(
            Problem(
                field,
                sp,
                f"does not divide data.seq_length={seq} (each worker of a group takes an equal slice of the sequence)",
                f"set data.seq_length to a multiple of {sp}, e.g. {seq - seq % sp or sp}",
            )
        )
    if cfg.preference is not None:
        found.append(
            Problem(
                field,
                sp,
                "preference tuning scores each answer's tokens across the whole sequence, which sequence parallelism "
                "splits over workers; it is not supported with it",
                "set scaling.sequence_parallel=1 for preference tuning",
            )
        )
    if cfg.model.attn_implementation == "eager":
        found.append(
            Problem(
                "model.attn_implementation",
                "eager",
                f"eager attention needs a (sequence x sequence) mask, which sequence parallelism (scaling."
                f"sequence_parallel={sp}) cannot hand over with its shards",
                "use sdpa (the default) or flash_attention_2",
            )
        )
    return found


def heads(model_config) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) of the model's text config; a config that names no key/value heads has
    as many as attention heads (multi-head attention: GPT-2, OPT)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    q = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or q
    return q, kv


def model_problems(cfg: TrainingConfig, model_config) -> list[Problem]:
    """The model's attention against the degree: the adapter wraps the attention function transformers calls, and
    gives each worker heads/sp query heads and kv/sp key/value heads (or repeats the fewer key/value heads when sp
    is a multiple of their count)."""
    sp, field, kind = cfg.scaling.sequence_parallel, "scaling.sequence_parallel", model_config.model_type
    if not calls_attention_functions(model_config):
        return [
            Problem(
                field,
                sp,
                f"{kind} computes its own attention instead of calling transformers' attention functions, which is "
                "where DeepSpeed's Ulysses adapter exchanges the shards",
                "set scaling.sequence_parallel=1, or use a model whose attention goes through transformers' "
                "attention interface (Llama, Mistral, Qwen, Gemma, GPT-2, ...)",
            )
        ]
    q, kv = heads(model_config)
    if not q:
        return [Problem(field, sp, f"{kind}'s config names no num_attention_heads", "set scaling.sequence_parallel=1")]
    fits = [d for d in range(1, q + 1) if q % d == 0 and (kv % d == 0 or d % kv == 0)]
    if q % sp:
        return [
            Problem(
                field,
                sp,
                f"does not divide {kind}'s {q} attention heads (each worker of a group computes heads / "
                "sequence_parallel of them)",
                f"set it to one of {', '.join(map(str, fits))} (and scaling.num_workers to a multiple of it)",
            )
        ]
    if kv % sp and sp % kv:
        return [
            Problem(
                field,
                sp,
                f"neither divides nor is a multiple of {kind}'s {kv} key/value heads (each worker takes kv / "
                "sequence_parallel of them, or repeats them when sequence_parallel is a multiple of their number)",
                f"set it to one of {', '.join(map(str, fits))} (and scaling.num_workers to a multiple of it)",
            )
        ]
    return []


@dataclass(frozen=True)
class Shards:
    """This worker's place in its sequence-parallel group: `size` workers, this one the `rank`-th, over `group`."""

    size: int
    rank: int
    group: Any
    scale: float = 1.0  # of each part's gradient: see gradient_scale

    def cut(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This worker's slice of a collated micro-batch: input ids, position ids and labels shifted by one (each
        token's own target, the model's shift turned off), plus the whole batch's document boundaries."""
        ids, labels = batch["input_ids"], batch["labels"]
        rows, seq = ids.shape
        if seq % self.size:
            raise ValueError(f"a micro-batch of {seq} tokens does not split into {self.size} equal shards")
        mask = batch.get("attention_mask")
        if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
            # Causal attention over the gathered sequence replaces the mask: right padding alone is unseen by it.
            raise ValueError("sequence parallelism takes right-padded rows only; this batch has padding before tokens")
        shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        positions = batch.get("position_ids")
        if positions is None:  # one sequence a row: positions count from 0, as the model's own default
            positions = torch.arange(seq, device=ids.device).expand(rows, seq)
        n = seq // self.size
        part = slice(self.rank * n, (self.rank + 1) * n)
        shard = {key: batch[key] for key in WHOLE_SEQUENCE_FIELDS if key in batch}
        # Contiguous copies: transformers' loss flattens the labels with view().
        cut = {name: x[:, part].contiguous() for name, x in (("input_ids", ids), ("position_ids", positions))}
        shard.update(cut, shift_labels=shifted[:, part].contiguous())
        shard["labels"] = shard["shift_labels"]  # the model computes a loss only when given labels
        return shard

    def loss(self, forward, batch: dict[str, Any], options: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """(this shard's part of the micro-batch's loss, its target tokens, the micro-batch's loss): the part is the
        shard's summed token losses over the micro-batch's target tokens, so the group's parts add up to the mean
        over every target token of the sequence, and backward from each part gives each worker its share of the
        gradient (DeepSpeed sums them over the group)."""
        shard = self.cut(batch)
        targets = (shard["shift_labels"] != IGNORE).sum()
        total = targets.detach().clone()
        dist.all_reduce(total, group=self.group)
        # transformers' loss with num_items_in_batch: a sum over the shard's tokens, divided by it.
        part = forward(**shard, num_items_in_batch=total.clamp(min=1), **options).loss
        whole = part.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return part * self.scale if self.scale != 1 else part, targets, whole


def gradient_scale(ds_config: dict[str, Any], sp: int) -> float:
    """What each worker's part of the loss is multiplied by so that DeepSpeed's gradient reduction gives the mean
    over the data-parallel replicas of each group's summed gradient. DeepSpeed 0.19 sums the gradients of every
    worker and divides by num_workers / sequence_parallel everywhere but in ZeRO-3's reduce-scatter (its default),
    whose reduce_scatter_coalesced divides by every worker (measured: half the gradient norm of one worker's at
    sequence_parallel 2 without this)."""
    zero = ds_config.get("zero_optimization", {})
    return float(sp) if zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True) else 1.0


def setup(model, cfg: TrainingConfig, ds_config: dict[str, Any]) -> tuple[Any, Shards | None]:
    """Before deepspeed.initialize: the sequence-parallel groups (consecutive ranks; DeepSpeed's parallel state, the
    `mpu` the engine takes) and the model's attention function wrapped by DeepSpeed's Ulysses adapter. (None, None)
    when it is off. The adapter is built here rather than by its register_with_transformers, which reads
    num_key_value_heads that multi-head models (GPT-2) do not name; it is registered under the model's own
    attention name, so every transformers branch that tests that name still runs."""
    sp = cfg.scaling.sequence_parallel
    if sp == 1:
        return None, None
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
    group = mpu.get_sequence_parallel_group()
    text = model.config.get_text_config()
    q, kv = heads(text)
    name = model.config._attn_implementation
    adapter = UlyssesSPAttentionHF(
        attn=ALL_ATTENTION_FUNCTIONS[name],
        batch_size=cfg.train.micro_batch_size,
        attn_head_count=q,
        attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // q,
        kv_head_count=kv,
        num_hidden_layers=text.num_hidden_layers,
        process_group=group,
        seq_length_is_variable=False,
        local_seq_length=cfg.data.seq_length // sp,
        global_seq_length=cfg.data.seq_length,
    )
    adapter.core_attn_implementation = name

    def exchanged(module, query, key, value, attention_mask, *args, **kwargs):
        # The model built its mask for the shard's length; over the gathered sequence, attention is causal and
        # packed documents are kept apart by the whole batch's boundaries (cu_seq_lens_*).
        out, weights = adapter(module, query, key, value, None, *args, **kwargs)
        # transformers' contract is (batch, shard, heads, head size); the adapter returns the heads flattened, which
        # models that flatten the last two dimensions themselves (GPT-2) would flatten with the sequence.
        return out.reshape(*out.shape[:2], q, -1), weights

    ALL_ATTENTION_FUNCTIONS[name] = exchanged
    return mpu, Shards(sp, dist.get_rank(group), group, gradient_scale(ds_config, sp))
