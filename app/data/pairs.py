"""Preference pairs (`data.format: preference`, issue #51): a row is a prompt, a chosen and a rejected answer, in
TRL's forms: all three text (the prompt with the tokenizer's own BOS, each answer then EOS, as prompt/completion
text is encoded), or lists of messages (the prompt's turns, then each answer's assistant turns, rendered as one
conversation with the chat template by app.data.chat), or, without a prompt, two whole conversations that share
their first turns (TRL's implicit prompt: the shared turns are the prompt).

Each pair becomes two documents, chosen then rejected, whose targets are the answer's tokens only. A pair is one
unit of packing: packed, both documents go into the same block (so `seq_length` holds the prompt twice and both
answers); unpacked, each document is a row of its own and a sample is the pair's two rows. A pair longer than that
is cut from the end of its longer answer while at least MIN_ANSWER_KEPT of each answer stays, else it is dropped;
preparation counts both and logs them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from app.data import chat
from app.errors import Problem, _short

COLUMNS = ("prompt", "chosen", "rejected")
ANSWERS = ("chosen", "rejected")
# A cut answer keeps at least this share of its tokens: below it, the pair would be judged on the answers' first
# tokens only, which is not the preference the row states.
MIN_ANSWER_KEPT = 0.5
FORMS_FIX = (
    "write 'prompt', 'chosen' and 'rejected' all as text, or all as lists of {role, content} messages (or leave "
    "out 'prompt' and write chosen and rejected as whole conversations that share their prompt turns)"
)

Encoded = tuple[list[int], list[int]]  # (token ids, labels: -100 but on the answer's tokens)


def row_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a row that is no preference pair, else None."""
    for column in ANSWERS:
        if row.get(column) is None:
            return (
                f"has no {column!r}",
                "give every row a 'chosen' and a 'rejected' answer (and a 'prompt', unless both are conversations "
                "that share their prompt turns)",
            )
    prompt, chosen, rejected = (row.get(c) for c in COLUMNS)
    if isinstance(chosen, list) or isinstance(rejected, list):
        problem = _conversational_problem(row)
    else:
        problem = _text_problem(prompt, chosen, rejected)
    if problem is not None:
        return problem
    _, chosen, rejected = parts(row)
    if _plain(chosen) == _plain(rejected):
        return (
            "has the same 'chosen' and 'rejected' answer (nothing to prefer)",
            "remove the row, or give it the answer it should not prefer as 'rejected'",
        )
    return None


def _text_problem(prompt, chosen, rejected) -> tuple[str, str] | None:
    if prompt is None:
        return (
            "has no 'prompt'",
            "give every row a text 'prompt', or write chosen and rejected as whole conversations that share their "
            "prompt turns",
        )
    for column, value in zip(COLUMNS, (prompt, chosen, rejected)):
        if not isinstance(value, str):
            return f"{column!r} is {type(value).__name__} ({_short(value)}), not text", FORMS_FIX
    for column, value in zip(ANSWERS, (chosen, rejected)):
        if not value.strip():
            return f"has an empty {column!r} (no answer to compare)", "fill it in, or remove the row"
    return None


def _conversational_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    prompt, chosen, rejected = (row.get(c) for c in COLUMNS)
    if not (isinstance(chosen, list) and isinstance(rejected, list)) or not isinstance(prompt, (list, type(None))):
        got = ", ".join(f"{c!r} is {type(v).__name__}" for c, v in zip(COLUMNS, (prompt, chosen, rejected)))
        return f"mixes text and lists of messages ({got})", FORMS_FIX
    whole = [chat._role_content(m) for m in (prompt or []) + chosen + rejected]
    if problem := chat._messages_problem(whole) or chat._tools_problem(row.get(chat.TOOLS)):
        return problem
    _, chosen, rejected = parts(row)
    for column, answer in zip(ANSWERS, (chosen, rejected)):
        if not any(m.get("role") == "assistant" for m in answer):
            where = "after the turns it shares with the other answer" if prompt is None else "(nothing to compare)"
            return (
                f"{column!r} has no assistant turn {where}",
                "put each answer in an assistant turn" + (" after the shared prompt turns" if prompt is None else ""),
            )
        if not any(chat._says_something(m) for m in answer if m.get("role") == "assistant"):  # as text's empty one
            return f"{column!r} has only empty assistant turns (no answer to compare)", "fill it in, or remove the row"
    return None


