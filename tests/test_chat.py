"""Chat and prompt/completion data: rendering as apply_chat_template does, the label mask of hand-made conversations
(packed and unpacked), truncation at a turn boundary, and bad rows refused with their file and line. No Ray."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
from conftest import REPO
from test_packing import per_token_losses
from transformers import AutoTokenizer

from app import data
from app.config import DataConfig, ModelConfig
from app.data import chat, checks
from app.errors import Problem
from app.model import load_model

EOS = "<|endoftext|>"  # the tiny tokenizer's EOS
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who won the match?"},
    {"role": "assistant", "content": "The home team."},
    {"role": "tool", "content": "score: 2-1"},
    {"role": "user", "content": "And the score?"},
    {"role": "assistant", "content": "Two to one."},
]
# The zephyr rendering of CONVERSATION, piece by piece: (text, whether its tokens are targets).
EXPECTED = [
    (f"<|system|>\nBe brief.{EOS}\n<|user|>\nWho won the match?{EOS}\n<|assistant|>\n", False),
    (f"The home team.{EOS}", True),
    (f"\n<|tool|>\nscore: 2-1{EOS}\n<|user|>\nAnd the score?{EOS}\n<|assistant|>\n", False),
    (f"Two to one.{EOS}", True),
    ("\n", False),
]
# The same layout without {% generation %} blocks: the mask then comes from rendering turn by turn.
PLAIN_ZEPHYR = chat.TEMPLATES["zephyr"].replace("{% generation %}", "").replace("{% endgeneration %}", "")


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def runs(tok, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """The tokens decoded in runs of equal target-ness."""
    pairs = [(i, lab != -100) for i, lab in zip(ids, labels) if i is not None]
    return [(tok.decode([i for i, _ in group]), keep) for keep, group in itertools.groupby(pairs, key=lambda p: p[1])]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenized(tok, tmp_path, rows, **cfg):
    cfg = DataConfig(dataset=write_jsonl(tmp_path / "chat.jsonl", rows), split="train", **cfg)
    return cfg, data.tokenize(data.load_split(cfg, cfg.split), tok, cfg)


@pytest.mark.parametrize("template", ["zephyr", PLAIN_ZEPHYR], ids=["generation-blocks", "turn-by-turn"])
def test_labels_are_the_assistant_turns_with_their_end_token(tok, template):
    ids, labels, ends = chat.encode_chat(CONVERSATION, chat.TEMPLATES.get(template, template), tok, False)
    assert (
        ids == tok.apply_chat_template(CONVERSATION, chat_template=chat.TEMPLATES.get(template, template))["input_ids"]
    )
    assert runs(tok, ids, labels) == EXPECTED
    assert [ids[e - 1] for e in ends] == [tok.eos_token_id] * 2  # each turn's last target is EOS
    _, everything, _ = chat.encode_chat(CONVERSATION, chat.TEMPLATES["zephyr"], tok, True)
    assert everything == ids  # train_on_prompt: every token


def test_prompt_completion_labels_are_the_completion_and_eos(tok):
    ids, labels, ends = chat.encode_prompt_completion("Q: who won?\nA:", " The home team.", tok, False)
    assert runs(tok, ids, labels) == [("Q: who won?\nA:", False), (f" The home team.{EOS}", True)]
    assert ends == [len(ids)] and chat.encode_prompt_completion("Q", " A", tok, True)[1][0] != -100


def test_format_auto_follows_the_columns():
    assert chat.resolve_format("auto", ["messages", "id"]) == "chat"
    assert chat.resolve_format("auto", ["prompt", "completion"]) == "prompt_completion"
    assert chat.resolve_format("auto", ["prompt", "text"]) == "text"
    assert chat.resolve_format("text", ["messages"]) == "text"


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_dataset_labels_keep_each_conversation_and_its_mask(tok, tmp_path, packing):
    second = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rows = [{"messages": CONVERSATION}, {"messages": second}, {"prompt": "x", "completion": "y"}]
    cfg, ds = tokenized(tok, tmp_path, rows[:2], seq_length=192, packing=packing, chat_template="zephyr")
    alone = [chat.encode_chat(r["messages"], chat.TEMPLATES["zephyr"], tok, False)[:2] for r in rows[:2]]
    if not packing:
        assert len(ds) == 2 and set(ds[0]) == {"input_ids", "attention_mask", "labels"}
        for row, (ids, labels) in zip(ds, alone):
            n = int(row["attention_mask"].sum())
            assert row["input_ids"][:n].tolist() == ids and row["labels"][:n].tolist() == labels
            assert (row["labels"][n:] == -100).all() and len(row["input_ids"]) == 192
        return
    # Both fit one block: each conversation from position 0, its labels intact (a start is never a target), padding
    # after them (no loss), and the collator's boundaries at each conversation's start.
    assert len(ds) == 1 and set(ds[0]) == {"input_ids", "labels", "position_ids"}
    batch = data.collator(cfg, tok)([ds[0]])
    n1, n2 = len(alone[0][0]), len(alone[1][0])
    assert batch["input_ids"][0, : n1 + n2].tolist() == alone[0][0] + alone[1][0]
    assert batch["position_ids"][0].tolist() == [*range(n1), *range(n2), *range(192 - n1 - n2)]
    assert batch["labels"][0].tolist() == alone[0][1] + [-100] + alone[1][1][1:] + [-100] * (192 - n1 - n2)
    assert batch["cu_seq_lens_q"].tolist() == [0, n1, n1 + n2, 192]
    assert runs(tok, batch["input_ids"][0, :n1].tolist(), batch["labels"][0, :n1].tolist()) == EXPECTED


def test_best_fit_fills_the_tightest_block_longest_first():
    # In order: [7] [5] [4,3] [6,2] [8] -> 5 blocks; best fit decreasing: 8+2, 7+3, 6+4, 5 -> 4 blocks.
    bins = chat.best_fit([7, 5, 4, 3, 6, 2, 8], 10)
    assert bins == [[0, 3], [1], [2, 4], [5, 6]]  # members in file order; blocks in the order of their first
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert chat.best_fit([7, 5, 4, 3, 6, 2, 8], 10) == bins  # deterministic: a resume sees the same blocks


def test_best_fit_pads_less_than_packing_in_order_on_mixed_lengths():
    lengths = [int(x) for x in torch.randint(20, 1500, (4096,), generator=torch.Generator().manual_seed(0))]
    bins = chat.best_fit(lengths, 2048)
    assert all(sum(lengths[i] for i in b) <= 2048 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    in_order, room = 0, 0
    for n in lengths:
        if n > room:
            in_order, room = in_order + 1, 2048
        room -= n
    used = sum(lengths) / (2048 * len(bins))
    assert used > 0.97 and len(bins) < 0.9 * in_order, (used, len(bins), in_order)


def test_packed_blocks_hold_whole_conversations_each_once(tok, tmp_path):
    rows = [json.loads(line) for line in (REPO / "examples/data/tiny-chat.jsonl").read_text().splitlines()]
    cfg, ds = tokenized(tok, tmp_path, rows, seq_length=256, chat_template="zephyr")
    alone = sorted(
        tuple(chat.fit(*chat.encode_chat(r["messages"], chat.TEMPLATES["zephyr"], tok, False), 256)[0]) for r in rows
    )
    found = []
    for block in ds:
        starts = [i for i, p in enumerate(block["position_ids"].tolist()) if p == 0] + [256]
        pieces = [block["input_ids"][a:b].tolist() for a, b in itertools.pairwise(starts)]
        real = pieces if block["labels"][starts[-2] :].ne(-100).any() else pieces[:-1]  # the padding's run
        found += [tuple(p) for p in real]
    assert sorted(found) == alone


def test_an_experiment_keeps_the_chat_cache_an_earlier_packing_wrote(tmp_path):
    cfg = DataConfig(dataset="chat.jsonl", format="chat", chat_template="zephyr")
    current = data.cache_folder(cfg, "tok", tmp_path, 0)
    earlier = tmp_path / f"tokenized-{data.cache_key(cfg, 'tok', cfg.split, 0, 'chat-v1')}"
    assert current != earlier
    earlier.mkdir()
    assert data.cache_folder(cfg, "tok", tmp_path, 0) == current  # not complete: not used
    (earlier / "done").write_text("ok\n")
    assert data.cache_folder(cfg, "tok", tmp_path, 0) == earlier
    current.mkdir()
    (current / "done").write_text("ok\n")
    assert data.cache_folder(cfg, "tok", tmp_path, 0) == current
    text = DataConfig(dataset="corpus.txt", format="text")
    assert data.cache_folder(text, "tok", tmp_path, 0).name == f"tokenized-{data.cache_key(text, 'tok', text.split, 0)}"


def test_packed_conversations_compute_what_each_computes_alone(tok, tiny_model, tmp_path):
    rows = [json.loads(line) for line in (REPO / "examples/data/tiny-chat.jsonl").read_text().splitlines()[:12]]
    cfg, ds = tokenized(tok, tmp_path, rows, seq_length=256, chat_template="zephyr")
    batch = data.collator(cfg, tok)([ds[i] for i in range(2)])
    model = load_model(ModelConfig(name_or_path=str(tiny_model)), {}, separate_documents=True).eval()
    packed = per_token_losses(model, batch)
    starts = (batch["position_ids"] == 0).nonzero().tolist() + [[r, 256] for r in range(2)]
    compared = 0
    for (row, lo), (row2, hi) in itertools.pairwise(sorted(starts)):
        if row != row2 or hi - lo < 2 or (batch["labels"][row, lo:hi] == -100).all():
            continue
        piece = {k: batch[k][row, lo:hi][None] for k in ("input_ids", "labels")}
        torch.testing.assert_close(packed[row, lo : hi - 1], per_token_losses(model, piece)[0], equal_nan=True)
        compared += 1
    assert compared >= 3


def test_long_conversations_are_cut_at_a_turn_boundary_or_dropped(tok, tmp_path, caplog):
    first_turn = chat.encode_chat(CONVERSATION, chat.TEMPLATES["zephyr"], tok, False)[2][0]  # through its EOS
    long_first = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    rows = [{"messages": CONVERSATION}, {"messages": long_first}]
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, ds = tokenized(tok, tmp_path, rows, seq_length=first_turn + 3, packing=False, chat_template="zephyr")
    assert len(ds) == 1  # the conversation whose first answer does not fit is dropped
    row = ds[0]
    assert int(row["attention_mask"].sum()) == first_turn  # cut after the first assistant turn's EOS
    assert runs(tok, row["input_ids"][:first_turn].tolist(), row["labels"][:first_turn].tolist()) == EXPECTED[:2]
    assert "1 truncated at a turn boundary, 1 dropped" in caplog.text


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


ASK = {"role": "user", "content": "Score of the home team?"}
TOOL_USE = [
    ASK,
    {"role": "assistant", "content": None, "tool_calls": [call("get_score", '{"team": "home"}')]},
    {"role": "tool", "content": "2-1"},
    {"role": "assistant", "content": "Two to one."},
]
SCHEMA = {"type": "object", "properties": {"team": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_score", "description": "The score", "parameters": SCHEMA}}]


@pytest.mark.parametrize("template", ["zephyr", PLAIN_ZEPHYR], ids=["generation-blocks", "turn-by-turn"])
def test_tool_calls_are_targets_and_tool_results_and_schemas_are_not(tok, template):
    """The assistant's call (its arguments' JSON text parsed, as templates take them) is a target through its end
    token; the tools' schemas (in the template's first turn) and the tool's result are not."""
    template = chat.TEMPLATES.get(template, template)
    ids, labels, ends = chat.encode_chat(TOOL_USE, template, tok, False, TOOLS)
    parsed = [*TOOL_USE[:1], {**TOOL_USE[1], "content": "", "tool_calls": [call("get_score", {"team": "home"})]}]
    assert ids == tok.apply_chat_template([*parsed, *TOOL_USE[2:]], tools=TOOLS, chat_template=template)["input_ids"]
    seen = runs(tok, ids, labels)
    assert [text for text, target in seen if target] == [
        f'<tool_call>\n{{"name": "get_score", "arguments": {{"team": "home"}}}}\n</tool_call>{EOS}',
        f"Two to one.{EOS}",
    ]
    assert '"description": "The score"' in seen[0][0] and not seen[0][1]
    assert [ids[e - 1] for e in ends] == [tok.eos_token_id] * 2


