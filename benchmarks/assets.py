"""Benchmark assets made offline: model folders (config + tokenizer, no weights) and synthetic corpora.

A model folder holds a Hugging Face config of a known shape and a word-level tokenizer whose vocabulary is
the model's, so every whitespace-separated word of the corpus is exactly one token: the corpus's length
distribution is the token-length distribution the training path sees. The vocabulary's last ids are the zephyr
template's role markers, as a chat model's tokenizer has its template's markers (without them each marker was the
unknown token, which is EOS and the padding token, whose embedding row a fresh model zeroes: every conversation
then started with an all-zero hidden state, which overflowed the 1.1B model's gradients; app.data.chat.unknown_markers
now refuses such a tokenizer). The app builds the model with
random weights from such a folder when `model.name_or_path` is `random-init:<folder>`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

EOS = "<|endoftext|>"
MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")  # app.data.chat.TEMPLATES["zephyr"]'s, one token each


def words_of(vocab: int) -> int:
    """How many ids of a `vocab`-token model folder are words (t1, t2, ...): all but EOS and the markers."""
    return vocab - 1 - len(MARKERS)


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # "gpt2", "llama", "qwen2" or "qwen3"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int = 0
    intermediate: int = 0
    context: int = 2048
    rope_theta: float = 10000.0
    head_dim: int = 0  # 0: hidden / heads (Qwen3 sets its own: 128 at every size)

    def hf_config(self):
        if self.kind == "gpt2":
            from transformers import GPT2Config

            return GPT2Config(
                vocab_size=self.vocab,
                n_positions=self.context,
                n_embd=self.hidden,
                n_layer=self.layers,
                n_head=self.heads,
                bos_token_id=0,
                eos_token_id=0,
                dtype="bfloat16",
            )
        from transformers import LlamaConfig, Qwen2Config, Qwen3Config

        # Qwen2: q/k/v biases (its modelling code's own), tied embeddings; Qwen3: RMSNorm on q and k instead of the
        # biases, its own head size, tied embeddings at the small sizes; Llama: none of these.
        qwen = self.kind in ("qwen2", "qwen3")
        kind = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(self.kind, LlamaConfig)
        return kind(
            **({"head_dim": self.head_dim} if self.head_dim else {}),
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads or self.heads,
            max_position_embeddings=self.context,
            rms_norm_eps=1e-6 if qwen else 1e-5,
            rope_theta=self.rope_theta,
            tie_word_embeddings=qwen,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            dtype="bfloat16",
        )


SHAPES = {
    s.name: s
    for s in (
        # GPT-2 124M: the tutorial's model.
        Shape("gpt2-124m", "gpt2", 50257, 768, 12, 12, context=1024),
        # TinyLlama 1.1B dimensions.
        Shape("llama-1.1b", "llama", 32000, 2048, 22, 32, kv_heads=4, intermediate=5632, context=2048),
        # Llama-3-8B dimensions.
        Shape(
            "llama-8b", "llama", 128256, 4096, 32, 32, kv_heads=8, intermediate=14336, context=8192, rope_theta=500000.0
        ),
        # The same with a context of 2^20 positions (Llama 3.1's 8B reaches 131,072 by RoPE scaling): the long suite.
        Shape(
            "llama-8b-1m",
            "llama",
            128256,
            4096,
            32,
            32,
            kv_heads=8,
            intermediate=14336,
            context=1 << 20,
            rope_theta=500000.0,
        ),
        # Qwen2-0.5B dimensions: a small hidden size (896), q/k/v biases, tied embeddings, a 151,936-token vocabulary.
        Shape("qwen2-0.5b", "qwen2", 151936, 896, 24, 14, kv_heads=2, intermediate=4864, context=32768, rope_theta=1e6),
        # Qwen3-1.7B dimensions: a shape no suite tuned the app on (the defaults suite's check of what a user gets):
        # q/k RMSNorm, head size 128 with 16 query and 8 key/value heads, tied embeddings, 151,936-token vocabulary.
        Shape(
            "qwen3-1.7b",
            "qwen3",
            151936,
            2048,
            28,
            16,
            kv_heads=8,
            intermediate=6144,
            context=40960,
            rope_theta=1e6,
            head_dim=128,
        ),
        # Tiny shapes for the CPU smoke suite.
        Shape("tiny-gpt2", "gpt2", 1000, 64, 2, 2, context=512),
        Shape("tiny-llama", "llama", 1000, 64, 2, 4, kv_heads=2, intermediate=172, context=512),
    )
}


@dataclass(frozen=True)
class Lengths:
    """Document lengths in tokens: a log-normal distribution clipped to [lo, hi]."""

    name: str
    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)


LENGTHS = {
    # ag_news-like: title + description, about 50 tokens on average (the tutorial's workload).
    "news": Lengths("news", 45, 0.35, 8, 256),
    # web-document-like: long-tailed, from a sentence to many pages.
    "docs": Lengths("docs", 400, 1.0, 16, 16384),
}


def model_folder(root: Path, shape: Shape) -> Path:
    """config.json + a word-level tokenizer of the model's vocabulary; idempotent."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = root / "models" / shape.name
    tokenizer = tokenizer_folder(out) / "tokenizer.json"
    if (out / "config.json").exists() and tokenizer.exists() and MARKERS[-1] in tokenizer.read_text():
        return out
    out.mkdir(parents=True, exist_ok=True)
    words = words_of(shape.vocab)
    vocab = {EOS: 0, **{f"t{i}": i for i in range(1, words + 1)}, **{m: words + 1 + n for n, m in enumerate(MARKERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS, pad_token=EOS)
    fast.save_pretrained(out)
    fast.save_pretrained(tokenizer_folder(out))
    shape.hf_config().save_pretrained(out)
    return out


def tokenizer_folder(model: Path) -> Path:
    """The word-level tokenizer alone, for `model.tokenizer`: beside a config.json, transformers' AutoTokenizer
    takes the model type's own class (Qwen2's BPE, which turns these words into no tokens at all)."""
    return model / "tokenizer"


def corpus(root: Path, lengths: Lengths, vocab: int, tokens: int, seed: int = 0) -> Path:
    """A jsonl file of {"text": ...} documents drawn from `lengths`, about `tokens` tokens in all."""
    out = root / "data" / f"{lengths.name}-v{vocab}-{tokens}.jsonl"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_docs = max(1, int(tokens / lengths.sample(rng, 10000).mean() * 1.02))
    lens = lengths.sample(rng, n_docs)
    ids = rng.integers(1, words_of(vocab) + 1, int(lens.sum()))
    words = np.char.add("t", ids.astype(str))
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        pos = 0
        for n in lens:
            f.write(json.dumps({"text": " ".join(words[pos : pos + n])}) + "\n")
            pos += n
    tmp.rename(out)
    return out


# Turn lengths in tokens of a chat corpus (log-normal, clipped): short system prompts, questions, longer answers.
CHAT_TURNS = {
    "system": Lengths("system", 40, 0.6, 8, 300),
    "user": Lengths("user", 50, 0.9, 4, 600),
    "assistant": Lengths("assistant", 160, 0.8, 8, 1200),
}
CHAT_MAX = 1900  # tokens of words per conversation: within a 2048-token block with the template's few per turn


def conversation(rng: np.random.Generator, words: np.ndarray) -> list[dict[str, str]]:
    """One conversation: a system prompt half the time, then 1 to 8 user/assistant exchanges (geometric, mean
    about 2.2); exchanges that would pass CHAT_MAX are left out (the first is shortened instead)."""
    turns = [("system", CHAT_TURNS["system"])] if rng.random() < 0.5 else []
    for _ in range(min(8, int(rng.geometric(0.45)))):
        turns += [("user", CHAT_TURNS["user"]), ("assistant", CHAT_TURNS["assistant"])]
    messages, used = [], 0
    for role, lengths in turns:
        n = int(lengths.sample(rng, 1)[0])
        if used + n > CHAT_MAX:
            if any(m["role"] == "assistant" for m in messages):
                break
            n = max(1, CHAT_MAX - used)
        picked = rng.integers(0, len(words), n)
        messages.append({"role": role, "content": " ".join(words[picked])})
        used += n
    if messages[-1]["role"] != "assistant":
        messages.pop()  # the user turn whose answer did not fit
    return messages


def chat_corpus(root: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """A jsonl file of {"messages": [...]} conversations (conversation()), about `tokens` words in all; each word
    one token of model_folder's tokenizer, so the lengths are the token lengths (plus the template's tokens)."""

    def draw(rng: np.random.Generator, words: np.ndarray) -> tuple[dict[str, Any], int]:
        messages = conversation(rng, words)
        return {"messages": messages}, sum(len(m["content"].split()) for m in messages)

    return rows_file(root / "data" / f"chat-v{vocab}-{tokens}.jsonl", vocab, tokens, seed, draw)


def rows_file(out: Path, vocab: int, tokens: int, seed: int, draw: Callable) -> Path:
    """`out`, a jsonl file of the rows `draw(rng, words)` gives (each with its count of words) until `tokens` words,
    the words those of model_folder's tokenizer for `vocab`; written once (a temporary file renamed into place)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.char.add("t", np.arange(1, words_of(vocab) + 1).astype(str))
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        written = 0
        while written < tokens:
            row, n = draw(rng, words)
            f.write(json.dumps(row) + "\n")
            written += n
    tmp.rename(out)
    return out


# Preference pairs (TRL's conversational form): a user prompt (after a system prompt half the time) and two assistant
# answers, UltraFeedback-like lengths in tokens (log-normal, clipped) for blocks of PAIR_BLOCK tokens, scaled to others.
PAIR_BLOCK = 2048
PAIR_TURNS = {
    "system": Lengths("system", 40, 0.6, 8, 200),
    "user": Lengths("user", 220, 0.8, 16, 800),
    "assistant": Lengths("assistant", 380, 0.6, 32, 900),
}


def pair_room(block: int) -> int:
    """Tokens of a block left to the template (a marker and an EOS a message: 12 for a pair of three-message
    sequences) and to spare."""
    return max(16, block // 32)


def pair_words(pair: dict[str, list[dict[str, str]]]) -> int:
    """Words of a pair as the app packs it: the prompt twice (once before each answer) and both answers."""
    words = {key: sum(len(m["content"].split()) for m in pair[key]) for key in ("prompt", "chosen", "rejected")}
    return 2 * words["prompt"] + words["chosen"] + words["rejected"]


def preference_pair(rng: np.random.Generator, words: np.ndarray, block: int) -> dict[str, list[dict[str, str]]]:
    """One pair whose prompt (twice) and two answers are more than half of `block` tokens and fit it with the
    template's tokens: drawn again until they do. Packed by the app (a pair's two sequences in one block), each block
    then holds exactly one pair, so a micro-batch of blocks is one of pairs, as TRL's is; and no sequence is cut on
    either side (TRL's max_length, the same `block`, applies to each sequence alone)."""
    while True:
        prompt = [("system", PAIR_TURNS["system"])] if rng.random() < 0.5 else []
        turns = [*prompt, ("user", PAIR_TURNS["user"]), ("chosen", PAIR_TURNS["assistant"])]
        turns.append(("rejected", PAIR_TURNS["assistant"]))
        pair: dict[str, list[dict[str, str]]] = {"prompt": [], "chosen": [], "rejected": []}
        for role, lengths in turns:
            n = max(1, round(int(lengths.sample(rng, 1)[0]) * block / PAIR_BLOCK))
            content = " ".join(words[rng.integers(0, len(words), n)])
            key = role if role in ("chosen", "rejected") else "prompt"
            pair[key].append({"role": "assistant" if key != "prompt" else role, "content": content})
        if block // 2 < pair_words(pair) <= block - pair_room(block):
            return pair


def preference_corpus(root: Path, vocab: int, tokens: int, block: int, seed: int = 0) -> Path:
    """A jsonl file of {"prompt", "chosen", "rejected"} message lists (preference_pair() for blocks of `block`
    tokens), about `tokens` words of packed pairs in all; each word one token of model_folder's tokenizer."""

    def draw(rng: np.random.Generator, words: np.ndarray) -> tuple[dict[str, Any], int]:
        pair = preference_pair(rng, words, block)
        return pair, pair_words(pair)

    return rows_file(root / "data" / f"pairs-v{vocab}-b{block}-{tokens}.jsonl", vocab, tokens, seed, draw)
