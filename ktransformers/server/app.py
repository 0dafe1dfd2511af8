"""The HTTP API: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), Ollama
(`/api/chat`, `/api/generate`, `/api/tags`), `/health`, and the web chat page at `/`. Prompts
are tokenized off the event loop (a long one does not stall the other clients); bodies over
--max_request_mb are refused with 413.

Errors come in each API's own shape: OpenAI `{"error": {"message", "type", "param", "code"}}`,
Ollama `{"error": "message"}`. A client that disconnects mid-stream has its request cancelled
(the scheduler frees its cache pages). With an API key set, /v1 and /api need
`Authorization: Bearer KEY`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling import SamplingParams
from .base import APIError, Body, events, whole_answer
from .chat import Answer, ChatError, ChatFormat, ChatOptions, check_tools
from .scheduler import QueueFull, Request, Scheduler

STATIC = Path(__file__).parent / "static"


# -- request bodies ---------------------------------------------------------------------------
class ChatMessage(Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's call
    reasoning_content: str | None = None


class OpenAISampling(Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # (vLLM's extension) generate max_tokens tokens regardless of EOS


class ChatCompletionBody(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # (vLLM's) e.g. {"enable_thinking": false}


class CompletionBody(OpenAISampling):
    prompt: str | list[str]


class OllamaOptions(Body):
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    repeat_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    num_predict: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: list[str] | None = None


class OllamaGenerateBody(Body):
    model: str | None = None
    prompt: str = ""
    system: str | None = None
    stream: bool = True
    raw: bool = False
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    think: bool | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaChatBody(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | None = None
    tools: list[dict[str, Any]] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaShowBody(Body):
    model: str | None = None
    name: str | None = None  # (older clients)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = [part.get("text", "") for part in content if part.get("type", "text") == "text"]
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "a content part's text must be a string", "messages")
    return "".join(texts)


# -- the app ----------------------------------------------------------------------------------
MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused (413): --max_request_mb
BODY_TIMEOUT_S = 30.0  # the longest wait for the next part of a request body that has not all come (408)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, default_max_tokens: int = 512,
               gen_defaults: SamplingParams | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               allowed_hosts: tuple[str, ...] | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """`allowed_hosts`: the Host header names requests may carry (None: any), so that a page
    on another site cannot reach a server on loopback through DNS rebinding. `tool_call_parser`:
    the tool-call format of the model's answers (default: found from its chat template)."""
    app = FastAPI(title="ktransformers", version="0.1.0")
    from ..engine.harmony import harmony_chat
    from .metrics import Metrics
    tokenizer = scheduler.tokenizer
    config = scheduler.engine.config
    chat = ChatFormat(tokenizer, harmony_chat(tokenizer), getattr(config, "model_type", None), tool_call_parser,
                      _LazyGrammars(tokenizer, config.vocab_size, scheduler.eos_ids))
    served = _Served(scheduler, tokenizer, model_name, default_max_tokens, gen_defaults or SamplingParams(),
                     int(time.time()), chat, Metrics(scheduler, model_name))
    _add_error_handlers(app)
    _limit_body(app, max_body_bytes)
    if allowed_hosts is not None:
        _check_host(app, allowed_hosts)
    if api_key:
        _require_api_key(app, api_key)
    _add_openai_routes(app, served)
    _add_ollama_routes(app, served)
    from .anthropic import add_anthropic_routes
    add_anthropic_routes(app, served)
    _add_status_routes(app, served)
    return app


