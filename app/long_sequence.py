"""model.long_sequence on the workers: the tiled MLP, the tiled loss and checkpoints offloaded to host memory, so
that one sequence of hundreds of thousands of tokens trains on one GPU (issue #52, item 1). app/resolve.py predicts
what each saves and app/autoset.py decides which are on; this module only does what the settled config says.

- Tiled MLP: each decoder layer's MLP runs over tiles of MLP_TILE_TOKENS tokens; only its input is kept, and each
  tile's forward is recomputed in backward (the random state of the forward restored, so that dropout masks match).
- Tiled loss: the causal LM's forward returns the cross-entropy computed tile by tile from the final hidden states;
  each tile's logits, their softmax gradient and its products with the head are computed in the forward and freed,
  so the [tokens, vocabulary] logits never exist (the gradients are scaled by the loss's incoming gradient later).
- Offloaded checkpoints: the first N decoder layers' checkpointed inputs go to pinned host buffers (one a layer,
  reused every step), copied on a side stream, and come back to the GPU before the layer is recomputed.

Each is numerically the operation it replaces (tests/test_long_sequence.py: fp32 losses and gradients within 1e-6);
on CPUs the same code runs, the host copy then a plain one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from app.errors import Problem
from app.resolve import LOSS_TILE_ELEMENTS, MLP_TILE_TOKENS

IGNORE = -100


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _rng_restored(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device):
    """The random state of a forward, for its recomputation, the caller's state kept outside."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _mark_ready(params: tuple[torch.Tensor, ...], ready: bool) -> None:
    """DeepSpeed's ZeRO-1/2 gradient hooks read ds_grad_is_ready: a parameter whose gradient arrives in several
    parts (one a tile) is reduced once, after the last."""
    for param in params:
        param.ds_grad_is_ready = ready


# --- the tiled MLP --------------------------------------------------------------------------------------------


