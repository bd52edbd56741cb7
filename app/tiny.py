"""A tiny GPT-2-style model and a small text corpus (and preference pairs over it), built offline, for `make run`,
tests and drills.

No model or dataset hub is needed: the corpus is generated from templates (ag_news-like headlines in the
tutorial's four classes), the tokenizer is a byte-level BPE trained on it with `tokenizers`, and the model
is a 2-layer GPT-2 from a config with random weights. Both are deterministic for a given seed.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from app.checkpoint.layout import plain_modes

SUBJECTS = {
    "World": ["The prime minister", "United Nations envoys", "Rebel leaders", "The foreign ministry", "Peace talks"],
    "Sports": ["The home team", "The star striker", "Olympic sprinters", "The head coach", "Tennis champions"],
    "Business": ["Oil prices", "The central bank", "Tech shares", "Quarterly profits", "The retail giant"],
    "Sci/Tech": ["Researchers", "The space agency", "A new chip", "Software makers", "Climate scientists"],
}
VERBS = ["announce", "report", "expect", "reject", "welcome", "unveil", "question", "delay"]
OBJECTS = {
    "World": ["a ceasefire plan", "new sanctions", "an election date", "a trade accord"],
    "Sports": ["a late comeback", "a record season", "a title defence", "a new contract"],
    "Business": ["higher earnings", "a merger offer", "rate cuts", "weaker demand"],
    "Sci/Tech": ["a faster processor", "a lunar mission", "an open standard", "a security patch"],
}
TAILS = ["on Monday.", "after long talks.", "despite doubts.", "as markets watch.", "ahead of the weekend."]


def corpus_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(list(SUBJECTS))
        text = f"{rng.choice(SUBJECTS[label])} {rng.choice(VERBS)} {rng.choice(OBJECTS[label])} {rng.choice(TAILS)}"
        rows.append({"text": text, "label": label})
    return rows


QUESTION = "Which section is this headline for?"


def preference_rows(n: int, seed: int = 0, form: str = "conversational") -> list[dict]:
    """Preference pairs over the corpus' headlines whose chosen answer names the headline's section and ends with a
    full stop, and whose rejected answer names another section and ends with '!': a pattern a tiny model learns
    in a few steps (every rejected answer breaks it). `form`: conversational (TRL's prompt and answers as lists of
    messages), implicit (two whole conversations sharing the user turn) or text (three strings)."""
    rng = random.Random(seed)
    rows = []
    for line in corpus_lines(n, seed):
        wrong = rng.choice([label for label in SUBJECTS if label != line["label"]])
        question, chosen, rejected = f"{QUESTION} {line['text']}", f"{line['label']}.", f"{wrong}!"
        if form == "text":
            rows.append({"prompt": f"{question}\nAnswer:", "chosen": f" {chosen}", "rejected": f" {rejected}"})
            continue
        user = [{"role": "user", "content": question}]
        chosen_turns = [{"role": "assistant", "content": chosen}]
        rejected_turns = [{"role": "assistant", "content": rejected}]
        if form == "implicit":
            rows.append({"chosen": user + chosen_turns, "rejected": user + rejected_turns})
        else:
            rows.append({"prompt": user, "chosen": chosen_turns, "rejected": rejected_turns})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_corpus(path: Path, n: int = 2000, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus_lines(n, seed)))
    return path


def read_texts(path: Path) -> list[str]:
    """The "text" of every row of a JSON-lines corpus; ValueError when a row has none (or no row has one)."""
    try:
        texts = [json.loads(line)["text"] for line in Path(path).read_text().splitlines() if line.strip()]
    except (KeyError, TypeError, ValueError):
        raise ValueError('is not JSON lines with a "text" field in every row') from None
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError('has no row, or a "text" that is not a string')
    return texts


def build_tiny_model(
    out: Path,
    texts: list[str] | None = None,
    vocab_size: int = 512,
    n_positions: int = 256,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 2,
    seed: int = 0,
) -> Path:
    """Write a from_pretrained folder (config, random weights, a tokenizer trained on `texts`, by default the
    generated corpus); idempotent."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    texts = texts or [r["text"] for r in corpus_lines(2000, seed)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its progress bars print only blank lines when stderr is not a terminal
    )
    tok.train_from_iterator(texts, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    config = GPT2Config(
        vocab_size=len(hf_tok),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=hf_tok.eos_token_id,
        eos_token_id=hf_tok.eos_token_id,
    )
    torch.manual_seed(seed)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    GPT2LMHeadModel(config).save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    plain_modes(tmp)
    tmp.rename(out)
    return out