# Qwen3's own template has no generation blocks, and renders an answer's think block only after the last user
# query (on the last answer, or one with reasoning): this is it (the shipped qwen3 without its blocks renders every
# conversation as Qwen3's template does, text for text).
PLAIN_QWEN3 = chat.TEMPLATES["qwen3"].replace("{% generation %}", "").replace("{% endgeneration %}", "")
QWEN3_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who won?"},
    {"role": "assistant", "content": "<think>\nThe log says home.\n</think>\n\nThe home team."},
    {"role": "user", "content": "Score?"},
    {"role": "assistant", "content": None, "tool_calls": [call("get_score", {"team": "home"})]},
    {"role": "tool", "content": "2-1"},
    {"role": "assistant", "content": "Two to one.", "reasoning_content": "From the tool."},
]


@pytest.fixture(scope="module")
def qwen_tok(tiny_model):
    """The tiny tokenizer with Qwen3's turn markers as special tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


@pytest.mark.parametrize("template", [PLAIN_QWEN3, "qwen3"], ids=["qwen3s-own", "shipped-qwen3"])
def test_qwen3_conversations_train_on_each_answer_as_qwen3_renders_it(qwen_tok, template):
    """Qwen3's template shows an earlier answer without its reasoning and the last with it, so its turns cannot be
    found one by one; the masks then come from the shipped qwen3, whose text is the same."""
    template = chat.TEMPLATES.get(template, template)
    plain, tools = chat._plain(QWEN3_TURNS), chat._tools(TOOLS)
    own_text = chat._render(plain, PLAIN_QWEN3, qwen_tok, tools)[0]
    assert chat._turn_by_turn(plain, PLAIN_QWEN3, qwen_tok, tools, own_text) is None  # the first answer differs
    assert chat._turn_by_turn(
        plain[:3], PLAIN_QWEN3, qwen_tok, tools, chat._render(plain[:3], PLAIN_QWEN3, qwen_tok, tools)[0]
    )
    ids, labels, ends = chat.encode_chat(QWEN3_TURNS, template, qwen_tok, False, TOOLS)
    assert ids == qwen_tok.apply_chat_template(QWEN3_TURNS, tools=TOOLS, chat_template=PLAIN_QWEN3)["input_ids"]
    seen = runs(qwen_tok, ids, labels)
    assert [text for text, target in seen if target] == [
        "The home team.<|im_end|>",
        '<tool_call>\n{"name": "get_score", "arguments": {"team": "home"}}\n</tool_call><|im_end|>',
        "<think>\nFrom the tool.\n</think>\n\nTwo to one.<|im_end|>",
    ]
    assert "# Tools" in seen[0][0] and "<think>\nThe log says home." not in qwen_tok.decode(ids)
    assert len(ends) == 3


def test_a_qwen3_tokenizers_own_template_passes_the_checks_and_tokenizes(qwen_tok, tmp_path):
    """A Qwen3 model's data as a run sees it: the tokenizer's own template (data.chat_template unset), checked on
    the sampled rows before the cluster, then tokenized with the same labels as encode_chat's."""
    import copy

    own = copy.deepcopy(qwen_tok)
    own.chat_template = PLAIN_QWEN3
    rows = [{"messages": QWEN3_TURNS, "tools": json.dumps(TOOLS)}, {"messages": CONVERSATION[:3]}]
    assert chat.sample_problems(DataConfig(dataset="x"), "chat", [("line 1", r) for r in rows], lambda: own) == []
    cfg, out = tokenized(own, tmp_path, rows, packing=False, seq_length=1024)
    for row, tokens in zip(rows, out):
        ids, labels, _ = chat.encode_chat(row["messages"], PLAIN_QWEN3, own, False, row.get("tools"))
        assert tokens["input_ids"][: len(ids)].tolist() == ids and tokens["labels"][: len(ids)].tolist() == labels


