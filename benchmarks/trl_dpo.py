"""The DPO peer: TRL 1.16's `DPOTrainer` on the same model, LoRA settings, chat template, preference pairs, loss and
batch as a preference training config of this app (`data.format: preference`, `preference.loss: sigmoid`,
`model.lora`).

Run under torchrun (one process per GPU), from a training config YAML of this app:
    python -m torch.distributed.run --standalone --nproc_per_node 1 -m benchmarks.trl_dpo --config C.yaml [--deepspeed]

What is shared with `finetune train` (benchmarks.trl_peer, as benchmarks.trl_sft shares it): the model folder (TRL loads
it itself, bf16), the attention kernel (registered without a mask function, so each of TRL's right-padded rows runs the
varlen FlashAttention as one causal sequence: no token sees the padding after it), the chat template
(`data.chat_template`), the LoRA r/alpha/dropout and the target modules the app resolves, Liger's layer kernels (TRL
1.16's DPOTrainer takes `use_liger_kernel` for the layers only and computes the log-probabilities with its own chunked
LM head; DPOConfig has no `use_liger_loss`), the micro-batch, accumulation, learning rate, clipping and a fused torch
AdamW; and for DPO: the jsonl of pairs (TRL's conversational prompt/chosen/rejected), `max_length` = `data.seq_length`,
the loss (`loss_type`, `beta`, `label_smoothing` of `preference`) and the reference: with LoRA, the base model with the
adapters switched off, which is what DPOTrainer does with a peft model (no reference model in memory), as the app's
`reference: auto` does; full-parameter, the reference's log-probabilities computed in a pass before training, on both
sides (`dpo_args`). What differs is each side's own way: TRL pads each micro-batch's 2 x micro-batch sequences
(chosen, rejected) to the longest of them (its `padding_free` is off in 1.16); the app packs each pair's two sequences
into a block of `data.seq_length` (bench's DPO corpus has every pair longer than half a block, so a block holds one pair
and the micro-batch is a number of pairs on both sides).

Step times are taken at each logged step after `torch.cuda.synchronize()`; tokens/s counts every token of the chosen
and rejected sequences (prompt and answer, padding left out), as the app's preference loop counts the tokens its
forward reads; pairs/s counts the pairs; TRL's logged rewards/accuracies and rewards/margins go in the record.
"""

from __future__ import annotations

from benchmarks.runner import PREFERENCE_LOGGED
from benchmarks.trl_peer import arguments, config_args, counters, setup, train


def dpo_args(cfg) -> dict:
    """DPOConfig's loss and reference of the app's `preference`: sigmoid (DPO) or IPO; the reference as the app's
    `reference: auto`: with LoRA the peft model with its adapters off (TRL's own way), full-parameter the
    log-probabilities of the model as loaded, computed in one pass before training (`precompute_ref_log_probs`: no
    second model in memory, as the app's stored pass). Other losses are other TRL trainers (CPO, ORPO)."""
    pref = cfg.preference
    if pref is None or pref.loss not in ("sigmoid", "ipo"):
        raise SystemExit(f"trl_dpo: preference.loss must be sigmoid or ipo, not {pref and pref.loss}")
    if pref.reference != "auto":
        raise SystemExit("trl_dpo: needs preference.reference: auto (the model as loaded, as TRL's own reference)")
    stored = {"precompute_ref_log_probs": True} if cfg.model.lora is None else {}
    return dict(loss_type=[pref.loss], beta=pref.beta, label_smoothing=pref.label_smoothing, **stored)


def main() -> None:
    import datasets
    from trl import DPOConfig, DPOTrainer

    run = setup(arguments())
    cfg = run.cfg
    columns = ["prompt", "chosen", "rejected"]
    train_set = datasets.load_dataset("json", data_files=cfg.data.dataset, split="train").select_columns(columns)
    dpo = DPOConfig(**dpo_args(cfg), **config_args(run, "trl-dpo-"))
    counted = counters(2)  # tokens of the chosen and rejected sequences, pairs

    class Counting(DPOTrainer):
        """DPOTrainer, counting each micro-batch's tokens and pairs on the device (read once per logged step, after
        the sync): its batch is the chosen sequences, then the rejected ones, right-padded (attention_mask 0)."""

        def training_step(self, model, inputs, *rest, **kw):
            counted[0] += inputs["attention_mask"].sum()
            counted[1] += inputs["input_ids"].shape[0] // 2
            return super().training_step(model, inputs, *rest, **kw)

    train(run, Counting, dpo, train_set, counted, PREFERENCE_LOGGED, per_step="tokens_per_step")


if __name__ == "__main__":
    main()
