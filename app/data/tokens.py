"""The tokenizer as the Ray Data actors hold it: the driver's own `tokenizers` backend and the few attributes the
encoders read, sent to the actors, so that an actor imports neither transformers nor torch and loads nothing.

On the GPU host 16 actors importing torch and transformers at once, then each loading the tokenizer, took 14 s of
a 61 s preparation. What the encoders ask of a tokenizer is, for a fast (Rust) tokenizer without truncation or
padding, one call of its backend: transformers' TokenizersBackend._encode_plus turns truncation and padding off on
the backend, sets its encode_special_tokens to split_special_tokens and returns `encode_batch`'s ids and offsets.
`Tokens` makes that same call on the same backend (pickled as its JSON, as tokenizer.json is loaded), so the ids
are the same by construction; `light` builds one only where transformers would make exactly that call (a class
that does not override how it encodes). Anything else (truncation, decoding for an error message, preference
pairs...) goes to the transformers tokenizer, loaded on first use.
"""

from __future__ import annotations

from typing import Any

# What the encoders read as plain attributes; everything else is the transformers tokenizer's.
ATTRIBUTES = ("eos_token_id", "pad_token_id", "unk_token_id", "unk_token", "chat_template", "split_special_tokens")


def light(tokenizer, model_cfg) -> Tokens | None:
    """The actors' Tokens for this transformers tokenizer, or None where its encoding is not its backend's
    encode_batch (a slow tokenizer, or a class that encodes its own way): those actors load it as it is."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or (
        kind._encode_plus is not TokenizersBackend._encode_plus
        or kind.__call__ is not PreTrainedTokenizerBase.__call__
        or kind.set_truncation_and_padding is not TokenizersBackend.set_truncation_and_padding
    ):
        return None
    return Tokens(tokenizer, model_cfg.model_dump(mode="json"))


class Tokens:
    """A fast tokenizer's backend and attributes (see the module's text); `full` is the transformers tokenizer."""

    def __init__(self, tokenizer, model: dict[str, Any]):
        self.backend = tokenizer.backend_tokenizer
        self.model = model  # the model section: how `full` loads the same tokenizer in an actor
        for name in ATTRIBUTES:
            setattr(self, name, getattr(tokenizer, name))
        self.special_tokens_map = dict(tokenizer.special_tokens_map)
        self.special_ids = special_ids(tokenizer)
        self._full = tokenizer

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_full": None}  # an actor loads it only if it needs it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ready()

    def _ready(self) -> None:
        """The backend's state as transformers sets it before it encodes: a transformers call in this process (the
        driver's tokenizer shares the backend) may have left truncation on, and encode_special_tokens is not in
        the pickled JSON."""
        if self.backend.truncation is not None:
            self.backend.no_truncation()
        if self.backend.padding is not None:
            self.backend.no_padding()
        self.backend.encode_special_tokens = self.split_special_tokens

    @property
    def full(self):
        if self._full is None:
            from app.config import ModelConfig
            from app.model import load_tokenizer

            self._full = load_tokenizer(ModelConfig.model_validate(self.model))
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_full", "backend", "model"):
            raise AttributeError(name)
        return getattr(self.full, name)

    def encodings(self, texts: list[str], add_special_tokens: bool = False) -> list:
        """`tokenizers.Encoding`s of the texts: ids and offsets as transformers' call gives them."""
        self._ready()
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens) if texts else []

    def ids(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.encodings(texts, add_special_tokens)]

    def __call__(self, text, add_special_tokens: bool = True, return_offsets_mapping: bool = False, **rest):
        """tokenizer(text) for the calls the encoders make without truncation or padding; any other to `full`."""
        if any(v not in (None, False) for k, v in rest.items() if k != "return_attention_mask"):
            return self.full(text, add_special_tokens=add_special_tokens, **rest)
        found = self.encodings([text] if isinstance(text, str) else list(text), add_special_tokens)
        out = {"input_ids": [e.ids for e in found]}
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in found]
        return {k: v[0] for k, v in out.items()} if isinstance(text, str) else out


def special_ids(tokenizer) -> frozenset[int]:
    """The ids an assistant turn may end with: the tokenizer's special tokens and added tokens marked special."""
    if isinstance(tokenizer, Tokens):
        return tokenizer.special_ids
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return frozenset(set(tokenizer.all_special_ids) | added)
