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

from benchmarks.trl_peer import arguments, config_args, counters, lora_config, setup, train

__all__ = ["lora_config"]  # the app config's LoRA as peft's, where other peers and tests took it from


def main() -> None:
    import datasets
    from trl import SFTConfig, SFTTrainer

    run = setup(arguments())
    d = run.cfg.data
    train_set = datasets.load_dataset("json", data_files=d.dataset, split="train").select_columns(["messages"])
    sft = SFTConfig(
        packing=d.packing,
        packing_strategy="bfd",
        assistant_only_loss=not d.train_on_prompt,
        **config_args(run, "trl-sft-"),
    )
    counted = counters(1)  # the targets

    class Counting(SFTTrainer):
        """SFTTrainer, counting each micro-batch's targets on the device (read once per step, after the sync)."""

        def training_step(self, model, inputs, *rest, **kw):
            counted[0] += (inputs["labels"][..., 1:] != -100).sum()
            return super().training_step(model, inputs, *rest, **kw)

    train(run, Counting, sft, train_set, counted)


if __name__ == "__main__":
    main()