class _LazyGrammars:
    """The model's grammar compiler, made on the first constrained request (llguidance reads the
    whole vocabulary once)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self._args, self._grammars = (tokenizer, vocab_size, stop_ids), None

    def _get(self):
        if self._grammars is None:
            from ..engine.grammar import available, grammars_for
            why = available()
            if why:
                raise ChatError(why, "response_format")
            self._grammars = grammars_for(*self._args)
        return self._grammars

    def json_schema(self, schema, strict: bool = True):
        return self._get().json_schema(schema, strict)

    def json_object(self):
        return self._get().json_object()


def _message_dict(m: ChatMessage) -> dict:
    out = {"role": m.role, "content": _text(m.content)}
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(m, key)
        if value is not None:
            out[key] = value
    return out


@dataclass
class _Served:
    """What every route shares: the scheduler, the name clients ask for, and the request defaults."""

    scheduler: Scheduler
    tokenizer: Any
    model_name: str
    default_max_tokens: int
    defaults: SamplingParams
    created: int  # when the app was made: the model's "created" in the listings
    chat: ChatFormat
    metrics: Any = None  # metrics.Metrics

    def sampling(self, temperature, top_p, top_k, repetition_penalty, seed) -> SamplingParams:
        """The served defaults, overridden by whichever of the request's values it set."""
        base = {k: getattr(self.defaults, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty",
                                                       "do_sample")}
        over = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
        return SamplingParams(**{**base, **{k: v for k, v in over.items() if v is not None}, "seed": seed})

    def check_model(self, name: str | None) -> None:
        if name and name not in (self.model_name, "default") and not name.startswith(self.model_name + ":"):
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r}",
                           "model", "not_found_error")

    def prepare_chat(self, messages: list, options: ChatOptions):
        """(prompt ids, its grammar or None, the Answer that reads its text) of a chat, in a
        worker thread's time (templates, tokenizing and grammar compiles can take a while)."""
        conversation = [m if isinstance(m, dict) else _message_dict(m) for m in messages]
        ids, inside = self.chat.render(conversation, options)
        return ids, self.chat.constraint(options), self.chat.answer(options, inside)

    def start(self, ids: list[int], params: SamplingParams, max_tokens: int | None, stop,
              ignore_eos: bool = False, chat: bool = False, grammar=None, api: str = "openai") -> Request:
        """Submit a request after checking that it fits the context; 429 when the queue is full. A
        chat of a harmony model has its answer split into channels (the final one is the text)."""
        max_tokens = self._max_tokens(ids, max_tokens)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stops):
            raise APIError(400, "a stop string must not be empty", "stop")
        r = Request(list(ids), params, max_tokens, stops, ignore_eos, asyncio.get_running_loop(), asyncio.Queue(),
                    grammar=grammar, keep_special=chat and self.chat.keeps_special, api=api)
        if chat and self.chat.harmony is not None:
            r.harmony, r.stop_ids = self.chat.harmony, frozenset(self.chat.harmony.stop_ids)
        try:
            self.scheduler.submit(r)
        except QueueFull as e:
            raise APIError(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
        return r

    def _max_tokens(self, ids: list[int], max_tokens: int | None) -> int:
        context = self.scheduler.context_length
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        if len(ids) >= context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in the context of "
                                f"{context} tokens (--cache_lens)", "messages", "context_length_exceeded")
        max_tokens = max_tokens or min(self.default_max_tokens, context - len(ids))
        if len(ids) + max_tokens > context:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceed the context "
                                f"of {context} tokens (--cache_lens)", "max_tokens", "context_length_exceeded")
        return max_tokens


async def _pieces(r: Request):
    """Text pieces of a request as they come (a harmony model's reasoning left out)."""
    async for kind, piece in events(r):
        if kind == "text":
            yield piece


async def _whole_text(r: Request, error_kind: str) -> str:
    """All of a request's text; a generation error becomes a 500 of `error_kind`."""
    try:
        return "".join([p async for p in _pieces(r)])
    except RuntimeError as e:
        raise APIError(500, str(e), kind=error_kind) from None


def _usage(r: Request) -> dict:
    return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.tokens),
            "total_tokens": len(r.prompt_ids) + len(r.tokens),
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def _finish(r: Request, answer: Answer | None = None) -> str:
    if answer is not None and answer.tool_calls:
        return "tool_calls"
    return "length" if r.finish_reason == "length" else "stop"


def _openai_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