def test_a_template_that_renders_turns_differently_and_like_no_shipped_one_is_refused(qwen_tok):
    almost_qwen3 = PLAIN_QWEN3.replace("</think>\\n\\n", "</think>\\n")
    assert almost_qwen3 != PLAIN_QWEN3
    with pytest.raises(chat.TemplateError, match="renders a conversation's first turns differently"):
        chat.encode_chat(QWEN3_TURNS, almost_qwen3, qwen_tok, False, TOOLS)


def test_tool_rows_from_parquet_render_as_written(tok, tmp_path, tiny_model):
    """A parquet file (the hub's format) gives every row's arguments and schemas the keys of all rows, the missing
    ones null (and orders an object's keys as the first row that has them: the rows here share one order): the
    rows render as they were written, nulls dropped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    other = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    weather = [{"type": "function", "function": {"name": "forecast", "description": "Rain", "parameters": other}}]
    asked = [{"role": "user", "content": "Rain in Oslo?"}]
    rows = [
        {"messages": [*asked, {"role": "assistant", "tool_calls": [call("forecast", {"city": "Oslo", "days": 2})]}]},
        {"messages": [ASK, {"role": "assistant", "tool_calls": [call("get_score", {"team": "home"})]}]},
    ]
    rows = [{**rows[0], "tools": weather}, {**rows[1], "tools": TOOLS}]
    path = tmp_path / "tools.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = DataConfig(dataset=str(path), split="train", seq_length=512, packing=False, chat_template="zephyr")
    loaded = data.load_split(cfg, cfg.split)
    assert loaded[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]["days"] is None  # what parquet gives
    ds = data.tokenize(loaded, tok, cfg)
    for row, written in zip(ds, rows):
        ids, labels, _ = chat.encode_chat(written["messages"], chat.TEMPLATES["zephyr"], tok, False, written["tools"])
        assert row["input_ids"][: len(ids)].tolist() == ids and row["labels"][: len(ids)].tolist() == labels
    assert "null" not in tok.decode(ds[1]["input_ids"]) and '"arguments": {"team": "home"}' in tok.decode(
        ds[1]["input_ids"]
    )
    assert data.check_source(cfg, ModelConfig(name_or_path=str(tiny_model))) == []


def test_a_template_that_drops_tool_use_is_refused_with_the_row(tmp_path, tiny_model):
    no_tools = chat.TEMPLATES["zephyr"].replace("{% for call in message['tool_calls'] or [] %}", "{% for call in [] %}")
    model = ModelConfig(name_or_path=str(tiny_model))
    for rows, says in [
        ([{"messages": TOOL_USE}], "message 1's call to 'get_score' is not in its rendering"),
        ([{"messages": CONVERSATION, "tools": TOOLS}], "the tool 'get_score' is not in its rendering"),
    ]:
        path = write_jsonl(tmp_path / "chat.jsonl", rows)
        template = no_tools if "tools" not in rows[0] else PLAIN_ZEPHYR.replace("{% if tools %}", "{% if false %}")
        problems = data.check_source(DataConfig(dataset=path, split="train", chat_template=template), model)
        assert [(p.field, p.message.split(": ", 1)[0]) for p in problems] == [
            ("data.chat_template", f"cannot render {path} line 1")
        ], problems
        assert says in problems[0].message, problems[0]
        assert data.check_source(DataConfig(dataset=path, split="train", chat_template="zephyr"), model) == []


def test_conversational_prompt_completion_trains_on_the_completion_only(tok, tmp_path):
    """TRL's conversational prompt/completion: one conversation whose targets are the completion's assistant turns,
    not an example answer inside the prompt."""
    prompt = [*CONVERSATION[:3], {"role": "user", "content": "And the score?"}]
    completion = [{"role": "assistant", "content": "Two to one."}]
    rows = [{"prompt": prompt, "completion": completion}]
    _, ds = tokenized(tok, tmp_path, rows, seq_length=192, packing=False, chat_template="zephyr")
    n = int(ds[0]["attention_mask"].sum())
    seen = runs(tok, ds[0]["input_ids"][:n].tolist(), ds[0]["labels"][:n].tolist())
    assert [text for text, target in seen if target] == [f"Two to one.{EOS}"]
    assert "".join(text for text, _ in seen) == tok.decode(
        tok.apply_chat_template(prompt + completion, chat_template=chat.TEMPLATES["zephyr"])["input_ids"]
    )
    _, everything = tokenized(
        tok, tmp_path, rows, seq_length=192, packing=False, chat_template="zephyr", train_on_prompt=True
    )
    assert everything[0]["labels"][:n].tolist() == ds[0]["input_ids"][:n].tolist()
    # A tools column goes to the template as with chat rows.
    called = [ASK, {"role": "assistant", "tool_calls": [call("get_score", {"team": "home"})]}]
    encoder = chat.Encoder(DataConfig(chat_template="zephyr"), "prompt_completion", tok, str)
    ids, labels, _ = encoder({"prompt": called[:1], "completion": called[1:], "tools": TOOLS, chat.ROW: 0})
    assert (ids, labels) == chat.encode_chat(called, chat.TEMPLATES["zephyr"], tok, False, TOOLS)[:2]
    first_target = next(i for i, label in enumerate(labels) if label != -100)
    assert '"name": "get_score", "description"' in tok.decode(ids[:first_target])  # the schema, before the call


def test_text_parts_train_as_their_joined_text(tok):
    """Content as a list of text parts (OpenAI's form) renders as the joined text (parquet's null 'image' keys
    of other rows' parts dropped); any other part is refused."""
    parts = [
        {
            **m,
            "content": [
                {"type": "text", "text": m["content"][:3], "image": None},
                {"type": "text", "text": m["content"][3:]},
            ],
        }
        for m in CONVERSATION
    ]
    zephyr = chat.TEMPLATES["zephyr"]
    assert chat.encode_chat(parts, zephyr, tok, False) == chat.encode_chat(CONVERSATION, zephyr, tok, False)
    assert chat.row_problem({"messages": parts}, "chat") is None
    image = [{"type": "image", "image": "x.png"}]
    problem = chat.row_problem({"messages": [{"role": "user", "content": image}, CONVERSATION[2]]}, "chat")
    assert problem and "has content [{'type': 'image'" in problem[0], problem


SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}


