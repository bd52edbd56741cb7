"""Chat and prompt/completion data: which format a dataset has, the chat templates the app ships, each row rendered
as `tokenizer.apply_chat_template` renders it, its label mask (the loss on assistant turns or the completion only),
truncation at a turn boundary, packing whole conversations, and the row checks that name the bad row.

A conversation's assistant spans come from the template's `{% generation %}` blocks when it has them, else from
rendering the conversation turn by turn (the text before an assistant turn, with the generation prompt, and the
text through it, are prefixes of the whole rendering). Tokens that overlap a span are targets; trailing whitespace
of a span is not, so each assistant turn's last target is its end-of-turn (or EOS) token.
"""

from __future__ import annotations

import bisect
import logging
import re
from typing import Any, Callable

from app.errors import Problem, _short

log = logging.getLogger("finetune")

FORMATS = ("text", "chat", "prompt_completion")
COLUMNS = {"text": (), "chat": ("messages",), "prompt_completion": ("prompt", "completion")}
ROLES = ("system", "user", "assistant", "tool")
ROW = "__source_row"  # each row's index in its split, kept through the eval split, for error messages
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

# For base models whose tokenizer has no template. Both mark the assistant turns with generation blocks.
TEMPLATES = {
    # ChatML (Qwen, many instruct models): needs <|im_start|> and <|im_end|> to be tokens of the tokenizer.
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Zephyr's layout: every turn ends with the tokenizer's EOS, so it fits any base model's vocabulary.
    "zephyr": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + eos_token + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


def resolve_format(fmt: str, columns: list[str]) -> str:
    """The format `data.format` means for a dataset with these columns (auto: chat, prompt_completion or text)."""
    if fmt != "auto":
        return fmt
    if "messages" in columns:
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    return "text"


# The version of the chat blocks in a tokenized cache: v2 packs best fit decreasing; v1 packed in order, and an
# experiment whose folder holds a v1 cache keeps it (app.data.cache_folder), so that its resume sees its blocks.
CACHE_VERSION, EARLIER_CACHE_VERSIONS = "chat-v2", ("chat-v1",)


def cache_fields(cfg, version: str = CACHE_VERSION) -> list[Any]:
    """What shapes tokenized chat data besides the text fields (nothing for text: its cache keys stay as they were)."""
    if cfg.format == "text":
        return []
    return [cfg.format, cfg.chat_template, cfg.train_on_prompt, version]


def template_of(cfg, tokenizer) -> str:
    """The Jinja template: data.chat_template (a shipped name or a template), else the tokenizer's own."""
    if cfg.chat_template:
        return TEMPLATES.get(cfg.chat_template, cfg.chat_template)
    if tokenizer.chat_template:
        return tokenizer.chat_template
    raise Problem(
        "data.chat_template",
        None,
        "the tokenizer has no chat template (a base model's)",
        f"set data.chat_template to one of {', '.join(TEMPLATES)} or to a Jinja template",
    )


def template_name(cfg) -> str:
    if not cfg.chat_template:
        return "the tokenizer's"
    return cfg.chat_template if cfg.chat_template in TEMPLATES else _short(cfg.chat_template)


# --- row checks -------------------------------------------------------------------------------------------------
def row_problem(row: dict[str, Any], fmt: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a row this format cannot train on, else None."""
    if fmt == "prompt_completion":
        for column in COLUMNS[fmt]:
            value = row.get(column)
            if value is None:
                return f"has no {column!r}", f"give every row a text {column!r}, or set data.format"
            if not isinstance(value, str):
                return f"{column!r} is {type(value).__name__} ({_short(value)}), not text", "write it as a string"
        if not row["completion"].strip():
            return "has an empty 'completion' (nothing to train on)", "fill it in, or remove the row"
        return None
    messages = row.get("messages")
    if messages is None:
        return "has no 'messages'", "give every row a 'messages' list of {role, content}, or set data.format"
    if not isinstance(messages, list):
        return f"'messages' is {type(messages).__name__}, not a list", "write 'messages' as a list of {role, content}"
    if not messages:
        return "has an empty conversation", "remove the row, or give it a user and an assistant turn"
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {n} is {type(message).__name__}, not a {{role, content}} mapping", "fix the row"
        if message.get("role") not in ROLES:
            return f"message {n} has role {message.get('role')!r}", f"use one of the roles {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            got = _short(message.get("content"))
            return f"message {n} ({message['role']}) has content {got}, not text", "write each content as a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant turn (nothing to train on)", "add the assistant's answer, or remove the row"
    return None


# --- rendering and masks ----------------------------------------------------------------------------------------
def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As apply_chat_template normalises them: keys whose value is None (columns other rows have) are dropped."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _render(messages, template: str, tokenizer, with_spans: bool = False, add_generation_prompt: bool = False):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(
        conversations=[messages],
        chat_template=template,
        return_assistant_tokens_mask=with_spans,
        add_generation_prompt=add_generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return rendered[0], (spans[0] if with_spans else None)


class TemplateError(Exception):
    """The template cannot render this conversation, or renders it so that the assistant turns cannot be found."""


def render_chat(messages: list[dict[str, Any]], template: str, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans of the assistant turns, trailing whitespace left out)."""
    messages = _plain(messages)
    try:
        if GENERATION.search(template):
            text, spans = _render(messages, template, tokenizer, with_spans=True)
        else:
            text, spans = _render(messages, template, tokenizer)[0], []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = _render(messages[:i], template, tokenizer, add_generation_prompt=True)[0]
                through = _render(messages[: i + 1], template, tokenizer)[0]
                if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                    raise TemplateError(
                        "it renders a conversation's first turns differently from the whole conversation, so the "
                        "assistant turns cannot be found; mark them with {% generation %} blocks"
                    )
                spans.append((len(before), len(through)))
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - Jinja's errors, and raise_exception() calls in the template
        raise TemplateError(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return text, [(lo, lo + len(text[lo:hi].rstrip())) for lo, hi in spans if text[lo:hi].strip()]


def _targets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> tuple[list[bool], list[int]]:
    """(whether each token overlaps an assistant span, the index after each span's last token)."""
    mask, ends, s = [False] * len(offsets), [], 0
    for t, (lo, hi) in enumerate(offsets):
        while s < len(spans) and lo >= spans[s][1]:
            s += 1
            ends.append(t)
        if s < len(spans) and hi > spans[s][0]:
            mask[t] = True
    ends += [len(offsets)] * (len(spans) - s)
    return mask, ends


def encode_chat(messages, template: str, tokenizer, train_on_prompt: bool) -> tuple[list[int], list[int], list[int]]:
    """(token ids, labels, the token index after each assistant turn: where a truncation may cut)."""
    text, spans = render_chat(messages, template, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, ends = _targets(enc["offset_mapping"], spans)
    ids = enc["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for end in ends:
        if end == 0 or ids[end - 1] not in special:
            last = tokenizer.decode(ids[max(0, end - 3) : end])
            raise TemplateError(
                f"an assistant turn ends with {last!r}, not with a special token (the template's end-of-turn "
                "token or EOS), so the model would not learn to stop; end each assistant turn with {{ eos_token }} "
                "or a special end-of-turn token of the tokenizer"
            )
    labels = [tok if (keep or train_on_prompt) else -100 for tok, keep in zip(ids, mask)]
    return ids, labels, ends


def unknown_markers(messages, template: str, tokenizer) -> list[str]:
    """The template's own text (role markers and the like: the conversation rendered with every content empty) that
    the tokenizer encodes as its unknown token, e.g. '<|user|>' for a word-level vocabulary without it. Every such
    marker becomes the same token, so the model cannot tell the turns apart; and where it is also the padding
    token, whose embedding row a freshly initialised model zeroes, a conversation that starts with it keeps an
    all-zero hidden state through every layer (it attends only to itself), where RMSNorm's gradient is
    1/sqrt(eps): the gradient grows by orders of magnitude per layer and overflows in a deep model."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    text = _render(_plain([{**m, "content": ""} for m in messages]), template, tokenizer)[0]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces = (text[lo:hi] for t, (lo, hi) in zip(enc["input_ids"], enc["offset_mapping"]) if t == unk)
    return sorted({piece for piece in pieces if piece != tokenizer.unk_token})


def markers_problem(cfg, where: str, messages, template: str, tokenizer) -> Problem | None:
    """data.chat_template's problem when the template's own text, rendered for the row at `where`, is not in the
    tokenizer's vocabulary (unknown_markers); None when it is, or when the row cannot be rendered (encode_chat
    names that)."""
    try:
        unknown = unknown_markers(messages, template, tokenizer)
    except Exception:  # noqa: BLE001 - Jinja's errors: encode_chat reports them with the row
        return None
    if not unknown:
        return None
    shown = ", ".join(repr(u) for u in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
    return Problem(
        "data.chat_template",
        template_name(cfg),
        f"renders {shown} for {where}, which the tokenizer does not have: each becomes its unknown token "
        f"{tokenizer.unk_token!r}, so the model cannot tell the turns apart (and where that token's embedding is "
        "zero, as a fresh model's padding row is, the gradients overflow)",
        "use a template whose markers are tokens of this tokenizer (a chat model's own template), or add them "
        "to the tokenizer and resize the model's embeddings",
    )


def encode_prompt_completion(prompt: str, completion: str, tokenizer, train_on_prompt: bool):
    """The prompt (with the tokenizer's own special tokens, e.g. BOS), the completion, then EOS: the target."""
    head = tokenizer(prompt)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels = (head if train_on_prompt else [-100] * len(head)) + tail
    return head + tail, labels, [len(head) + len(tail)]


def fit(ids: list[int], labels: list[int], ends: list[int], seq: int) -> tuple[list[int], list[int]] | None:
    """The conversation, or its longest prefix of whole turns through an assistant turn, within seq tokens; None
    when not even the first assistant turn fits."""
    if len(ids) <= seq:
        return ids, labels
    cut = max((e for e in ends if e <= seq), default=0)
    if cut == 0:
        return None
    return ids[:cut], labels[:cut]


# --- the dataset ------------------------------------------------------------------------------------------------
class Encoder:
    """Rows to (ids, labels, cut points), naming the source row of any bad one (a class: `datasets` pickles it for
    map's worker processes)."""

    def __init__(self, cfg, fmt: str, tokenizer, locate: Callable[[int], str]):
        self.fmt, self.tokenizer, self.locate, self.cfg = fmt, tokenizer, locate, cfg
        self.template = template_of(cfg, tokenizer) if fmt == "chat" else ""

    def __call__(self, row: dict[str, Any]):
        if (problem := row_problem(row, self.fmt)) is not None:
            raise Problem("data.dataset", self.locate(row[ROW]), *problem)
        if self.fmt == "prompt_completion":
            return encode_prompt_completion(row["prompt"], row["completion"], self.tokenizer, self.cfg.train_on_prompt)
        try:
            return encode_chat(row["messages"], self.template, self.tokenizer, self.cfg.train_on_prompt)
        except TemplateError as exc:
            raise render_problem(self.cfg, self.locate(row[ROW]), exc) from None


def tokenize(raw, tokenizer, cfg, fmt: str, locate: Callable[[int], str], num_proc: int | None):
    """Token ids and labels of chat or prompt/completion rows: packed (whole conversations per seq_length block,
    each with its own position ids, padding after the last) or padded one per row. Logs the rows truncated at a
    turn boundary and those dropped (not even one assistant turn fits). Refuses a template whose own text the
    tokenizer does not have (markers_problem, on the first row)."""
    encoder, seq = Encoder(cfg, fmt, tokenizer, locate), cfg.seq_length
    if fmt == "chat" and len(raw) and row_problem(raw[0], fmt) is None:
        first = raw[0]
        if problem := markers_problem(cfg, locate(first[ROW]), first["messages"], encoder.template, tokenizer):
            raise problem

    def encode(batch: dict[str, list]) -> dict[str, list]:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        out: dict[str, list] = {"input_ids": [], "labels": [], "cut": []}
        for row in rows:
            ids, labels, ends = encoder(row)
            kept = fit(ids, labels, ends, seq)
            out["input_ids"].append(kept[0] if kept else [])
            out["labels"].append(kept[1] if kept else [])
            out["cut"].append(0 if kept is None else int(len(kept[0]) < len(ids)))
        return out

    encoded = raw.map(encode, batched=True, remove_columns=raw.column_names, num_proc=num_proc, desc="render chat")
    cut = sum(encoded["cut"])
    kept = encoded.filter(lambda batch: [bool(x) for x in batch["input_ids"]], batched=True, desc="drop too long")
    if cut or len(kept) < len(encoded):
        log.warning(
            f"of {len(encoded):,} conversations longer than data.seq_length={seq}: {cut:,} truncated at a turn "
            f"boundary, {len(encoded) - len(kept):,} dropped (not even their first assistant turn fits)"
        )
    kept = kept.remove_columns("cut")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not cfg.packing:
        return kept.map(lambda b: pad_rows(b, seq, pad), batched=True, desc="pad")
    return kept.map(
        lambda b: pack_rows(b, seq, pad), batched=True, batch_size=4096, remove_columns=kept.column_names, desc="pack"
    )


def pad_rows(batch: dict[str, list], seq: int, pad: int) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        gap = seq - len(ids)
        out["input_ids"].append(ids + [pad] * gap)
        out["attention_mask"].append([1] * len(ids) + [0] * gap)
        out["labels"].append(labels + [-100] * gap)
    return out


def pack_rows(batch: dict[str, list], seq: int, pad: int) -> dict[str, list]:
    """Whole conversations into blocks of seq tokens (TRL's best-fit decreasing, over the map batch), the rest of a
    block padding (no loss). Position ids restart at 0 with each conversation (and the padding), which
    app.data.packed_batch turns into separate attention; no conversation's first token is a target (it would be
    predicted from the one before)."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in best_fit([len(ids) for ids in batch["input_ids"]], seq):
        ids = [t for i in members for t in batch["input_ids"][i]]
        labels = [t for i in members for t in [-100, *batch["labels"][i][1:]]]
        positions = [p for i in members for p in range(len(batch["input_ids"][i]))]
        gap = seq - len(ids)
        out["input_ids"].append(ids + [pad] * gap)
        out["labels"].append(labels + [-100] * gap)
        out["position_ids"].append(positions + list(range(gap)))
    return out


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of `capacity`: best fit decreasing (longest first, each into the bin with the
    least room that still holds it, a new bin when none does), which leaves a few percent of padding where
    packing in order leaves 15-20% (conversations of mixed lengths). Deterministic, ties in file order, so that a
    resumed run sees the same blocks; each bin lists its members in file order, and the bins come in the order of
    their first member, so that without data.shuffle the blocks still follow the file."""
    rooms: list[tuple[int, int]] = []  # (room left, bin), ascending: bisect finds the tightest fit
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, b = rooms.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room > n:
            bisect.insort(rooms, (room - n, b))
    return sorted((sorted(members) for members in bins), key=lambda members: members[0])


# --- before the cluster starts ----------------------------------------------------------------------------------
MAX_REPORTED = 3  # bad rows named at once: enough to see a pattern, few enough to read


def sample_problems(cfg, fmt: str, rows: list[tuple[str, dict[str, Any]]], tokenizer_of: Callable) -> list[Problem]:
    """The sampled rows (each with where it is) that this format cannot train on, then the first that the template
    cannot render, then whether the template's own text is in the tokenizer's vocabulary (markers_problem; with the
    tokenizer that `tokenizer_of()` loads; skipped when it cannot be loaded here)."""
    problems = []
    for where, row in rows:
        if (problem := row_problem(row, fmt)) is not None:
            problems.append(Problem("data.dataset", where, *problem))
            if len(problems) == MAX_REPORTED:
                break
    if problems or fmt != "chat" or not rows:
        return problems
    try:
        tokenizer = tokenizer_of()
    except Exception:  # noqa: BLE001 - e.g. a hub tokenizer out of reach from here: the run checks every row
        return []
    try:
        template = template_of(cfg, tokenizer)
        for where, row in rows:
            encode_chat(row["messages"], template, tokenizer, cfg.train_on_prompt)
    except Problem as problem:
        return [problem]
    except TemplateError as exc:
        return [render_problem(cfg, where, exc)]
    where, row = rows[0]
    problem = markers_problem(cfg, where, row["messages"], template, tokenizer)
    return [problem] if problem else []


def render_problem(cfg, where: str, exc: TemplateError) -> Problem:
    return Problem(
        "data.chat_template",
        template_name(cfg),
        f"cannot render {where}: {exc}",
        "fix the template or the row, or set data.chat_template to one of " + ", ".join(TEMPLATES),
    )