# -- errors and the API key -------------------------------------------------------------------
def _error_response(path: str, status: int, message: str, param: str | None = None,
                    kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    if path.startswith("/api/"):  # Ollama's shape
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    if path.startswith("/v1/messages"):  # Anthropic's
        kinds = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
                 429: "rate_limit_error", 500: "api_error"}
        return JSONResponse({"type": "error", "error": {"type": kinds.get(status, "invalid_request_error"),
                                                        "message": message}}, status_code=status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return _error_response(request.url.path, exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(ChatError)
    async def _chat_error(request: HTTPRequest, exc: ChatError):
        """A chat the server cannot make of the request (tools, template, schema): a 400 naming the field."""
        return _error_response(request.url.path, 400, str(exc), exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own errors (an unknown route, a body it cannot parse: not UTF-8,
        or JSON nested too deep for the parser) in the API's shape."""
        message = exc.detail if isinstance(exc.detail, str) else "invalid request"
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the body is not valid JSON (not UTF-8, or nested too deep)"
        return _error_response(request.url.path, exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
        return _error_response(request.url.path, 400 if first.get("type") == "json_invalid" else 422, message,
                               where or None)


class _BodyTooLarge(HTTPException):
    """Raised by the counting receive; FastAPI lets HTTPExceptions through its body parsing."""

    def __init__(self, message: str, status: int = 413):
        super().__init__(status, message)


def _wrap(app: FastAPI, around) -> None:
    """Put `around(stack)`, an ASGI app around the app's own stack, outermost. A plain ASGI wrapper,
    not a middleware class: streamed bodies pass through untouched (no hop per chunk)."""
    inner = app.build_middleware_stack
    app.build_middleware_stack = lambda: around(inner())


def _guard(app: FastAPI, refuse) -> None:
    """Turn HTTP requests away where `refuse(scope)` gives their error response (None: let through)."""
    def around(stack):
        async def asgi(scope, receive, send):
            response = refuse(scope) if scope["type"] == "http" else None
            await (response or stack)(scope, receive, send)
        return asgi
    _wrap(app, around)


def _header(scope, name: bytes) -> bytes:
    return dict(scope.get("headers", [])).get(name, b"")


def _limit_body(app: FastAPI, limit: int, timeout: float | None = None) -> None:
    """Bodies over `limit` bytes get 413 in the API's shape: by their Content-Length before any
    byte is read, else (chunked) as soon as the bytes read pass it; never read whole into memory.
    A body whose next part does not come within `timeout` seconds gets 408 (a slow partial
    request holds no handler forever); once it has all come, receive waits unbounded again (a
    streaming response listens on it for the client's disconnect)."""
    message = f"the request body is larger than {limit} bytes (--max_request_mb)"
    timeout = BODY_TIMEOUT_S if timeout is None else timeout

    def too_long(scope):
        length = _header(scope, b"content-length")
        return _error_response(scope.get("path", ""), 413, message) if length.isdigit() and int(length) > limit else None
    _guard(app, too_long)

    def around(stack):
        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return await stack(scope, receive, send)
            seen, complete = 0, False

            async def counted():
                nonlocal seen, complete
                if complete:
                    return await receive()
                try:
                    event = await asyncio.wait_for(receive(), timeout)
                except asyncio.TimeoutError:
                    raise _BodyTooLarge(f"the request body did not arrive within {timeout:g} s", 408) from None
                seen += len(event.get("body", b""))
                complete = event.get("type") != "http.request" or not event.get("more_body", False)
                if seen > limit:
                    raise _BodyTooLarge(message)
                return event
            try:
                await stack(scope, counted, send)
            except _BodyTooLarge as e:  # (raised where FastAPI's handlers do not see it: outside a route)
                await _error_response(scope.get("path", ""), e.status_code, e.detail)(scope, receive, send)
        return asgi
    _wrap(app, around)


def _host_name(header: bytes) -> str:
    """The name of a Host header, without its port ('[::1]:8080' -> '::1')."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _check_host(app: FastAPI, allowed: tuple[str, ...]) -> None:
    """Requests whose Host is not an allowed name get 421 in the API's shape."""
    names = {name.lower() for name in allowed}

    def foreign(scope):
        host = _host_name(_header(scope, b"host"))
        return None if host in names else _error_response(scope.get("path", ""), 421,
                                                          f"Host {host!r} is not served here (--allowed_hosts)")
    _guard(app, foreign)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """/v1, /api and /metrics answer 401 without `Authorization: Bearer api_key` or (Anthropic's
    clients) `x-api-key: api_key`."""
    bearer, key = f"Bearer {api_key}".encode(), api_key.encode()

    def unauthorized(scope):
        path = scope.get("path", "")
        if not (path.startswith("/v1/") or path.startswith("/api/") or path == "/metrics"):
            return None
        if _header(scope, b"authorization") == bearer or _header(scope, b"x-api-key") == key:
            return None
        return _error_response(path, 401, "missing or wrong API key (Authorization: Bearer ... or x-api-key)",
                               kind="authentication_error")
    _guard(app, unauthorized)


# -- OpenAI -----------------------------------------------------------------------------------
def _add_openai_routes(app: FastAPI, s: _Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody):
        options = ChatOptions.from_openai(body.tools, body.tool_choice, body.parallel_tool_calls, body.response_format,
                                          body.reasoning_effort, body.chat_template_kwargs)
        ids, grammar, answer = await asyncio.to_thread(s.prepare_chat, body.messages, options)
        return await _openai_run(s, body, ids, chat=True, grammar=grammar, answer=answer)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompt = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
        return await _openai_run(s, body, await asyncio.to_thread(s.tokenizer.encode, prompt), chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                            "owned_by": "ktransformers",
                                            "context_length": s.scheduler.context_length,
                                            "max_model_len": s.scheduler.context_length}]}


@dataclass(frozen=True)
class _OpenAIReply:
    """The envelope of one OpenAI response: a chat completion or a text completion."""

    id: str
    chat: bool
    model: str

    @property
    def kind(self) -> str:
        """The response's "object" field."""
        return "chat.completion" if self.chat else "text_completion"

    def choice(self, text: str, reason: str | None, reasoning: str = "", tool_calls=()) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        message = {"role": "assistant", "content": text if text.strip() or not tool_calls else None}
        if reasoning:  # (a thinking model's reasoning, as vLLM and SGLang return it)
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [_openai_call(c) for c in tool_calls]
        return {"index": 0, "message": message, "finish_reason": reason}

    def chunk(self, delta_or_text, reason=None) -> str:
        """One server-sent event: a chat delta (dict) or a piece of completion text."""
        choice = ({"index": 0, "delta": delta_or_text, "finish_reason": reason} if self.chat else
                  {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": reason})
        event = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind,
                 "created": int(time.time()), "model": self.model, "choices": [choice]}
        return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _openai_run(s: _Served, body: OpenAISampling, ids: list[int], chat: bool, grammar=None,
                      answer: Answer | None = None):
    s.check_model(body.model)
    params = s.sampling(body.temperature, body.top_p, body.top_k, body.repetition_penalty, body.seed)
    r = s.start(ids, params, body.max_completion_tokens or body.max_tokens, body.stop, body.ignore_eos, chat=chat,
                grammar=grammar)
    reply = _OpenAIReply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", chat, s.model_name)
    if not body.stream:
        whole = await whole_answer(r, answer)
        choice = reply.choice(whole["text"], _finish(r, answer), whole["reasoning"], whole["tool_calls"])
        return {"id": reply.id, "object": reply.kind, "created": int(time.time()), "model": s.model_name,
                "choices": [choice], "usage": _usage(r)}
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(_openai_events(r, reply, include_usage, answer), media_type="text/event-stream")


async def _openai_events(r: Request, reply: _OpenAIReply, include_usage: bool, answer: Answer | None):
    if reply.chat:
        yield reply.chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for kind, piece in events(r, answer):
            if kind == "reasoning":
                yield reply.chunk({"reasoning_content": piece})
            elif kind == "tool_call":
                yield reply.chunk({"tool_calls": [_openai_call(piece, calls)]})
                calls += 1
            else:
                yield reply.chunk({"content": piece} if reply.chat else piece)
    except RuntimeError as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
        return
    yield reply.chunk({} if reply.chat else "", _finish(r, answer))
    if include_usage:
        usage = {"id": reply.id, "object": reply.kind + ".chunk", "choices": [], "usage": _usage(r)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


# -- Ollama -----------------------------------------------------------------------------------
def _ollama_options(fmt, think, tools=None) -> ChatOptions:
    """Ollama's `format` ("json" or a JSON schema), `think` and `tools` as ChatOptions."""
    o = ChatOptions(tools=check_tools(tools))
    if fmt == "json":
        o.json_object = True
    elif isinstance(fmt, dict):
        o.schema = fmt
    elif fmt not in (None, ""):
        raise ChatError('format must be "json" or a JSON schema', "format")
    if think is not None:
        o.template_kwargs["enable_thinking"] = bool(think)
    return o


def _add_ollama_routes(app: FastAPI, s: _Served) -> None:
    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateBody):
        options = _ollama_options(body.format, body.think)
        if body.raw or not s.chat.template and s.chat.harmony is None:
            ids = await asyncio.to_thread(s.tokenizer.encode, (body.system + "\n" if body.system else "") + body.prompt)
            return await _ollama_run(s, body, ids, False, await asyncio.to_thread(s.chat.constraint, options), None)
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        ids, grammar, answer = await asyncio.to_thread(s.prepare_chat, messages, options)
        return await _ollama_run(s, body, ids, False, grammar, answer)

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatBody):
        options = _ollama_options(body.format, body.think, body.tools)
        messages = [_ollama_message_in(m) for m in body.messages]
        ids, grammar, answer = await asyncio.to_thread(s.prepare_chat, messages, options)
        return await _ollama_run(s, body, ids, True, grammar, answer)

    @app.get("/api/tags")
    async def ollama_tags():
        return {"models": [{"name": s.model_name, "model": s.model_name,
                            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.created)),
                            "size": 0, "details": _ollama_details(s)}]}

    @app.post("/api/show")
    async def ollama_show(body: OllamaShowBody):
        s.check_model(body.model or body.name)
        config = s.scheduler.engine.config
        arch = getattr(config, "model_type", "unknown")
        capabilities = ["completion"] + (["tools"] if s.chat.tool_parser is not None or s.chat.harmony else []) + \
            (["thinking"] if s.chat.thinks or s.chat.harmony else [])
        return {"modelfile": "", "parameters": "", "template": s.chat.template or "",
                "details": _ollama_details(s), "capabilities": capabilities,
                "model_info": {"general.architecture": arch,
                               f"{arch}.context_length": s.scheduler.context_length,
                               f"{arch}.embedding_length": getattr(config, "hidden_size", 0),
                               f"{arch}.block_count": getattr(config, "num_hidden_layers", 0)}}