def sharegpt(messages: list[dict]) -> list[dict]:
    """The same turns as ShareGPT writes them (LLaMA-Factory's function_call: the call's JSON as the value)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            value = json.dumps([c["function"] for c in m["tool_calls"]])
            out.append({"from": "function_call", "value": value})
        else:
            out.append({"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]})
    return out


def test_sharegpt_rows_train_as_their_chat_form(tok, tmp_path):
    """axolotl's and LLaMA-Factory's ShareGPT rows (`conversations` of {from, value}; function_call and
    observation for tool use, `tools` as JSON text) give the tokens and labels of the same chat rows."""
    rows = [
        {"conversations": sharegpt(CONVERSATION)},
        {"conversations": sharegpt(TOOL_USE), "tools": json.dumps(TOOLS)},
    ]
    assert chat.resolve_format("auto", ["conversations", "tools"]) == "chat"
    _, ds = tokenized(tok, tmp_path, rows, seq_length=512, packing=False, chat_template="zephyr")
    expected = [(CONVERSATION, None), (TOOL_USE, TOOLS)]
    for row, (messages, tools) in zip(ds, expected):
        ids, labels, _ = chat.encode_chat(messages, chat.TEMPLATES["zephyr"], tok, False, tools)
        assert row["input_ids"][: len(ids)].tolist() == ids and row["labels"][: len(ids)].tolist() == labels
        assert int(row["attention_mask"].sum()) == len(ids)


def test_alpaca_and_dolly_rows_train_as_their_chat_form(tok, tmp_path):
    """Alpaca's (instruction, input, output) and Dolly's (instruction, context, response) columns, with format auto:
    a user turn of the instruction and its input after a blank line (no blank line without input), the answer an
    assistant turn (the only targets), after a system turn when the row has one."""
    rows = [
        {"instruction": "Who won?", "input": "Home 2, away 1.", "output": "The home team.", "system": "Be brief."},
        {"instruction": "Name a colour.", "input": "", "output": "Red.", "system": None},
    ]
    assert chat.resolve_format("auto", ["instruction", "input", "output"]) == "chat"
    assert chat.resolve_format("auto", ["instruction", "context", "response", "category"]) == "chat"
    assert chat.resolve_format("auto", ["instruction", "text"]) == "text"  # no answer column: not Alpaca's
    # tatsu-lab/alpaca's columns: its text column (Alpaca's own prompt) trains as before; format chat reads the rest
    assert chat.resolve_format("auto", ["instruction", "input", "output", "text"]) == "text"
    assert chat.resolve_format("auto", ["instruction", "output", "text"], text_field="prompt") == "chat"
    expected = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who won?\n\nHome 2, away 1."},
            {"role": "assistant", "content": "The home team."},
        ],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}],
    ]
    dolly = [{"instruction": r["instruction"], "context": r["input"], "response": r["output"]} for r in rows[1:]]
    for given, wanted in [(rows, expected), (dolly, expected[1:])]:
        cfg, ds = tokenized(tok, tmp_path, given, seq_length=512, packing=False, chat_template="zephyr")
        assert data.check_source(cfg) == []
        for row, messages in zip(ds, wanted, strict=True):
            ids, labels, _ = chat.encode_chat(messages, chat.TEMPLATES["zephyr"], tok, False)
            assert row["input_ids"][: len(ids)].tolist() == ids and row["labels"][: len(ids)].tolist() == labels


BAD_ROWS = [
    ({"text": "no messages"}, "has no 'messages'"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "message 0 has role 'bot'"),
    ({"messages": [{"role": "user", "content": ["a", "list"]}]}, "has content ['a', 'list'], not text"),
    ({"messages": []}, "has an empty conversation"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
    ({"messages": [{**ASK, "tool_calls": [call("f", {})]}]}, "message 0 (user) has tool_calls"),
    ({"messages": [ASK, {"role": "assistant", "tool_calls": [{"function": {}}]}]}, "without a function name"),
    ({"messages": [ASK, {"role": "assistant", "tool_calls": [call("f", "{oops")]}]}, "with arguments '{oops'"),
    ({"messages": [ASK, {"role": "assistant", "content": None}]}, "message 1 (assistant) has content None"),
    ({"messages": TOOL_USE, "tools": "[{"}, "which is not JSON"),
    ({"messages": TOOL_USE, "tools": [{"type": "function"}]}, "not a list of function schemas with names"),
    ({"prompt": [ASK], "completion": "Two."}, "'prompt' is list, 'completion' str"),
    ({"prompt": [ASK], "completion": [{"role": "user", "content": "?"}]}, "no assistant turn in 'completion'"),
    ({"conversations": [{"from": "bot", "value": "hi"}]}, "message 0 has role 'bot'"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{oops"}]}, "'{oops'"),
    ({"instruction": "Add 2 and 2.", "input": "", "output": 4}, "message 1 (assistant) has content 4, not text"),
    ({"instruction": "Add 2 and 2.", "input": "", "output": None}, "has no assistant turn"),
]
BAD_IDS = ["no-messages", "role", "content", "empty", "no-assistant", "call-by-user", "call-name", "arguments"]
BAD_IDS += ["no-content", "tools-json", "tools-names", "mixed-prompt-completion", "completion-no-assistant"]
BAD_IDS += ["sharegpt-from", "sharegpt-call", "alpaca-output", "alpaca-no-output"]


@pytest.mark.parametrize("row,message", BAD_ROWS, ids=BAD_IDS)
def test_bad_rows_are_refused_before_the_cluster_with_file_and_line(tmp_path, tiny_model, row, message):
    conversational = "prompt" in row
    good = {"prompt": [ASK], "completion": [CONVERSATION[2]]} if conversational else {"messages": CONVERSATION}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, row])
    fmt = "prompt_completion" if conversational else "chat"
    cfg = DataConfig(dataset=path, split="train", format=fmt, chat_template="zephyr")
    problems = data.check_source(cfg, ModelConfig(name_or_path=str(tiny_model)))
    assert [(p.field, p.value) for p in problems] == [("data.dataset", f"{path} line 3")], problems
    assert message in problems[0].message and problems[0].fix


EMPTY_ANSWER = {"messages": [CONVERSATION[1], {"role": "assistant", "content": ""}]}


def _written(kind: str, folder, rows) -> str:
    """`rows` as a data source of the kind: JSON Lines (gzipped too), parquet, or a save_to_disk folder."""
    import gzip

    import datasets

    if kind == "saved":
        datasets.Dataset.from_list(rows).save_to_disk(str(folder / "saved"))
        return str(folder / "saved")
    if kind == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "chat.parquet"))
        return str(folder / "chat.parquet")
    path = write_jsonl(folder / "chat.jsonl", rows)
    if kind == "jsonl.gz":
        (folder / "chat.jsonl.gz").write_bytes(gzip.compress((folder / "chat.jsonl").read_bytes()))
        (folder / "chat.jsonl").unlink()
        return str(folder / "chat.jsonl.gz")
    return path


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "saved"])
def test_answers_that_start_past_the_sample_are_found_and_none_at_all_is_refused(tmp_path, tiny_model, kind):
    """Empty answers in every sampled row are no proof that the set has none: the checks read on, to the first
    row with an answer (accepted), or to the end (refused, naming every row read); with data.train_on_prompt the
    prompts are targets, so nothing is refused."""
    model = ModelConfig(name_or_path=str(tiny_model))
    empty = [EMPTY_ANSWER] * (checks.SAMPLE_ROWS + 5)
    late = tmp_path / "late"
    late.mkdir()
    cfg = DataConfig(dataset=_written(kind, late, [*empty, {"messages": CONVERSATION}]), chat_template="zephyr")
    assert data.check_source(cfg, model) == []
    none = tmp_path / "none"
    none.mkdir()
    cfg = DataConfig(dataset=_written(kind, none, empty), chat_template="zephyr")
    problems = data.check_source(cfg, model)
    assert [(p.field, p.value) for p in problems] == [("data.dataset", cfg.dataset)], problems
    assert f"every assistant answer in all {len(empty):,} rows is empty" in problems[0].message
    assert "data.train_on_prompt=true" in problems[0].fix
    assert data.check_source(cfg.model_copy(update={"train_on_prompt": True}), model) == []


def test_an_answer_is_text_reasoning_or_a_tool_call_in_any_form():
    """What counts as an answer (chat.answered), in each form a row comes in: the empty ones have only their
    end-of-turn token as a target."""
    ask = CONVERSATION[1]
    for row, fmt, answered in [
        ({"messages": [ask, {"role": "assistant", "content": "Yes."}]}, "chat", True),
        ({"messages": [ask, {"role": "assistant", "content": " \n"}]}, "chat", False),
        ({"messages": [ask, {"role": "assistant", "content": [{"type": "text", "text": ""}]}]}, "chat", False),
        ({"messages": [ask, {"role": "assistant", "content": "", "reasoning_content": "Hm."}]}, "chat", True),
        ({"messages": [ask, {"role": "assistant", "content": None, "tool_calls": [call("f", {})]}]}, "chat", True),
        (
            {"messages": [ask, {"role": "assistant", "content": ""}, ask, {"role": "assistant", "content": "Ok"}]},
            "chat",
            True,
        ),
        ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": ""}]}, "chat", False),
        ({"instruction": "Say hi.", "output": ""}, "chat", False),
        (
            {
                "prompt": [ask, {"role": "assistant", "content": "Yes."}],
                "completion": [{"role": "assistant", "content": ""}],
            },
            "prompt_completion",
            False,
        ),
        ({"prompt": "Q:", "completion": "A."}, "prompt_completion", True),
    ]:
        assert chat.row_problem(row, fmt) is None, row
        assert chat.answered(row, fmt) is answered, row


def test_a_template_that_fails_is_refused_with_the_row(tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    model = ModelConfig(name_or_path=str(tiny_model))
    failing = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}"
    for template, says in [(failing, "no tools"), ("chatml", "not with a special token"), (None, "no chat template")]:
        problems = data.check_source(DataConfig(dataset=path, split="train", chat_template=template), model)
        assert len(problems) == 1 and problems[0].field == "data.chat_template", problems
        assert says in problems[0].message, problems[0]
    assert data.check_source(DataConfig(dataset=path, split="train", chat_template="zephyr"), model) == []


def word_level_tokenizer(folder, words: list[str]):
    """A word-level tokenizer of `words` whose unknown token is its EOS (the padding token too), saved to `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate([EOS, *words])}, unk_token=EOS))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token=EOS, unk_token=EOS, pad_token=EOS)
    tok.save_pretrained(folder)
    return tok


def test_a_template_whose_markers_the_tokenizer_lacks_is_refused(tmp_path):
    """Zephyr's '<|user|>' etc. through a word-level vocabulary without them: each would be the unknown token, which
    is the padding token here, whose embedding a fresh model zeroes; conversations that start with it gave every
    1.1B chat step a non-finite gradient. Refused before the cluster and at the run; with the markers, trained."""
    words = "Be brief. Who won the match? The home team. score: 2-1 And score? Two to one.".split()
    conversation = [m for m in CONVERSATION if m["role"] != "tool"]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 3)
    cfg = DataConfig(dataset=path, split="train", chat_template="zephyr", packing=False)
    lacking = word_level_tokenizer(tmp_path / "lacking", words)
    problems = data.check_source(cfg, ModelConfig(name_or_path=str(tmp_path / "lacking")))
    assert [(p.field, p.value) for p in problems] == [("data.chat_template", "zephyr")], problems
    message = problems[0].message
    assert f"{path} line 1" in message and "'<|assistant|>', '<|system|>', '<|user|>'" in message, message
    with pytest.raises(Problem) as caught:
        data.tokenize(data.load_split(cfg, cfg.split), lacking, cfg)
    assert "which the tokenizer does not have" in caught.value.message and caught.value.fix
    having = word_level_tokenizer(tmp_path / "having", [*words, "<|system|>", "<|user|>", "<|assistant|>"])
    assert data.check_source(cfg, ModelConfig(name_or_path=str(tmp_path / "having"))) == []
    assert len(data.tokenize(data.load_split(cfg, cfg.split), having, cfg)) == 3


def test_lora_target_modules_the_model_lacks_are_refused_before_the_cluster(tiny_model, tmp_path):
    from app import driver
    from app.config import ConfigError, parse, resolve

    doc = {"model": {"name_or_path": str(tiny_model), "lora": {"target_modules": ["q_proj"]}}}
    doc |= {"scaling": {"use_gpu": False}, "data": {"seq_length": 128}, "experiment": {"storage_path": str(tmp_path)}}
    with pytest.raises(ConfigError) as caught:
        driver.check(resolve(parse(doc)))
    problem = next(p for p in caught.value.problems if p.field == "model.lora.target_modules")
    assert "no module named 'q_proj'" in problem.message and "c_attn" in problem.fix
    doc["model"]["lora"] = {"target_modules": "auto"}
    assert not any(p.field.startswith("model.lora") for p in _problems(driver, parse, resolve, doc))


def _problems(driver, parse, resolve, doc):
    from app.config import ConfigError

    try:
        driver.check(resolve(parse(doc)))
    except ConfigError as exc:
        return exc.problems
    return []
