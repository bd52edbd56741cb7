"""One unit of rows (at most UNIT_ROWS consecutive rows of a split) to its compact arrays: the rendering, masking,
tokenizing and packing of a split, done unit by unit so that the same unit gives the same bytes in any process
(app.data.pipeline runs units on every CPU of the Ray cluster; tests and `tokenize` run them in this one).

A unit's arrays (`Unit`): `tokens` (int32, every kept document's ids one after the other), `docs` (int64 offsets of
the documents in `tokens`), `targets` (a bit a token, 1 where it is a target, np.packbits' order; chat and
prompt/completion only: text's targets are its tokens) and, for packed chat, `blocks` (int64 offsets into `docs`:
block b is documents blocks[b]..blocks[b+1]-1, in order). Preference pairs (app.data.pairs) are two documents
each, chosen then rejected, next to each other, packed or not. Packed text is one stream of documents each followed by
EOS, cut to whole seq_length blocks (the unit's tail is dropped, as packing per 4,096-row batch always did), so it
needs no offsets.
Labels and position ids are not stored: app.data.store derives them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable

import numpy as np

from app.data import chat, pairs

log = logging.getLogger("finetune")
UNIT_ROWS = 4096  # rows per unit: also the packing group (best fit decreasing runs over a unit's conversations)


@dataclass
class Unit:
    """A unit's arrays and what happened to its rows (counts for the manifest)."""

    tokens: np.ndarray
    docs: np.ndarray | None = None
    targets: np.ndarray | None = None
    blocks: np.ndarray | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        found = {"tokens": self.tokens, "docs": self.docs, "targets": self.targets, "blocks": self.blocks}
        return {name: value for name, value in found.items() if value is not None}


def layout_of(fmt: str, packing: bool) -> str:
    """How blocks are cut from a unit: 'stream' (packed text: fixed slices), 'blocks' (packed conversations:
    whole documents per block) or 'rows' (unpacked: one document a row, padded when read); preference pairs are
    'pair_blocks' (whole pairs per block, each chosen then rejected) or 'pair_rows' (a pair's two rows a sample)."""
    if fmt == "preference":
        return "pair_blocks" if packing else "pair_rows"
    if not packing:
        return "rows"
    return "stream" if fmt == "text" else "blocks"