def _ollama_details(s: _Served) -> dict:
    return {"format": "gguf", "family": getattr(s.scheduler.engine.config, "model_type", s.model_name)}


def _ollama_message_in(m: ChatMessage) -> dict:
    """An Ollama chat message in OpenAI's shape: its tool calls' arguments (objects) as text, its
    `thinking` as reasoning_content."""
    out = _message_dict(m)
    calls = []
    for i, call in enumerate(m.tool_calls or ()):
        fn = call.get("function") or {}
        args = fn.get("arguments", {})
        calls.append({"id": call.get("id", f"call_{i}"), "type": "function",
                      "function": {"name": fn.get("name", ""), "arguments": args if isinstance(args, str)
                                   else json.dumps(args)}})
    if calls:
        out["tool_calls"] = calls
    thinking = (m.model_extra or {}).get("thinking")
    if isinstance(thinking, str):
        out["reasoning_content"] = thinking
    return out


async def _ollama_run(s: _Served, body, ids: list[int], chat: bool, grammar, answer: Answer | None):
    s.check_model(body.model)
    o = body.options
    params = s.sampling(o.temperature, o.top_p, o.top_k, o.repeat_penalty, o.seed)
    max_tokens = o.num_predict if o.num_predict and o.num_predict > 0 else None
    r = s.start(ids, params, max_tokens, o.stop, chat=answer is not None, grammar=grammar, api="ollama")
    model = body.model or s.model_name
    if not body.stream:
        whole = await whole_answer(r, answer, "invalid_request_error")
        return _ollama_message(r, model, chat, whole["text"], True, whole["reasoning"], whole["tool_calls"], answer)
    return StreamingResponse(_ollama_lines(r, model, chat, answer), media_type="application/x-ndjson")