class _TiledMLP(torch.autograd.Function):
    """fn over tiles of `tile` tokens; the trainable parameters are inputs only so that the output requires a
    gradient whenever one of them does (their gradients accumulate in the recomputation's own backward)."""

    @staticmethod
    def forward(ctx, fn, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        ctx.rng = _rng_state(x.device)
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([fn(part) for part in flat.split(tile)])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        flat = x.detach().reshape(-1, x.shape[-1])
        grads = grad.reshape(-1, grad.shape[-1])
        wants = ctx.needs_input_grad[2]
        x_grad = torch.empty_like(flat) if wants else None
        starts = range(0, flat.shape[0], ctx.tile)
        with _rng_restored(ctx.rng, x.device), torch.enable_grad():
            for n, start in enumerate(starts):
                _mark_ready(ctx.params, n == len(starts) - 1)
                part = flat[start : start + ctx.tile].detach().requires_grad_(wants)
                out = ctx.fn(part)
                torch.autograd.backward(out, grads[start : start + ctx.tile])
                if wants:
                    x_grad[start : start + ctx.tile] = part.grad
        return None, None, x_grad.view_as(x) if wants else None, *([None] * len(ctx.params))


def tile_mlp(mlp: torch.nn.Module, tile: int | None = None) -> None:
    """Make `mlp` (a token-wise module: Llama's gated MLP, Liger's SwiGLU, GPT-2's) compute in tiles of `tile`
    tokens (MLP_TILE_TOKENS)."""
    own, tile = mlp.forward, tile or MLP_TILE_TOKENS

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.shape[:-1].numel() <= tile:
            return own(x)
        params = tuple(p for p in mlp.parameters() if p.requires_grad)
        return _TiledMLP.apply(own, tile, x, *params)

    mlp.forward = forward


# --- the tiled loss -------------------------------------------------------------------------------------------


class _TiledLoss(torch.autograd.Function):
    """Mean cross-entropy of hidden @ weight.T against labels (IGNORE left out), over `count` targets, the gradients
    computed tile by tile in the forward."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        tile: int,
        count: torch.Tensor,
        grads: bool,
    ):
        # `grads`: the caller's grad mode (an evaluation computes the loss alone, at any length, in tiles too).
        hidden_grad = torch.empty_like(hidden) if grads and ctx.needs_input_grad[0] else None
        wants_weight = grads and ctx.needs_input_grad[1]
        weight_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], tile):
            h, y = hidden[start : start + tile], labels[start : start + tile]
            logits = (h @ weight.T).float()
            valid = y != IGNORE
            target = y.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if hidden_grad is None and weight_grad is None:
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # the softmax, in place of the logits
            grad[torch.arange(grad.shape[0], device=grad.device), target] -= 1
            grad.mul_((valid.float() / count)[:, None])
            grad = grad.to(hidden.dtype)
            if hidden_grad is not None:
                hidden_grad[start : start + tile] = grad @ weight
            if weight_grad is not None:
                weight_grad.addmm_(grad.T.float(), h.float())
        ctx.save_for_backward(hidden_grad, weight_grad)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden_grad, weight_grad = ctx.saved_tensors
        hidden_out = hidden_grad * grad.to(hidden_grad.dtype) if hidden_grad is not None else None
        weight_out = (weight_grad * grad).to(ctx.weight_dtype) if weight_grad is not None else None
        return hidden_out, weight_out, None, None, None, None


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: Any = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' causal LM loss (labels shifted left by one, IGNORE left out, the mean over the targets or the
    sum over num_items_in_batch) without the logits: tiles of at most LOSS_TILE_ELEMENTS logits. `shift_labels`,
    as transformers takes them, are already shifted: a sequence-parallel shard's (app.sequence_parallel), whose last
    token's target is the next shard's first."""
    if shift_labels is not None:
        shifted = shift_labels.reshape(-1)
    else:
        shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if num_items_in_batch is None:
        count = (shifted != IGNORE).sum().clamp(min=1).float()
    else:
        count = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    tile = max(1, LOSS_TILE_ELEMENTS // weight.shape[0])
    return _TiledLoss.apply(flat, weight, shifted.to(hidden.device), tile, count, torch.is_grad_enabled())


def tile_loss(model: torch.nn.Module) -> None:
    """Make a causal LM's forward return the tiled loss (and no logits) when it is given labels."""
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(model.config, key, None):
            raise Problem(
                "model.long_sequence.tiled_loss",
                True,
                f"this model scales its logits ({key}), which the tiled loss does not",
                "set model.long_sequence.tiled_loss: false",
            )
    own = model.forward
    head = model.get_output_embeddings()
    body = model.base_model

    def forward(input_ids=None, labels=None, num_items_in_batch=None, shift_labels=None, **kwargs):
        if labels is None and shift_labels is None:  # logits asked for (generation, the packed-documents check)
            return own(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.pop("logits_to_keep", None)
        kwargs.pop("use_cache", None)
        hidden = body(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        loss = tiled_cross_entropy(hidden, head.weight, labels, num_items_in_batch, shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = forward


# --- offloaded checkpoints ------------------------------------------------------------------------------------


class HostStore:
    """Pinned host buffers for checkpointed layer inputs, one a layer, reused every step (a micro-batch's backward
    ends before the next forward starts). On a GPU the copy out runs on a side stream; the copy back waits for it."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}
        self.copied: dict[int, Any] = {}
        self.stream: Any = None

    def put(self, key: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":  # CPU workers: the same path, a plain copy
            self.buffers[key] = tensor.clone()
            return
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self.buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.stream = self.stream or torch.cuda.Stream(tensor.device)
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.stream):
            buffer.copy_(tensor, non_blocking=True)
            self.copied[key] = torch.cuda.Event()
            self.copied[key].record(self.stream)
        tensor.record_stream(self.stream)  # its memory is not reused before the copy ends

    def get(self, key: int, device: torch.device) -> torch.Tensor:
        buffer = self.buffers[key]
        if device.type != "cuda":
            return buffer
        torch.cuda.current_stream(device).wait_event(self.copied[key])
        return buffer.to(device, non_blocking=True)


class _Offloaded(torch.autograd.Function):
    """A checkpointed layer whose input waits in host memory: run without saving anything in the forward,
    recomputed from the input brought back in the backward (the forward's random state restored)."""

    @staticmethod
    def forward(ctx, run, store: HostStore, key: int, hidden: torch.Tensor, *params: torch.Tensor):
        ctx.run, ctx.store, ctx.key, ctx.device = run, store, key, hidden.device
        ctx.rng = _rng_state(hidden.device)
        with torch.no_grad():
            out = run(hidden)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"an offloaded checkpoint needs a layer that returns a tensor, not {type(out).__name__}")
        store.put(key, hidden)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wants = ctx.needs_input_grad[3]
        hidden = ctx.store.get(ctx.key, ctx.device).detach().requires_grad_(wants)
        with _rng_restored(ctx.rng, ctx.device), torch.enable_grad():
            out = ctx.run(hidden)
        torch.autograd.backward(out, grad)
        params = len(ctx.needs_input_grad) - 4
        return None, None, None, hidden.grad if wants else None, *([None] * params)


def offloaded_checkpoint(function, hidden: torch.Tensor, *args: Any, layer, store: HostStore, key: int):
    """A layer's _gradient_checkpointing_func (transformers calls it with the layer's forward bound to its keyword
    arguments, and its positional ones) that keeps the layer's input in host memory."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):  # only the hidden states are offloaded
        return torch.utils.checkpoint.checkpoint(function, hidden, *args, use_reentrant=False)
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    return _Offloaded.apply(lambda h: function(h, *args), store, key, hidden, *params)


# --- applying the settled switches ----------------------------------------------------------------------------


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order: the modules transformers checkpoints."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def apply(model: torch.nn.Module, long: Any, checkpointing: bool) -> list[str]:
    """Turn on what the settled model.long_sequence says (switches still "auto" are off); the log's lines."""
    said = []
    layers = decoder_layers(model)
    if long.tiled_mlp is True:
        mlps = [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
        for mlp in mlps:
            tile_mlp(mlp)
        said.append(f"tiled MLP in {len(mlps)} layers, {MLP_TILE_TOKENS} tokens a tile")
    if long.tiled_loss is True:
        tile_loss(model)
        said.append(f"tiled loss, at most {LOSS_TILE_ELEMENTS} logits a tile")
    offload = long.offload_checkpoints
    count = len(layers) if offload is True else offload if type(offload) is int else 0  # "auto" left: off
    if count and not checkpointing:
        raise Problem(
            "model.long_sequence.offload_checkpoints",
            long.offload_checkpoints,
            "offloads checkpointed layer inputs, and activation checkpointing is off",
            "set model.gradient_checkpointing: true",
        )
    if count:
        store = HostStore()
        for key, layer in enumerate(layers[:count]):
            layer._gradient_checkpointing_func = functools.partial(
                offloaded_checkpoint, layer=layer, store=store, key=key
            )
        said.append(f"checkpoints of {min(count, len(layers))} of {len(layers)} layers in pinned host memory")
    if said and torch.cuda.is_available():
        # Blocks of one layer's input (GiB each at these lengths) allocated and freed every layer: in fixed segments
        # torch's reserved memory ran 6 GiB above what it held and a 512k step failed for want of 4 (docs/training.md).
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        said.append("CUDA memory in expandable segments")
    return said
