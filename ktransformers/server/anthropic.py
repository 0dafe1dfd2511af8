"""Anthropic's Messages API: `POST /v1/messages` (plain and streamed as Anthropic's server-sent
events) and `POST /v1/messages/count_tokens`, over the same chat machinery as the OpenAI routes:
a system prompt, text, `tool_use` / `tool_result` blocks and tools, `thinking` blocks (the
model's reasoning), `tool_choice` auto / any / tool / none, `stop_sequences`. Errors come in
Anthropic's shape (app._error_response); the API key may come as `x-api-key`."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import Field

from .base import Body, events, whole_answer
from .chat import ChatError, ChatOptions, check_tools


class MessagesBody(Body):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)


class CountBody(Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _block_text(content, where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatError(f"{where} must be a string or a list of content blocks", "messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ChatError(f"{where}: only text blocks are supported here, got {str(block)[:80]}", "messages")
        texts.append(block["text"])
    return "".join(texts)


def openai_messages(system, messages: list[dict]) -> list[dict]:
    """Anthropic messages as OpenAI-shaped ones: tool_result blocks become tool messages (before
    the user's text of the same turn), tool_use blocks the assistant's tool_calls, thinking
    blocks its reasoning_content."""
    out = []
    if system:
        out.append({"role": "system", "content": _block_text(system, "system")})
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ChatError(f"messages[{i}].role must be user or assistant, got {role!r}", "messages")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ChatError(f"messages[{i}].content must be a string or a list of blocks", "messages")
        text, calls, thinking = [], [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(_block_text([block], where))
            elif kind == "tool_result" and role == "user":
                result = _block_text(block.get("content"), where)
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")),
                            "content": ("Error: " + result) if block.get("is_error") else result})
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": str(block.get("name", "")),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                thinking.append(str(block.get("thinking", "")))
            else:
                raise ChatError(f"{where}: a {kind!r} block is not supported in a {role} message", "messages")
        if role == "user" and (text or not any(b.get("type") == "tool_result" for b in blocks)):
            out.append({"role": "user", "content": "".join(text)})
        elif role == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    for m in out:  # (each tool result names its function too: harmony's tool messages need it)
        if m["role"] == "tool":
            m["name"] = next((c["function"]["name"] for a in out for c in a.get("tool_calls", ())
                              if c["id"] == m["tool_call_id"]), None)
    return out


def chat_options(tools, tool_choice, thinking) -> ChatOptions:
    openai_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise ChatError("tools must be a list", "tools")
        openai_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise ChatError(f"tools[{i}] needs a name", "tools")
            openai_tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    o = ChatOptions(tools=check_tools(openai_tools))
    choice = tool_choice or {"type": "auto"}
    kind = choice.get("type")
    mapping = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        o.set_tool_choice({"type": "function", "function": {"name": choice.get("name")}})
    elif kind in mapping:
        o.set_tool_choice(mapping[kind])
    else:
        raise ChatError('tool_choice.type must be auto, any, tool or none', "tool_choice")
    o.parallel = not choice.get("disable_parallel_tool_use", False)
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled"):
            raise ChatError('thinking.type must be "enabled" or "disabled"', "thinking")
        o.template_kwargs["enable_thinking"] = thinking["type"] == "enabled"
    return o


def _stop_reason(r, answer) -> str:
    if answer is not None and answer.tool_calls:
        return "tool_use"
    if r.stop_hit is not None:
        return "stop_sequence"
    return "max_tokens" if r.finish_reason == "length" else "end_turn"


def _tool_use(call) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def add_anthropic_routes(app: FastAPI, s) -> None:

    def prepare(body):
        return s.prepare_chat(openai_messages(body.system, body.messages),
                              chat_options(body.tools, body.tool_choice, body.thinking))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountBody):
        s.check_model(body.model)
        ids, _, _ = await asyncio.to_thread(prepare, body)
        return {"input_tokens": len(ids)}

    @app.post("/v1/messages")
    async def messages(body: MessagesBody):
        s.check_model(body.model)
        ids, grammar, answer = await asyncio.to_thread(prepare, body)
        params = s.sampling(body.temperature, body.top_p, body.top_k, None, None)
        r = s.start(ids, params, body.max_tokens, body.stop_sequences, chat=True, grammar=grammar, api="anthropic")
        message_id = "msg_" + uuid.uuid4().hex[:24]
        model = body.model or s.model_name
        if body.stream:
            return StreamingResponse(_stream(r, answer, message_id, model),
                                     media_type="text/event-stream")
        whole = await whole_answer(r, answer, "api_error")
        content = []
        if whole["reasoning"]:
            content.append({"type": "thinking", "thinking": whole["reasoning"], "signature": ""})
        if whole["text"]:
            content.append({"type": "text", "text": whole["text"]})
        content += [_tool_use(c) for c in whole["tool_calls"]]
        return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": _stop_reason(r, answer), "stop_sequence": r.stop_hit,
                "usage": {"input_tokens": len(r.prompt_ids), "output_tokens": len(r.tokens),
                          "cache_read_input_tokens": r.cached_tokens}}


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _stream(r, answer, message_id: str, model: str):
    """Anthropic's event sequence: message_start, then per content block (thinking, text,
    tool_use, in the order they come) its start, deltas and stop, then message_delta (the stop
    reason and output tokens) and message_stop."""
    yield _sse("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(r.prompt_ids), "output_tokens": 0}}})
    index, open_kind = -1, None
    try:
        async for kind, piece in events(r, answer):
            if kind == "tool_call":
                if open_kind is not None:
                    yield _sse("content_block_stop", {"index": index})
                index, open_kind = index + 1, None
                block = _tool_use(piece)
                yield _sse("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
                yield _sse("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": piece.arguments}})
                yield _sse("content_block_stop", {"index": index})
                continue
            if kind != open_kind:
                if open_kind is not None:
                    yield _sse("content_block_stop", {"index": index})
                index, open_kind = index + 1, kind
                start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
                    {"type": "text", "text": ""}
                yield _sse("content_block_start", {"index": index, "content_block": start})
            delta = {"type": "thinking_delta", "thinking": piece} if kind == "reasoning" else \
                {"type": "text_delta", "text": piece}
            yield _sse("content_block_delta", {"index": index, "delta": delta})
    except RuntimeError as e:
        yield _sse("error", {"error": {"type": "api_error", "message": str(e)}})
        return
    if open_kind is not None:
        yield _sse("content_block_stop", {"index": index})
    yield _sse("message_delta", {"delta": {"stop_reason": _stop_reason(r, answer), "stop_sequence": r.stop_hit},
                                 "usage": {"output_tokens": len(r.tokens)}})
    yield _sse("message_stop", {})