def _ollama_message(r: Request, model: str, chat: bool, piece: str, done: bool, thinking: str = "",
                    tool_calls=(), answer: Answer | None = None) -> dict:
    out = {"model": model, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if chat:
        message = {"role": "assistant", "content": piece}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                     for c in tool_calls]
        out["message"] = message
    else:
        out["response"] = piece
        if thinking:
            out["thinking"] = thinking
    out["done"] = done
    if done:  # Ollama's counts and durations (nanoseconds)
        first = r.t_first or r.t_done
        out.update({"done_reason": "stop" if _finish(r, answer) == "tool_calls" else _finish(r),
                    "total_duration": int((r.t_done - r.t_submit) * 1e9),
                    "prompt_eval_count": len(r.prompt_ids), "eval_count": len(r.tokens),
                    "prompt_eval_duration": int((first - r.t_submit) * 1e9),
                    "eval_duration": int((r.t_done - first) * 1e9)})
    return out


async def _ollama_lines(r: Request, model: str, chat: bool, answer: Answer | None):
    try:
        async for kind, piece in events(r, answer):
            if kind == "tool_call":
                line = _ollama_message(r, model, chat, "", False, tool_calls=[piece])
            elif kind == "reasoning":
                line = _ollama_message(r, model, chat, "", False, thinking=piece)
            else:
                line = _ollama_message(r, model, chat, piece, False)
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except RuntimeError as e:
        yield json.dumps({"error": str(e)}) + "\n"
        return
    yield json.dumps(_ollama_message(r, model, chat, "", True, answer=answer)) + "\n"


# -- the rest ---------------------------------------------------------------------------------
def _add_status_routes(app: FastAPI, s: _Served) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": s.model_name, "running": len(s.scheduler.running),
                "engine": s.scheduler.engine_stats()}

    @app.get("/metrics")
    async def metrics():
        if s.metrics is None or s.metrics.registry is None:
            raise APIError(404, "metrics need the prometheus-client package: pip install prometheus-client")
        body, content_type = s.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")
