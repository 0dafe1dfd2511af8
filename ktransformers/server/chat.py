"""What a chat asks for beyond text, and what its answer carries, for every API the server
speaks (OpenAI, Ollama, Anthropic): tools and tool_choice, structured output, the chat
template's switches (enable_thinking, reasoning_effort), and the split of an answer into
reasoning, text and tool calls (reasoning.py, toolcalls.py; gpt-oss's through its harmony
channels). A forced tool call (tool_choice "required" or a named function) and structured output
are decoded under a JSON-schema grammar (engine/grammar.py), so even a weak model's arguments
are valid JSON of the function's schema."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .reasoning import ThinkSplitter, opened_in_prompt, thinks
from .toolcalls import ToolCall, ToolParser, new_call_id, parser_for, parser_named


class ChatError(ValueError):
    """A request the chat cannot be made of (the routes answer 400 naming `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> list[dict]:
    """OpenAI function tools [{"type": "function", "function": {"name", "description"?,
    "parameters"?}}], checked (ChatError naming what is wrong)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatError("tools must be a list", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in names:
            raise ChatError(f"tools[{i}]: the function {name!r} is declared twice", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ChatError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.add(name)
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


@dataclass
class ChatOptions:
    """A chat request's options beyond sampling, in OpenAI's terms."""

    tools: list[dict] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | named
    named: str | None = None  # the function of tool_choice "named"
    parallel: bool = True
    schema: dict | bool | None = None  # the answer's JSON schema (structured output)
    strict: bool = True
    json_object: bool = False  # the answer is any one JSON object
    template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None,
                    reasoning_effort=None, chat_template_kwargs=None) -> ChatOptions:
        o = cls(tools=check_tools(tools), parallel=parallel_tool_calls is not False)
        o.set_tool_choice(tool_choice)
        if response_format is not None:
            o.set_response_format(response_format)
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict):
                raise ChatError("chat_template_kwargs must be an object", "chat_template_kwargs")
            o.template_kwargs.update(chat_template_kwargs)
        if reasoning_effort is not None:
            if reasoning_effort not in ("low", "medium", "high"):
                raise ChatError(f"reasoning_effort must be low, medium or high, got {reasoning_effort!r}",
                                "reasoning_effort")
            o.template_kwargs["reasoning_effort"] = reasoning_effort
        return o

    def set_tool_choice(self, choice) -> None:
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
            if not isinstance(name, str):
                raise ChatError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                                '"function": {"name": ...}}', "tool_choice")
            if name not in {t["function"]["name"] for t in self.tools}:
                raise ChatError(f"tool_choice names the function {name!r}, which is not among the tools",
                                "tool_choice")
            self.tool_choice, self.named = "named", name
            return
        if choice not in ("auto", "none", "required"):
            raise ChatError(f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r}',
                            "tool_choice")
        if choice == "required" and not self.tools:
            raise ChatError('tool_choice "required" needs tools', "tool_choice")
        self.tool_choice = choice

    def set_response_format(self, fmt) -> None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return
        if kind == "json_object":
            self.json_object = True
            return
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise ChatError("response_format json_schema needs json_schema.schema, a JSON schema",
                                "response_format")
            self.schema, self.strict = schema, spec.get("strict") is not False
            return
        raise ChatError('response_format.type must be "text", "json_object" or "json_schema"', "response_format")

    @property
    def forced(self) -> bool:
        """The answer must be a tool call."""
        return bool(self.tools) and self.tool_choice in ("required", "named")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages as chat templates take them: text content, assistant tool calls
    with their arguments as objects where they parse (most templates write them with tojson)."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = m.get("content") or ""
        calls = []
        for call in m.get("tool_calls") or ():
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except ValueError:
                    pass
            calls.append({**call, "type": call.get("type", "function"), "function": fn})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class ChatFormat:
    """How the served model's chats are written and read: its chat template (or harmony), the
    tool-call format of its template, whether it thinks in <think> blocks, and the grammars."""

    def __init__(self, tokenizer, harmony=None, model_type: str | None = None, tool_parser: str | None = None,
                 grammars=None):
        self.tokenizer, self.harmony, self.grammars = tokenizer, harmony, grammars
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.template = template if isinstance(template, str) else None
        if tool_parser and tool_parser != "auto":
            self.tool_parser: ToolParser | None = parser_named(tool_parser)
        else:
            self.tool_parser = None if harmony is not None else parser_for(self.template, model_type)
        self.thinks = harmony is None and thinks(self.template)

    @property
    def keeps_special(self) -> bool:
        """Answers are read with special tokens in (their markers may be special tokens)."""
        return self.tool_parser is not None or self.thinks

    def render(self, messages: list[dict], options: ChatOptions) -> tuple[list[int], bool]:
        """(prompt ids, whether the answer starts inside a reasoning block) of an OpenAI-shaped
        conversation (ChatError where the template refuses it)."""
        tools = options.tools if options.offers_tools else None
        if self.harmony is not None:
            chat = self.harmony
            effort = options.template_kwargs.get("reasoning_effort")
            if effort and effort != chat.reasoning_effort:
                chat = type(chat)(chat.encoding, effort)
            try:
                return chat.render(messages, tools), False
            except (ValueError, KeyError) as e:
                raise ChatError(str(e), "messages") from None
        if self.template:
            try:
                text = self.tokenizer.apply_chat_template(template_messages(messages), tools=tools,
                                                          add_generation_prompt=True, tokenize=False,
                                                          **options.template_kwargs)
            except Exception as e:  # e.g. a template that insists on alternating roles
                raise ChatError(f"the model's chat template refused the messages: {e}", "messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return list(ids), self.thinks and opened_in_prompt(text)
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages) + "\nassistant:"
        return list(self.tokenizer.encode(text)), False

    def constraint(self, options: ChatOptions):
        """The grammar the answer is decoded under, or None."""
        if not (options.forced or options.schema is not None or options.json_object):
            return None
        if self.grammars is None:
            from ..engine.grammar import available
            raise ChatError(available() or "structured output is not available for this model", "response_format")
        from ..engine.grammar import GrammarError, tool_call_schema
        try:
            if options.forced:
                return self.grammars.json_schema(tool_call_schema(options.tools, options.named, options.parallel))
            if options.schema is not None:
                return self.grammars.json_schema(options.schema, options.strict)
            return self.grammars.json_object()
        except GrammarError as e:
            raise ChatError(str(e), "tools" if options.forced else "response_format") from None

    def answer(self, options: ChatOptions, inside_reasoning: bool) -> Answer:
        parser = self.tool_parser if options.offers_tools and not options.forced else None
        splitter = ThinkSplitter(inside_reasoning) if self.thinks else None
        forced = (options.named or "") if options.forced else None
        return Answer(splitter, parser, forced)


class Answer:
    """One chat answer: the request's events ("text" | "reasoning" | "tool", payload) in, and out
    ("text", str), ("reasoning", str) and ("tool_call", ToolCall) as soon as each is known. A
    forced call's JSON is read whole at the end; where it does not parse (cut short by
    max_tokens), it comes back as text."""

    def __init__(self, splitter: ThinkSplitter | None, parser: ToolParser | None, forced: str | None):
        self.splitter = splitter
        self.tools = parser.stream() if parser is not None else None
        self.forced = forced  # None, "" (required: an array of calls) or the named function
        self._forced_text: list[str] = []
        self._harmony_call: list | None = None  # [name, argument pieces] of a harmony call being written
        self.tool_calls: list[ToolCall] = []

    def push(self, kind: str, payload) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if kind == "tool":  # a harmony call's arguments, piece by piece
            name, piece = payload
            if self._harmony_call is not None and self._harmony_call[0] != name:
                out += self._end_harmony_call()
            if self._harmony_call is None:
                self._harmony_call = [name, []]
            self._harmony_call[1].append(piece)
            return out
        out += self._end_harmony_call()
        if kind == "reasoning":
            return out + [("reasoning", payload)]
        if self.forced is not None:
            self._forced_text.append(payload)
            return out
        pieces = self.splitter.push(payload) if self.splitter is not None else [("text", payload)]
        return out + self._through_tools(pieces)

    def finish(self) -> list[tuple[str, Any]]:
        out = self._end_harmony_call()
        if self.forced is not None:
            return out + self._forced_calls("".join(self._forced_text))
        if self.splitter is not None:
            out += self._through_tools(self.splitter.finish())
        if self.tools is not None:
            out += self._record(self.tools.finish())
        return out

    def _through_tools(self, pieces) -> list[tuple[str, Any]]:
        out = []
        for kind, piece in pieces:
            if kind == "text" and self.tools is not None:
                out += self._record(self.tools.push(piece))
            else:
                out.append((kind, piece))
        return out

    def _record(self, events) -> list[tuple[str, Any]]:
        for kind, payload in events:
            if kind == "tool_call":
                self.tool_calls.append(payload)
        return list(events)

    def _end_harmony_call(self) -> list[tuple[str, Any]]:
        if self._harmony_call is None:
            return []
        name, pieces = self._harmony_call
        self._harmony_call = None
        text = "".join(pieces)
        try:
            args = json.loads(text)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return [("text", text)]
        return self._record([("tool_call", ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id()))])

    def _forced_calls(self, text: str) -> list[tuple[str, Any]]:
        try:
            value = json.loads(text)
        except ValueError:
            return [("text", text)] if text else []
        if self.forced:  # a named function: the text is its arguments
            calls = [(self.forced, value)] if isinstance(value, dict) else None
        else:
            calls = [(c.get("name"), c.get("arguments")) for c in value if isinstance(c, dict)] \
                if isinstance(value, list) else None
        if not calls or any(not isinstance(n, str) or not isinstance(a, dict) for n, a in calls):
            return [("text", text)]
        return self._record([("tool_call", ToolCall(n, json.dumps(a, ensure_ascii=False), new_call_id()))
                             for n, a in calls])
