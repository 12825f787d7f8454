"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` for chat templates that render
tools, Hermes-style calls in the output, OpenAI's `message.tool_calls` out.

- A template declares tool use when its source reads the `tools` variable (`template_supports_tools`);
  for any other template a request with tools is a 400 naming `tools`.
- The tools are rendered into the prompt by the template (apply_chat_template(tools=...)); as vLLM
  does by default, also when tool_choice is "none" (the model is then only not asked to call one).
- The model answers a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
  Qwen 2.5 / 3); `parse_tool_calls` takes every such block that holds a JSON object with a string
  name out of the text; a block that does not parse stays in the content.
- tool_choice "required" and a named tool force a call: `forced_format` is a Lark grammar for
  engine/core/structured.py: `<tool_call>`, newline, a JSON object whose name is one of the tools (or the
  named one) and whose arguments follow that tool's parameters schema, newline, `</tool_call>`; the
  matcher then allows only EOS. "auto" leaves the output free and parses what comes.
- Streaming (`ToolCallStream`): content is sent as it comes up to where a `<tool_call>` may begin;
  a call is sent as one tool_calls delta (index, id, type, name, full arguments) once its closing
  tag arrives (or at the end, for an unclosed last call that parses).
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function name rule (dots as vLLM allows)
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_TOOLS_VAR = re.compile(r"\btools\b")
MAX_TOOL_SCHEMA_CHARS = 64_000
EMPTY_PARAMS = {"type": "object", "properties": {}}


# ------------------------------------------------------------------ the template
def template_supports_tools(tokenizer) -> bool:
    """True when the tokenizer's chat template (any of its named templates) reads `tools`."""
    t = getattr(tokenizer, "chat_template", None)
    sources = list(t.values()) if isinstance(t, dict) else [t]
    return any(isinstance(s, str) and _TOOLS_VAR.search(s) for s in sources)


# ------------------------------------------------------------------ request checks
def check_tools(tools: list) -> list[dict]:
    """The tool definitions normalized ({"type": "function", "function": {name, description?,
    parameters}}); ValueError naming the field (tools.i.function.name, ...) otherwise."""
    out, names = [], set()
    for i, t in enumerate(tools):
        at = f"tools.{i}"
        if not isinstance(t, dict):
            raise ValueError(f"{at}: must be an object")
        if t.get("type", "function") != "function":
            raise ValueError(f"{at}.type: only 'function' tools are supported, got {t.get('type')!r}")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ValueError(f"{at}.function: must be an object with a name")
        name = f.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"{at}.function.name: must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in names:
            raise ValueError(f"{at}.function.name: {name!r} is defined twice")
        names.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"{at}.function.description: must be a string")
        params = f.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMS)
        _check_schema(params, f"{at}.function.parameters")
        fn = {"name": name, "parameters": params}
        if desc is not None:
            fn["description"] = desc
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _check_schema(schema, at: str) -> None:
    if not isinstance(schema, dict):
        raise ValueError(f"{at}: must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"{at}: the schema's type must be 'object', got {schema.get('type')!r}")
    if len(json.dumps(schema)) > MAX_TOOL_SCHEMA_CHARS:
        raise ValueError(f"{at}: the schema must be at most {MAX_TOOL_SCHEMA_CHARS} characters")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{at}: not a valid JSON schema: {e.message[:200]}") from None


def resolve_tool_choice(choice, tools: list[dict] | None) -> str | None:
    """OpenAI's tool_choice -> "none" / "auto" / "required" / the forced tool's name (None when the
    request has no tools). Default: "auto" with tools, else "none". ValueError naming tool_choice."""
    names = [t["function"]["name"] for t in tools or ()]
    if choice is None:
        return "auto" if names else None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, got {choice!r}")
        if choice != "none" and not names:
            raise ValueError(f"tool_choice: {choice!r} needs a non-empty tools list")
        return choice if names else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise ValueError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}')
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice: function.name must be a string")
    if name not in names:
        raise ValueError(f"tool_choice: the function {name!r} is not one of the tools ({', '.join(names) or 'none'})")
    return name


def forced_format(tools: list[dict], choice: str) -> dict | None:
    """The grammar response_format that forces one call for "required" / a named tool, else None."""
    if choice in ("none", "auto"):
        return None
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    alts = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    compact = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
    schema = dict(schema, **{"x-guidance": compact})
    lark = f"start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}"
    return {"type": "lark", "lark": lark, "param": "tools"}


# ------------------------------------------------------------------ the output
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call_of(body: str) -> dict | None:
    """The OpenAI tool call a block's JSON holds, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}


def _items(text: str, final: bool) -> tuple[list, int]:
    """The text split into ("text", s) and ("call", call) items, as far as it is settled, and the
    number of characters settled: an unclosed `<tool_call>` (before the end) or a trailing prefix
    of one waits for more text."""
    items, pos = [], 0
    for m in _BLOCK.finditer(text):
        if m.start() > pos:
            items.append(("text", text[pos : m.start()]))
        call = _call_of(m.group(1))
        items.append(("call", call) if call else ("text", m.group(0)))
        pos = m.end()
    rest = text[pos:]
    start = rest.find(OPEN)
    if start >= 0:
        if start:
            items.append(("text", rest[:start]))
        if not final:
            return items, pos + start
        call = _call_of(rest[start + len(OPEN) :])
        items.append(("call", call) if call else ("text", rest[start:]))
        return items, len(text)
    keep = 0 if final else _partial_open(rest)
    if len(rest) > keep:
        items.append(("text", rest[: len(rest) - keep]))
    return items, len(text) - keep


def _partial_open(s: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of `<tool_call>`."""
    for n in range(min(len(s), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(s[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content: the text outside the calls, stripped, None when empty; the calls)."""
    items, _ = _items(text, final=True)
    content = "".join(v for k, v in items if k == "text").strip()
    return (content or None), [v for k, v in items if k == "call"]


class ToolCallStream:
    """One streamed choice: feed the text released so far; get the new content and the new calls."""

    def __init__(self):
        self.content_sent = 0
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[tuple[int, dict]]]:
        items, _ = _items(text, final)
        content = "".join(v for k, v in items if k == "text")
        if final and self.content_sent == 0 and not content.strip():
            content = ""  # whitespace around calls only: no content at all, as parse_tool_calls
        calls = [v for k, v in items if k == "call"]
        new_text = content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(content))
        fresh = [(len(self.calls) + j, c) for j, c in enumerate(calls[len(self.calls) :])]
        self.calls.extend(c for _, c in fresh)
        return new_text, fresh


def tool_call_delta(index: int, call: dict) -> dict:
    return {"index": index, **call}


def finish_reason_with_calls(reason: str | None, has_calls: bool) -> str | None:
    """A choice that ended on its own (stop) with calls ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if has_calls and reason == "stop" else reason
