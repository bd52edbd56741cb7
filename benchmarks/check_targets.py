"""On a GPU: the LM head and loss at the target positions only (app.data.model_inputs with the options
app.model.model_input_options gives the model: Liger's fused loss, varlen attention, the rows joined) against the
whole batch: loss and gradients, bf16 models as the app trains them. One JSON object on stdout or in --out.

    python -m benchmarks.check_targets [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch


def compare(arch: str) -> dict:
    from transformers import LlamaConfig, Qwen2Config

    from app import data
    from app.config import ModelConfig
    from app.model import LOSS_AT_TARGETS_ENV, load_model, model_input_options

    folder = tempfile.mkdtemp()
    shape = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
    config = Qwen2Config(**shape, tie_word_embeddings=True) if arch == "qwen2" else LlamaConfig(**shape)
    config.save_pretrained(folder)
    torch.manual_seed(0)
    model = load_model(ModelConfig(name_or_path=f"random-init:{folder}"), {}, separate_documents=True)
    model = model.cuda().bfloat16().train()
    ids = torch.randint(1, 32000, (4, 1024))
    ids[:, [300, 700]] = 0
    labels = ids.clone()
    for row in range(4):
        labels[row, : 150 + 20 * row] = -100  # prompts
        labels[row, 301:420] = -100
    batch = data.with_targets(data.packed_batch(ids, labels, 0))
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}

    def run(inputs):
        model.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        return loss.float().item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}

    options = model_input_options(model)
    targets_only = data.model_inputs(batch, **options)
    kept_loss, kept = run(targets_only)
    whole_loss, whole = run(data.model_inputs(batch))
    os.environ[LOSS_AT_TARGETS_ENV] = "0"
    off = model_input_options(model)
    del os.environ[LOSS_AT_TARGETS_ENV]
    rel = {n: ((kept[n] - whole[n]).norm() / whole[n].norm().clamp(min=1e-12)).item() for n in whole}
    # For scale: the same whole-batch pass twice differs by the nondeterminism of its kernels alone.
    again_loss, again = run(data.model_inputs(batch))
    rel_again = {n: ((again[n] - whole[n]).norm() / whole[n].norm().clamp(min=1e-12)).item() for n in whole}
    return {
        "arch": arch,
        "options": options,
        "options_with_env_0": off,
        "logits_to_keep_passed": "logits_to_keep" in targets_only,
        "forward": model.forward.__module__,
        "attn": model.config._attn_implementation,
        "targets": int(batch[data.TARGET_POSITIONS].numel()),
        "positions": int(ids.numel()),
        "loss_targets_only": kept_loss,
        "loss_whole": whole_loss,
        "loss_whole_again": again_loss,
        "grad_rel_err_max": max(rel.values()),
        "grad_rel_err_max_whole_again": max(rel_again.values()),
        "worst": max(rel, key=rel.get),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    result = {arch: compare(arch) for arch in ("llama", "qwen2")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