def parts(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected): text as it is; lists of messages as {role, content} turns, and without a prompt,
    the turns both answers begin with as the prompt (TRL's maybe_extract_prompt)."""
    prompt, chosen, rejected = (row.get(c) for c in COLUMNS)
    if not isinstance(chosen, list):
        return prompt, chosen, rejected
    chosen = [chat._role_content(m) for m in chosen]
    rejected = [chat._role_content(m) for m in rejected]
    if prompt is not None:
        return [chat._role_content(m) for m in prompt], chosen, rejected
    shared = 0
    while shared < min(len(chosen), len(rejected)) and _plain(chosen[shared]) == _plain(rejected[shared]):
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _plain(value):
    """Messages compared as apply_chat_template reads them (keys whose value is None dropped); text as it is."""
    if isinstance(value, list):
        return chat._plain([m for m in value if isinstance(m, dict)])
    if isinstance(value, dict):
        return chat._plain([value])[0]
    return value


def encode(row: dict[str, Any], template: Callable[[], str], tokenizer) -> tuple[Encoded, Encoded]:
    """(chosen, rejected) of a row that passed row_problem, each (ids, labels) with labels on the answer only.
    `template()`: the chat template, asked for only by conversational rows. Raises chat.TemplateError."""
    prompt, chosen, rejected = parts(row)
    out = []
    for answer in (chosen, rejected):
        if isinstance(answer, str):
            ids, labels, _ = chat.encode_prompt_completion(prompt, answer, tokenizer, train_on_prompt=False)
        else:
            tools = row.get(chat.TOOLS)
            ids, labels, _ = chat.encode_chat(prompt + answer, template(), tokenizer, False, tools, len(prompt))
        out.append((ids, labels))
    return out[0], out[1]


def fit(chosen: Encoded, rejected: Encoded, seq: int, packed: bool) -> tuple[tuple[Encoded, Encoded], bool] | None:
    """The pair within `seq` tokens (packed: both documents together; else each on its own), cut from the end of
    the longer answer first, and whether an answer lost tokens; None when an answer would keep less than
    MIN_ANSWER_KEPT of its tokens (or none)."""
    lengths = (len(chosen[0]), len(rejected[0]))
    caps = _shares(lengths, seq) if packed else (seq, seq)
    out, cut = [], False
    for (ids, labels), cap in zip((chosen, rejected), caps):
        if len(ids) > cap:
            answer = sum(label != -100 for label in labels)
            kept = sum(label != -100 for label in labels[:cap])
            if kept < max(1, math.ceil(MIN_ANSWER_KEPT * answer)):
                return None
            ids, labels, cut = ids[:cap], labels[:cap], cut or kept < answer  # (a template's newline is no loss)
        out.append((ids, labels))
    return (out[0], out[1]), cut


def _shares(lengths: tuple[int, int], seq: int) -> tuple[int, int]:
    """Each document's room in a block of `seq` tokens: all it needs while both fit, else the shorter keeps what it
    needs up to half and the longer gets the rest."""
    if sum(lengths) <= seq:
        return lengths
    short = min(lengths)
    if short > seq // 2:
        return seq // 2, seq - seq // 2
    return (short, seq - short) if lengths[0] == short else (seq - short, short)


class Encoder:
    """Rows to (chosen, rejected), naming the source row of any bad one (a class: Ray Data's actors hold one)."""

    def __init__(self, cfg, tokenizer, locate: Callable[[int], str]):
        self.cfg, self.tokenizer, self.locate = cfg, tokenizer, locate
        self._template: str | None = None

    def template(self) -> str:
        if self._template is None:
            self._template = chat.template_of(self.cfg, self.tokenizer)
        return self._template

    def __call__(self, row: dict[str, Any]) -> tuple[Encoded, Encoded]:
        if (problem := row_problem(row)) is not None:
            raise Problem("data.dataset", self.locate(row[chat.ROW]), *problem)
        try:
            return encode(row, self.template, self.tokenizer)
        except chat.TemplateError as exc:
            raise chat.render_problem(self.cfg, self.locate(row[chat.ROW]), exc) from None


def first_messages(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The prompt and chosen answer of a conversational row that passed row_problem, for the template's checks;
    None for text."""
    prompt, chosen, _ = parts(row)
    return None if isinstance(chosen, str) else prompt + chosen


def sample_problems(cfg, rows: list[tuple[str, dict[str, Any]]], tokenizer_of: Callable) -> list[Problem]:
    """The sampled rows (each with where it is) that are no preference pair, then the first the template cannot
    render, then the template's markers (chat.markers_problem) and whether any sampled pair fits seq_length."""
    problems = []
    for where, row in rows:
        if (problem := row_problem(row)) is not None:
            problems.append(Problem("data.dataset", where, *problem))
            if len(problems) == chat.MAX_REPORTED:
                return problems
    if problems or not rows:
        return problems
    try:
        tokenizer = tokenizer_of()
    except Exception:  # noqa: BLE001 - e.g. a hub tokenizer out of reach from here: the run checks every row
        return []
    encoder = Encoder(cfg, tokenizer, lambda _: "")
    encoded = []
    for where, row in rows:
        try:
            encoded.append(encode(row, encoder.template, tokenizer))
        except Problem as problem:
            return [problem]
        except chat.TemplateError as exc:
            return [chat.render_problem(cfg, where, exc)]
    messages = next((m for _, row in rows if (m := first_messages(row)) is not None), None)
    if messages is not None and (
        problem := chat.markers_problem(cfg, rows[0][0], messages, encoder.template(), tokenizer)
    ):
        return [problem]
    return [problem] if (problem := fit_problem(cfg, encoded)) else []


def fit_problem(cfg, encoded: list[tuple[Encoded, Encoded]]) -> Problem | None:
    """None of the sampled pairs fits data.seq_length, not even cut (the whole split would likely be dropped)."""
    if not encoded or any(fit(c, r, cfg.seq_length, cfg.packing) is not None for c, r in encoded):
        return None
    need = min(_needed(c, r, cfg.packing) for c, r in encoded)
    room = "both sequences of a pair, packed into one block," if cfg.packing else "a prompt and half its answer"
    return Problem(
        "data.seq_length",
        cfg.seq_length,
        f"none of the {len(encoded)} sampled preference pairs fits: {room} need at least {need} tokens",
        f"set data.seq_length to at least {need}, or use shorter prompts",
    )


def _needed(chosen: Encoded, rejected: Encoded, packed: bool) -> int:
    """Tokens enough for fit() to keep the pair (each answer cut to MIN_ANSWER_KEPT of its tokens)."""
    least = []
    for ids, labels in (chosen, rejected):
        answer = sum(label != -100 for label in labels)
        keep = max(1, math.ceil(MIN_ANSWER_KEPT * answer))
        targets = [t for t, label in enumerate(labels) if label != -100]
        least.append(targets[keep - 1] + 1 if targets else len(ids))
    return 2 * max(least) if packed else max(least)  # packed: fit() splits a full block in halves


def format_problems(d, fmt: str, preference: bool) -> list[Problem]:
    """A source's format against the training config: preference pairs need `preference` and SFT data must not have
    it (each loss reads what the other data lacks); pairs train on their answers only, each kept from the other."""
    if preference and fmt != "preference":
        return [
            Problem(
                "data.dataset",
                d.dataset,
                f"is {fmt} data, not preference pairs ('prompt', 'chosen' and 'rejected' columns), which the "
                "training config's `preference` trains on",
                "point data.dataset at preference pairs (or set data.format: preference), or remove `preference` to "
                "fine-tune on this data",
            )
        ]
    if fmt != "preference":
        return []
    if not preference:
        return [
            Problem(
                "data.dataset",
                d.dataset,
                "holds preference pairs ('chosen' and 'rejected' columns), which supervised fine-tuning has no "
                "loss for",
                "set `preference` (e.g. --set preference.loss=sigmoid for DPO), or point data.dataset at SFT data",
            )
        ]
    found = []
    if d.train_on_prompt:
        found.append(
            Problem(
                "data.train_on_prompt",
                True,
                "preference pairs are scored on their answers only (ORPO's NLL reads the prompt by itself)",
                "remove data.train_on_prompt",
            )
        )
    if d.packing and not d.separate_documents:
        found.append(
            Problem(
                "data.separate_documents",
                False,
                "a packed pair's rejected answer would attend to its chosen one",
                "remove data.separate_documents (true), or set data.packing: false",
            )
        )
    return found
