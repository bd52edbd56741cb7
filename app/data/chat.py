"""Chat and prompt/completion data: which format a dataset has, the chat templates the app ships, each row rendered
as `tokenizer.apply_chat_template` renders it, its label mask (the loss on assistant turns or the completion only),
truncation at a turn boundary, packing whole conversations, and the row checks that name the bad row.

A conversation's assistant spans come from the template's `{% generation %}` blocks when it has them, else from
rendering the conversation turn by turn (the text before an assistant turn, with the generation prompt, and the
text through it, are prefixes of the whole rendering). Tokens that overlap a span are targets; trailing whitespace
of a span is not, so each assistant turn's last target is its end-of-turn (or EOS) token.

Tool use is data like any other turn: an assistant turn's `tool_calls` (OpenAI's and Hugging Face's
`{"type": "function", "function": {"name", "arguments"}}`) are targets, `tool` turns are not, and a `tools` column
(the function schemas) goes to the template as apply_chat_template's `tools`. A template that drops the calls or
the schemas is refused, as the model would learn calls it never sees. Prompt/completion rows whose prompt and
completion are lists of messages (TRL's conversational form) render as one conversation whose targets are the
completion's assistant turns. ShareGPT rows (a `conversations` column of `{from, value}` turns, as axolotl and
LLaMA-Factory datasets have them: human, gpt, system, function_call, observation) are chat rows too, and so are
Alpaca's and Dolly's instruction columns (a user turn and the answer).
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from typing import Any, Callable

from app.errors import Problem, _short

log = logging.getLogger("finetune")

FORMATS = ("text", "chat", "prompt_completion", "preference")
# The columns a format reads: a chat row's turns are in the first of its columns that the row has. Preference pairs
# are app.data.pairs'.
COLUMNS = {
    "text": (),
    "chat": ("messages", "conversations"),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
}
# ShareGPT's speakers as roles; function_call is an assistant turn whose value is the call's JSON.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", "function_call": "assistant"}
# Alpaca's columns (instruction, input, output) and Dolly's (instruction, context, response) are a chat row too: a
# user turn (the instruction, then the input after a blank line when there is one) and the assistant's answer,
# after a system turn when the row has a `system` column (LLaMA-Factory reads Alpaca data the same way).
INSTRUCTION, INSTRUCTION_INPUTS, INSTRUCTION_ANSWERS = "instruction", ("input", "context"), ("output", "response")
INSTRUCTION_COLUMNS = (INSTRUCTION, *INSTRUCTION_INPUTS, *INSTRUCTION_ANSWERS, "system")
TOOLS = "tools"  # an optional column of conversations: the function schemas the template shows the model
ROLES = ("system", "user", "assistant", "tool")
ROW = "__source_row"  # each row's index in its split, kept through the eval split, for error messages
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _layout(opening, end: str) -> str:
    """A template of the app's: each turn `opening(role)` (a Jinja expression), its content, `end` (a Jinja
    expression: the end-of-turn token); the assistant's turns in generation blocks. Tool use as Qwen2.5 and Hermes
    write it: the schemas in a first system turn, each call after the assistant's text as
    <tool_call>{"name": ..., "arguments": ...}</tool_call>, tool results as turns of role tool. Without tools or
    calls nothing of that is rendered."""
    tools = (
        "{% if tools %}{{ " + opening("'system'") + " + 'You can call these functions; write each call as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\n<tools>\n\' }}{% for tool in tools %}'
        "{{ tool | tojson + '\n' }}{% endfor %}{{ '</tools>' + " + end + " + '\n' }}{% endif %}"
    )
    calls = (
        "{% for call in message['tool_calls'] or [] %}{{ '<tool_call>\n' + ({'name': call['function']['name'], "
        "'arguments': call['function']['arguments']} | tojson) + '\n</tool_call>' }}{% endfor %}"
    )
    return (
        tools + "{% for message in messages %}{{ " + opening("message['role']") + " }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}" + calls + "{{ " + end + " }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ message['content'] + " + end + " + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ " + opening("'assistant'") + " }}{% endif %}"
    )


# Qwen3's template with the assistant turns in generation blocks: it renders every conversation as Qwen3's own
# does (checked against it, text for text), whose answers cannot be found turn by turn: an answer's think block is
# shown only after the last user query, and there only on the last answer or one with reasoning, so a turn renders
# differently once more follows. render_chat takes the masks from it wherever its text equals the tokenizer's own.
_QWEN3_TOOLS = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>"
)
_QWEN3_CALLS = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n"
)
QWEN3 = (
    """{%- if tools %}{{- '<|im_start|>system\\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
  {{- '"""
    + _QWEN3_TOOLS
    + """' }}
  {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
  {{- '"""
    + _QWEN3_CALLS
    + """' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1, in_tool_round=true) %}
{%- for message in messages[::-1] %}
  {%- if ns.in_tool_round and message.role == 'user' and message.content is string
      and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
    {%- set ns.in_tool_round = false %}{%- set ns.last_query = messages | length - 1 - loop.index0 %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
    {%- if message.reasoning_content is not string and '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>assistant\\n' }}{% generation %}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
      {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
    {%- else %}{{- content }}{%- endif %}
    {%- for call in message.tool_calls or [] %}
      {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
      {%- set arguments = call.function.arguments %}
      {{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
      {{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
)

# For base models whose tokenizer has no template, and for templates whose turns cannot be found one by one
# (_spans_of_the_same_text). Each marks the assistant turns with generation blocks.
TEMPLATES = {
    # ChatML (Qwen, many instruct models): needs <|im_start|> and <|im_end|> to be tokens of the tokenizer.
    "chatml": _layout(lambda role: f"'<|im_start|>' + {role} + '\n'", "'<|im_end|>'"),
    # Zephyr's layout: every turn ends with the tokenizer's EOS, so it fits any base model's vocabulary.
    "zephyr": _layout(lambda role: f"'<|' + {role} + '|>\n'", "eos_token"),
    "qwen3": QWEN3,
}


def resolve_format(fmt: str, columns: list[str], text_field: str = "text") -> str:
    """The format `data.format` means for a dataset with these columns (auto: preference, chat, prompt_completion or
    text). Pairs first: preference sets often carry the chosen conversation as `messages` too (UltraFeedback's).
    Alpaca's columns beside a text column (data.text_field; tatsu-lab/alpaca has one, each row rendered with
    Alpaca's own prompt) stay text, as they trained before the app read Alpaca's columns."""
    if fmt != "auto":
        return fmt
    if "chosen" in columns and "rejected" in columns:
        return "preference"
    if any(c in columns for c in COLUMNS["chat"]):
        return "chat"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if INSTRUCTION in columns and any(c in columns for c in INSTRUCTION_ANSWERS) and text_field not in columns:
        return "chat"
    return "text"


def columns_read(fmt: str) -> tuple[str, ...]:
    """The columns a row of this format is made of (a chat row's turns are in one of them, or Alpaca's)."""
    return (*COLUMNS[fmt], *INSTRUCTION_COLUMNS) if fmt == "chat" else COLUMNS[fmt]


# The version of the chat blocks in a tokenized cache: v2 packs best fit decreasing; v1 packed in order, and an
# experiment whose folder holds a v1 cache keeps it (app.data.cache_folder), so that its resume sees its blocks.
CACHE_VERSION, EARLIER_CACHE_VERSIONS = "chat-v2", ("chat-v1",)


def cache_fields(cfg, version: str = CACHE_VERSION) -> list[Any]:
    """What shapes tokenized chat data besides the text fields (nothing for text: its cache keys stay as they were)."""
    if cfg.format == "text":
        return []
    return [cfg.format, cfg.chat_template, cfg.train_on_prompt, version]


def template_name_problem(cfg) -> Problem | None:
    """data.chat_template that is neither a template the app ships nor Jinja (no '{{' or '{%'): a misspelt name
    would be rendered as the template's whole text, the same string for every row, with no target token."""
    given = cfg.chat_template
    if given is None or given in TEMPLATES or "{{" in given or "{%" in given:
        return None
    import difflib

    guess = difflib.get_close_matches(given.strip().lower(), list(TEMPLATES), n=1, cutoff=0.5)
    return Problem(
        "data.chat_template",
        given,
        f"is neither a template the app ships ({', '.join(TEMPLATES)}) nor a Jinja template (it has no '{{{{' or "
        "'{%')",
        f"did you mean '{guess[0]}'?" if guess else f"use one of {', '.join(TEMPLATES)}, or write the template",
    )


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


def keep_template(tokenizer, cfg) -> None:
    """The tokenizer that checkpoints and the final model are saved with carries data.chat_template: the model is
    then prompted as it was trained (apply_chat_template, vLLM and TGI read it from tokenizer_config.json), where a
    base tokenizer had none or another."""
    for source, _ in cfg.sources():  # a mixture's: the first template a source names
        if source.chat_template:
            tokenizer.chat_template = template_of(source, tokenizer)
            return


def template_name(cfg) -> str:
    if not cfg.chat_template:
        return "the tokenizer's"
    return cfg.chat_template if cfg.chat_template in TEMPLATES else _short(cfg.chat_template)


# --- row checks -------------------------------------------------------------------------------------------------
CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'


def row_problem(row: dict[str, Any], fmt: str) -> tuple[str, str] | None:
    """(what is wrong, the fix) for a row this format cannot train on, else None."""
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            return _conversational_problem(prompt, completion) or _tools_problem(row.get(TOOLS))
        for column in COLUMNS[fmt]:
            value = row.get(column)
            if value is None:
                return f"has no {column!r}", f"give every row a text {column!r}, or set data.format"
            if not isinstance(value, str):
                return f"{column!r} is {type(value).__name__} ({_short(value)}), not text", "write it as a string"
        if not row["completion"].strip():
            return "has an empty 'completion' (nothing to train on)", "fill it in, or remove the row"
        return None
    column, messages = turns_of(row)
    if messages is None:
        return "has no 'messages'", "give every row a 'messages' list of {role, content}, or set data.format"
    if not isinstance(messages, list):
        return f"{column!r} is {type(messages).__name__}, not a list", f"write {column!r} as a list of turns"
    if not messages:
        return "has an empty conversation", "remove the row, or give it a user and an assistant turn"
    messages = [_role_content(m) for m in messages]
    if problem := _messages_problem(messages) or _tools_problem(row.get(TOOLS)):
        return problem
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant turn (nothing to train on)", "add the assistant's answer, or remove the row"
    return None


def answered(row: dict[str, Any], fmt: str) -> bool:
    """Whether a row that passed row_problem has an answer to learn from: an assistant turn (of the completion, in
    TRL's conversational form) with text, reasoning or a tool call. An empty answer still renders its end-of-turn
    token as a target, so a set of empty answers would train, on nothing but stopping at once."""
    turns = conversation(row, fmt)
    if turns is None:
        return True  # prompt/completion text: row_problem refuses an empty completion
    messages, _, first_target = turns
    return any(_says_something(m) for m in messages[first_target:] if m.get("role") == "assistant")


def _says_something(message: dict[str, Any]) -> bool:
    content = message.get("content")
    if _text_parts(content):
        content = "".join(part["text"] for part in content)
    texts = (content, message.get("reasoning_content"))
    return bool(message.get("tool_calls")) or any(isinstance(t, str) and t.strip() for t in texts)


def unanswered_problem(cfg, fmt: str, rows: list[tuple[str, dict[str, Any]]], every_row=None) -> Problem | None:
    """data.dataset's problem when no row has an answer (`answered`) and data.train_on_prompt is off (on, the
    prompts are targets): first the sample `rows`, then, only when none of them has one, `every_row()` (the
    source's rows from its first, app.data.checks reads them), up to the first row that has one. A sample of
    empty answers proves nothing of the rest (a file sorted by answer length starts with its empty ones), so the
    sample alone never refuses; and the pass over the whole data is paid only by a set that is refused then (or
    whose answers start late). Without `every_row` the sample is all there is. Rows the format cannot train on
    are no answer; row_problem names them where they are read."""
    if cfg.train_on_prompt or not rows or any(answered(row, fmt) for _, row in rows):
        return None  # (no rows at all: the checks of an empty source say so)
    scope, read = f"the {len(rows):,} sampled rows", 0
    if every_row is not None:
        for read, row in enumerate(every_row(), 1):
            if row_problem(row, fmt) is None and answered(row, fmt):
                return None
        scope = f"all {read:,} rows" if read != 1 else "its one row"
    return no_answer(cfg.dataset, scope)


def no_answer(dataset, scope: str) -> Problem:
    """The one line for a set without an answer to learn, before the cluster (unanswered_problem) and after its
    preparation (app.data.pipeline, for what the checks could not read: a hub dataset, rows beyond a split's
    slice)."""
    return Problem(
        "data.dataset",
        dataset,
        f"every assistant answer in {scope} is empty (no text in the assistant turns' 'content', no tool call): "
        "only each answer's end-of-turn token would be a target, so there is nothing to train on",
        "fill in the answers, or set data.train_on_prompt=true to train on the prompts",
    )


def _conversational_problem(prompt, completion) -> tuple[str, str] | None:
    """TRL's conversational prompt/completion: both lists of messages, the completion holding an assistant turn."""
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        got = f"'prompt' is {type(prompt).__name__}, 'completion' {type(completion).__name__}"
        return f"{got}: a conversational row has both as lists of messages", "write both as lists, or both as text"
    if problem := _messages_problem(prompt + completion):
        return problem
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
        return "has no assistant turn in 'completion' (nothing to train on)", "put the answer in an assistant turn"
    return None


def _messages_problem(messages: list) -> tuple[str, str] | None:
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {n} is {type(message).__name__}, not a {{role, content}} mapping", "fix the row"
        role = message.get("role")
        if role not in ROLES:
            speakers = ", ".join([*SHAREGPT_ROLES, "system"])
            return (
                f"message {n} has role {role!r}",
                f"use one of the roles {', '.join(ROLES)} (ShareGPT's from: {speakers})",
            )
        calls = message.get("tool_calls")
        if calls is not None and (problem := _calls_problem(n, role, calls)):
            return problem
        content = message.get("content")
        if not (isinstance(content, str) or _text_parts(content) or (calls and content is None)):
            fix = 'write each content as a string (or a list of {"type": "text", "text": ...} parts)'
            return f"message {n} ({role}) has content {_short(content)}, not text", fix
    return None


def _calls_problem(n: int, role: str, calls) -> tuple[str, str] | None:
    """An assistant turn's tool_calls: a list of {"function": {name, arguments}} (or {name, arguments}), the
    arguments an object or its JSON text."""
    if role != "assistant":
        return f"message {n} ({role}) has tool_calls", "only assistant turns call tools: move the calls to one"
    if not isinstance(calls, list):
        return f"message {n} has tool_calls {_short(calls)}, not a list", f"write each call as {CALL_SHAPE}"
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            return f"message {n} has a tool call {_short(call)} without a function name", f"write it as {CALL_SHAPE}"
        if not isinstance(_arguments(fn.get("arguments")), dict):
            got = _short(fn.get("arguments"))
            return (
                f"message {n} calls {fn['name']!r} with arguments {got}, not an object",
                "write them as a JSON object",
            )
    return None


def _tools_problem(tools) -> tuple[str, str] | None:
    """The tools column: a list of function schemas (or its JSON text), each naming its function."""
    fix = 'write the tools as a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}'
    try:
        schemas = _tools(tools)
    except ValueError:
        return f"has tools {_short(tools)}, which is not JSON", fix
    if schemas is None:
        return None
    if not isinstance(schemas, list) or not all(isinstance(_tool_name(t), str) for t in schemas):
        return f"has tools {_short(tools)}, not a list of function schemas with names", fix
    return None


# --- rendering and masks ----------------------------------------------------------------------------------------
def _arguments(value):
    """A call's arguments as the templates take them: an object (JSON text parsed; absent: no arguments)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _no_nulls(value):
    """Keys whose value is null dropped, at every depth: `datasets` gives every row's objects the union of the
    keys of all rows (a call's arguments, a schema's properties), the missing ones null."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _tools(value) -> list | None:
    """The tools column as apply_chat_template's `tools` (JSON text parsed, nulls dropped); None when absent."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return None if value is None else _no_nulls(value)


def _tool_name(schema) -> str | None:
    fn = schema.get("function", schema) if isinstance(schema, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None


def _call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call in the shape Hugging Face's templates read: {"type": "function", "function": {name, arguments}}."""
    fn = call.get("function", call)
    out = {k: v for k, v in call.items() if v is not None and k not in ("function", "name", "arguments")}
    arguments = _no_nulls(_arguments(fn.get("arguments")))
    return {**out, "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


def _text_parts(content) -> bool:
    """Whether `content` is a list of text parts (OpenAI's and multimodal templates' form), which trains as their
    text joined: every template takes a string, not every one takes parts."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    )


def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As apply_chat_template normalises them: keys whose value is None (columns other rows have) are dropped; tool
    calls in one shape, text parts joined, and the content of an assistant turn that only calls tools empty text."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        if _text_parts(message.get("content")):
            message["content"] = "".join(part["text"] for part in message["content"])
        if message.get("tool_calls"):
            message = {"content": "", **message, "tool_calls": [_call(c) for c in message["tool_calls"]]}
        out.append(message)
    return out


def turns_of(row: dict[str, Any]) -> tuple[str, Any]:
    """(the column, the turns) of a chat row: `messages`, else ShareGPT's `conversations`, else Alpaca's columns."""
    for column in COLUMNS["chat"]:
        if row.get(column) is not None:
            return column, row[column]
    if row.get(INSTRUCTION) is not None:
        return INSTRUCTION, _instruction_turns(row)
    return COLUMNS["chat"][0], None


def _instruction_turns(row: dict[str, Any]) -> list[dict[str, Any]]:
    instruction = row[INSTRUCTION]
    given = next((row[c] for c in INSTRUCTION_INPUTS if row.get(c) is not None), None)
    if isinstance(instruction, str) and isinstance(given, str) and given.strip():
        instruction = f"{instruction}\n\n{given}"
    turns = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    turns.append({"role": "user", "content": instruction})
    answer = next((row[c] for c in INSTRUCTION_ANSWERS if row.get(c) is not None), None)
    return turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def _role_content(message):
    """A ShareGPT turn ({from, value}) as {role, content} (a function_call as an assistant turn's tool call); any
    other as it is."""
    if not isinstance(message, dict) or message.get("from") is None or message.get("role") is not None:
        return message  # (a column mixing both forms has both keys, one of them null)
    rest = {k: v for k, v in message.items() if k not in ("from", "value")}
    speaker, value = message["from"], message.get("value")
    if speaker != "function_call":
        return {**rest, "role": SHAREGPT_ROLES.get(speaker, speaker), "content": value}
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        calls = value  # _calls_problem names it
    return {**rest, "role": "assistant", "content": None, "tool_calls": calls if isinstance(calls, list) else [calls]}


def conversation(row: dict[str, Any], fmt: str) -> tuple[list[dict[str, Any]], Any, int] | None:
    """A row that passed row_problem as (its messages, its tools column, the index of the first message whose
    assistant turns are targets); None for a prompt/completion row of text."""
    if fmt == "chat":
        return [_role_content(m) for m in turns_of(row)[1]], row.get(TOOLS), 0
    if isinstance(row["prompt"], list):
        return row["prompt"] + row["completion"], row.get(TOOLS), len(row["prompt"])
    return None


def _render(messages, template: str, tokenizer, tools=None, with_spans: bool = False, add_generation_prompt=False):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        return_assistant_tokens_mask=with_spans,
        add_generation_prompt=add_generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return rendered[0], (spans[0] if with_spans else None)


class TemplateError(Exception):
    """The template cannot render this conversation, or renders it so that the assistant turns cannot be found."""


def render_chat(messages, template: str, tokenizer, tools=None, first_target: int = 0) -> tuple[str, list]:
    """(the rendered text, the character spans of the assistant turns from message `first_target` on, trailing
    whitespace left out)."""
    messages, tools = _plain(messages), _tools(tools)
    try:
        if GENERATION.search(template):
            text, spans = _render(messages, template, tokenizer, tools, with_spans=True)
        else:
            text = _render(messages, template, tokenizer, tools)[0]
            spans = _turn_by_turn(messages, template, tokenizer, tools, text)
            if spans is None:
                spans = _spans_of_the_same_text(messages, tokenizer, tools, text)
            if spans is None:
                raise TemplateError(
                    "it renders a conversation's first turns differently from the whole conversation, so the "
                    "assistant turns cannot be found; mark them with {% generation %} blocks"
                )
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - Jinja's errors, and raise_exception() calls in the template
        raise TemplateError(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    _check_tools_rendered(text, messages, tools)
    if first_target:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(spans) != len(turns):
            raise TemplateError(
                f"its generation blocks mark {len(spans)} spans for {len(turns)} assistant turns, so the "
                "completion's turns cannot be told from the prompt's"
            )
        spans = [span for span, i in zip(spans, turns) if i >= first_target]
    return text, [(lo, lo + len(text[lo:hi].rstrip())) for lo, hi in spans if text[lo:hi].strip()]


def _turn_by_turn(messages, template: str, tokenizer, tools, text: str) -> list[tuple[int, int]] | None:
    """The assistant turns' spans in `text`, each found by rendering the conversation up to the turn's prompt and
    through the turn; None when a turn renders differently once more follows (Qwen3's think blocks)."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(messages[:i], template, tokenizer, tools, add_generation_prompt=True)[0]
        through = _render(messages[: i + 1], template, tokenizer, tools)[0]
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            return None
        spans.append((len(before), len(through)))
    return spans


def _spans_of_the_same_text(messages, tokenizer, tools, text: str) -> list[tuple[int, int]] | None:
    """The generation blocks' spans of a shipped template that renders this conversation as `text`, character for
    character (qwen3 does, for Qwen3's own template): its masks are then the masks of the tokenizer's template."""
    for shipped in TEMPLATES.values():
        try:
            rendered, spans = _render(messages, shipped, tokenizer, tools, with_spans=True)
        except Exception:  # noqa: BLE001 - a template that cannot render this conversation is not the one
            continue
        if rendered == text:
            return spans
    return None


def _check_tools_rendered(text: str, messages: list[dict[str, Any]], tools: list | None) -> None:
    """A template that drops tool calls or schemas (most base templates know neither) would teach calls the
    model never sees, or answers to functions it was never shown: refused, naming the first one missing."""
    names = [("the tool", _tool_name(t)) for t in tools or []]
    names += [
        (f"message {n}'s call to", c["function"]["name"])
        for n, m in enumerate(messages)
        for c in m.get("tool_calls", [])
    ]
    for what, name in names:
        if name not in text:
            raise TemplateError(
                f"it does not render tool use: {what} {name!r} is not in its rendering; use a template that renders "
                f"tool calls and the tools' schemas (a tool-calling model's own, or one of {', '.join(TEMPLATES)})"
            )


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


def encode_chat(
    messages, template: str, tokenizer, train_on_prompt: bool, tools=None, first_target: int = 0
) -> tuple[list[int], list[int], list[int]]:
    """(token ids, labels, the token index after each target assistant turn: where a truncation may cut)."""
    text, spans = render_chat(messages, template, tokenizer, tools, first_target)
    enc = with_offsets(tokenizer, text)
    return masked(enc["input_ids"], enc["offset_mapping"], spans, tokenizer, train_on_prompt)


def with_offsets(tokenizer, text):
    """The rendering(s) tokenized as they are (the template wrote the special tokens) with each token's character
    span; only the ids and spans, as the masks and type ids are never read (a fifth of the call's time)."""
    return tokenizer(
        text,
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
        return_token_type_ids=False,
    )


def masked(ids, offsets, spans, tokenizer, train_on_prompt: bool, special=None):
    """encode_chat's result for a rendering's tokens (ids, offsets) and its assistant spans; `special`: the
    tokenizer's special ids (app.data.tokens.special_ids), found here when not given."""
    from app.data.tokens import special_ids

    mask, ends = _targets(offsets, spans)
    special = special_ids(tokenizer) if special is None else special
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
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} | {"content": ""} for m in messages]
    text = _render(_plain(bare), template, tokenizer)[0]
    enc = with_offsets(tokenizer, text)
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
    map's worker processes). The template is looked up at the first row that needs one."""

    def __init__(self, cfg, fmt: str, tokenizer, locate: Callable[[int], str]):
        self.fmt, self.tokenizer, self.locate, self.cfg = fmt, tokenizer, locate, cfg
        self._template = template_of(cfg, tokenizer) if fmt == "chat" else None
        self.special = None  # the tokenizer's special ids, found at the first conversation

    @property
    def template(self) -> str:
        if self._template is None:
            self._template = template_of(self.cfg, self.tokenizer)
        return self._template

    def many(self, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int], list[int]]]:
        """What __call__ gives for each row, the rendered conversations tokenized in one call (one call a row was a
        third of a unit's time); a bad row raises what __call__ raises, after any of the rows before it."""
        out: list[Any] = []
        rendered, failure = [], None  # rendered: (its place in out, its row, text, spans)
        for row in rows:
            try:
                if (problem := row_problem(row, self.fmt)) is not None:
                    raise Problem("data.dataset", self.locate(row[ROW]), *problem)
                if (turns := conversation(row, self.fmt)) is None:
                    out.append(self(row))
                    continue
                messages, tools, first_target = turns
                try:
                    text, spans = render_chat(messages, self.template, self.tokenizer, tools, first_target)
                except TemplateError as exc:
                    raise render_problem(self.cfg, self.locate(row[ROW]), exc) from None
            except Problem as exc:
                failure = exc
                break
            rendered.append((len(out), row, text, spans))
            out.append(None)
        if rendered:
            enc = with_offsets(self.tokenizer, [r[2] for r in rendered])
            if self.special is None:
                from app.data.tokens import special_ids

                self.special = special_ids(self.tokenizer)
            for (at, row, _, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
                try:
                    out[at] = masked(ids, offsets, spans, self.tokenizer, self.cfg.train_on_prompt, self.special)
                except TemplateError as exc:
                    raise render_problem(self.cfg, self.locate(row[ROW]), exc) from None
        if failure is not None:
            raise failure
        return out

    def __call__(self, row: dict[str, Any]):
        if (problem := row_problem(row, self.fmt)) is not None:
            raise Problem("data.dataset", self.locate(row[ROW]), *problem)
        if (turns := conversation(row, self.fmt)) is None:
            return encode_prompt_completion(row["prompt"], row["completion"], self.tokenizer, self.cfg.train_on_prompt)
        messages, tools, first_target = turns
        try:
            return encode_chat(messages, self.template, self.tokenizer, self.cfg.train_on_prompt, tools, first_target)
        except TemplateError as exc:
            raise render_problem(self.cfg, self.locate(row[ROW]), exc) from None


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


def sample_problems(
    cfg, fmt: str, rows: list[tuple[str, dict[str, Any]]], tokenizer_of: Callable, every_row=None
) -> list[Problem]:
    """The sampled rows (each with where it is) that this format cannot train on, then whether any row has an
    answer (unanswered_problem, which reads on through `every_row()` only when no sampled row has one), then the
    first row that the template cannot render, then whether the template's own text is in the tokenizer's
    vocabulary (markers_problem; with the tokenizer that `tokenizer_of()` loads; skipped when it cannot be loaded
    here)."""
    problems = []
    for where, row in rows:
        if (problem := row_problem(row, fmt)) is not None:
            problems.append(Problem("data.dataset", where, *problem))
            if len(problems) == MAX_REPORTED:
                break
    if problems:
        return problems
    if unanswered := unanswered_problem(cfg, fmt, rows, every_row):
        return [unanswered]
    rendered = [(where, row, turns) for where, row in rows if (turns := conversation(row, fmt)) is not None]
    if not rendered:
        return []
    try:
        tokenizer = tokenizer_of()
    except Exception:  # noqa: BLE001 - e.g. a hub tokenizer out of reach from here: the run checks every row
        return []
    try:
        # As the preparation encodes: the rendered texts tokenized in one call (a call a row was 1.1 s of the driver's
        # start-up for 1,000 rows on an H100 host: record 2026-12-06-driver-profile-h100.txt).
        encoder = Encoder(cfg, fmt, tokenizer, [where for where, _, _ in rendered].__getitem__)
        encoded = encoder.many([{**row, ROW: n} for n, (_, row, _) in enumerate(rendered)])
    except Problem as problem:
        return [problem]
    where, _, (messages, _, _) = rendered[0]
    problem = markers_problem(cfg, where, messages, encoder.template, tokenizer) or fit_problem(cfg, encoded)
    return [problem] if problem else []


def fit_problem(cfg, encoded: list[tuple[list[int], list[int], list[int]]]) -> Problem | None:
    """What the sample shows before any cluster starts: no conversation of it fits data.seq_length even cut at a
    turn boundary (the whole split would likely be dropped), or none of its tokens is a target."""
    if not encoded:
        return None
    if all(all(label == -100 for label in labels) for _, labels, _ in encoded):
        return Problem(
            "data.chat_template",
            template_name(cfg),
            f"marks no token of the {len(encoded)} sampled conversations as a target (no assistant turn is found)",
            "use a template that renders the assistant turns (a shipped name, or {% generation %} blocks)",
        )
    if all(fit(ids, labels, ends, cfg.seq_length) is None for ids, labels, ends in encoded):
        need = min(min(ends, default=len(ids)) for ids, _, ends in encoded)
        return Problem(
            "data.seq_length",
            cfg.seq_length,
            f"none of the {len(encoded)} sampled conversations fits, not even cut after its first answer (the "
            f"shortest such cut is {need} tokens)",
            f"set data.seq_length to at least {need}, or use shorter conversations",
        )
    return None


def render_problem(cfg, where: str, exc: TemplateError) -> Problem:
    return Problem(
        "data.chat_template",
        template_name(cfg),
        f"cannot render {where}: {exc}",
        "fix the template or the row, or set data.chat_template to one of " + ", ".join(TEMPLATES),
    )