class UnitEncoder:
    """Rows of one unit to a Unit, for one data config, format and tokenizer (loaded once per process)."""

    def __init__(self, cfg, fmt: str, tokenizer, locate: Callable[[int], str]):
        self.cfg, self.fmt, self.tokenizer, self.locate = cfg, fmt, tokenizer, locate
        self.chat = chat.Encoder(cfg, fmt, tokenizer, locate) if fmt not in ("text", "preference") else None
        self.pairs = pairs.Encoder(cfg, tokenizer, locate) if fmt == "preference" else None

    def __call__(self, rows: dict[str, list]) -> Unit:
        """`rows`: the unit's columns (chat rows carry chat.ROW, their index in the split, for error messages)."""
        if self.fmt == "text":
            return self._text(rows)
        if self.fmt == "preference":
            return self._pairs(rows)
        return self._chat(rows)

    def _text(self, rows: dict[str, list]) -> Unit:
        cfg, tok = self.cfg, self.tokenizer
        texts = rows.get(cfg.text_field) or []
        kept = [t for t in texts if isinstance(t, str) and t.strip()]
        counts = {"rows": len(texts), "empty": len(texts) - len(kept)}
        if not cfg.packing:  # the tutorial's rows: truncated to seq_length, with the tokenizer's special tokens
            ids = tok(kept, truncation=True, max_length=cfg.seq_length, return_attention_mask=False)["input_ids"]
            ids = [doc for doc in ids if len(doc) >= 2] if kept else []  # one token: nothing to predict
            counts["single_token"] = len(kept) - len(ids)
            return self._rows(ids, None, counts)
        ids = tok(kept, add_special_tokens=False, return_attention_mask=False)["input_ids"] if kept else []
        eos, seq = tok.eos_token_id, cfg.seq_length
        stream = np.fromiter(chain.from_iterable(doc + [eos] for doc in ids), dtype=np.int32)
        whole = len(stream) // seq * seq
        counts.update(documents=len(ids), tokens=whole, targets=whole, blocks=whole // seq, cut=len(stream) - whole)
        return Unit(tokens=np.ascontiguousarray(stream[:whole]), counts=counts)

    def _chat(self, rows: dict[str, list]) -> Unit:
        names = list(rows)
        n = len(rows[names[0]]) if names else 0
        given = [{name: rows[name][i] for name in names} for i in range(n)]
        encoded, truncated, dropped = [], 0, 0
        for ids, labels, ends in self.chat.many(given):
            kept = chat.fit(ids, labels, ends, self.cfg.seq_length)
            if kept is None:
                dropped += 1
                continue
            truncated += len(kept[0]) < len(ids)
            encoded.append(kept)
        # Rows whose answers are all empty (their only targets their end-of-turn tokens): a split of nothing else
        # is refused once prepared (app.data.pipeline), as the checks refuse the files they read.
        unanswered = 0 if self.cfg.train_on_prompt else sum(not chat.answered(row, self.fmt) for row in given)
        counts = {"rows": n, "too_long": dropped, "truncated": truncated, "unanswered": unanswered}
        if not self.cfg.packing:
            trainable = [(ids, labels) for ids, labels in encoded if sum(lab != -100 for lab in labels) >= 2]
            counts["single_token"] = len(encoded) - len(trainable)
            return self._rows([ids for ids, _ in trainable], [labels for _, labels in trainable], counts)
        order = chat.best_fit([len(ids) for ids, _ in encoded], self.cfg.seq_length)
        docs = [encoded[i] for members in order for i in members]
        unit = self._rows([ids for ids, _ in docs], [labels for _, labels in docs], counts)
        unit.blocks = np.cumsum([0] + [len(members) for members in order], dtype=np.int64)
        unit.counts["blocks"] = len(order)
        return unit

    def _pairs(self, rows: dict[str, list]) -> Unit:
        """Each pair two documents, chosen then rejected, kept together: packed, whole pairs per block (best fit
        decreasing over the pairs' lengths); unpacked, a pair's two documents are one sample."""
        names = list(rows)
        n = len(rows[names[0]]) if names else 0
        encoded, truncated, dropped = [], 0, 0
        for i in range(n):
            fitted = pairs.fit(
                *self.pairs({name: rows[name][i] for name in names}), self.cfg.seq_length, self.cfg.packing
            )
            if fitted is None:
                dropped += 1
                continue
            truncated += fitted[1]
            encoded.append(fitted[0])
        counts = {"rows": n, "too_long": dropped, "truncated": truncated, "pairs": len(encoded)}
        groups = (
            chat.best_fit([len(c[0]) + len(r[0]) for c, r in encoded], self.cfg.seq_length)
            if self.cfg.packing
            else None
        )
        docs = [doc for members in groups or [[i] for i in range(len(encoded))] for i in members for doc in encoded[i]]
        unit = self._rows([ids for ids, _ in docs], [labels for _, labels in docs], counts)
        if groups is not None:
            unit.blocks = np.cumsum([0] + [2 * len(members) for members in groups], dtype=np.int64)
        unit.counts["blocks"] = len(encoded) if groups is None else len(groups)
        return unit

    def _rows(self, ids: list[list[int]], labels: list[list[int]] | None, counts: dict[str, int]) -> Unit:
        """Documents one after the other, with their offsets and (chat) their target mask."""
        lengths = [len(doc) for doc in ids]
        tokens = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=sum(lengths))
        docs = np.cumsum([0, *lengths], dtype=np.int64)
        targets, count = None, len(tokens)
        if labels is not None:
            mask = np.fromiter((lab != -100 for lab in chain.from_iterable(labels)), dtype=bool, count=len(tokens))
            targets, count = np.packbits(mask), int(mask.sum())
        counts.update(documents=len(ids), tokens=len(tokens), targets=count, blocks=len(ids))
        return Unit(tokens=tokens, docs=docs, targets=targets, counts=counts)


def first_row_problem(cfg, fmt: str, first: dict[str, Any], tokenizer, locate: Callable[[int], str]):
    """A template whose own text the tokenizer does not have, judged on the split's first row (chat.markers_problem);
    None when it has it, or for text."""
    if fmt == "preference":
        if pairs.row_problem(first) is not None or (messages := pairs.first_messages(first)) is None:
            return None
    elif fmt == "text" or chat.row_problem(first, fmt) is not None or (turns := chat.conversation(first, fmt)) is None:
        return None
    else:
        messages = turns[0]
    template = chat.template_of(cfg, tokenizer)
    return chat.markers_problem(cfg, locate(first[chat.ROW]), messages, template, tokenizer)


def report(counts: dict[str, int], what: str, cfg) -> None:
    """One warning line per kind of row left out of a split (none when every row is in)."""
    if counts.get("empty"):
        log.warning(
            f"skipped {counts['empty']:,} of {counts['rows']:,} {what} rows whose '{cfg.text_field}' is empty or null"
        )
    cut, dropped = counts.get("truncated", 0), counts.get("too_long", 0)
    if "pairs" in counts and (cut or dropped):
        log.warning(
            f"{cut + dropped:,} of {counts['rows']:,} preference pairs are longer than data.seq_length="
            f"{cfg.seq_length}{' (both answers of a pair packed into one block)' if cfg.packing else ''}: {cut:,} "
            f"truncated from the end of the longer answer, {dropped:,} dropped (less than "
            f"{pairs.MIN_ANSWER_KEPT:.0%} of an answer would fit)"
        )
    elif cut or dropped:
        log.warning(
            f"{cut + dropped:,} of {counts['rows']:,} conversations are longer than data.seq_length={cfg.seq_length}: "
            f"{cut:,} truncated at a turn boundary, {dropped:,} dropped (not even their first target turn fits)"
        )
    if counts.get("unanswered"):
        log.warning(
            f"{counts['unanswered']:,} of {counts['rows']:,} {what} conversations have only empty answers: their "
            "only targets are the end-of-turn tokens"
        )
    if counts.get("single_token"):
        log.warning(f"skipped {counts['single_token']:,} {what} documents of a single token (nothing to predict)")
