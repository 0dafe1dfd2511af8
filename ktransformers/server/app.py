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

import dataclasses

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
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.sampling import SamplingParams
from .scheduler import QueueFull, Request, Scheduler

STATIC = Path(__file__).parent / "static"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


# -- request bodies ---------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class OpenAISampling(_Body):
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


class CompletionBody(OpenAISampling):
    prompt: str | list[str]


class OllamaOptions(_Body):
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    repeat_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    num_predict: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: list[str] | None = None


class OllamaGenerateBody(_Body):
    model: str | None = None
    prompt: str = ""
    system: str | None = None
    stream: bool = True
    raw: bool = False
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)


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
               allowed_hosts: tuple[str, ...] | None = None) -> FastAPI:
    """`allowed_hosts`: the Host header names requests may carry (None: any), so that a page
    on another site cannot reach a server on loopback through DNS rebinding."""
    app = FastAPI(title="ktransformers", version="0.1.0")
    from ..engine.harmony import harmony_chat
    served = _Served(scheduler, scheduler.tokenizer, model_name, default_max_tokens, gen_defaults or SamplingParams(),
                     int(time.time()), harmony_chat(scheduler.tokenizer))
    _add_error_handlers(app)
    _limit_body(app, max_body_bytes)
    if allowed_hosts is not None:
        _check_host(app, allowed_hosts)
    if api_key:
        _require_api_key(app, api_key)
    _add_openai_routes(app, served)
    _add_ollama_routes(app, served)
    _add_status_routes(app, served)
    return app


@dataclass
class _Served:
    """What every route shares: the scheduler, the name clients ask for, and the request defaults."""

    scheduler: Scheduler
    tokenizer: Any
    model_name: str
    default_max_tokens: int
    defaults: SamplingParams
    created: int  # when the app was made: the model's "created" in the listings
    harmony: Any = None  # engine.harmony.HarmonyChat for a model of the harmony format (gpt-oss)

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

    def chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        conversation = [{"role": m.role, "content": _text(m.content)} for m in messages]
        if self.harmony is not None:
            try:
                return self.harmony.render(conversation)
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return list(self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                               tokenize=True, return_dict=False))
            except Exception as e:  # e.g. a template that insists on alternating roles
                raise APIError(400, f"the model's chat template refused the messages: {e}", "messages") from None
        return self.tokenizer.encode("\n".join(f"{m['role']}: {m['content']}" for m in conversation)
                                     + "\nassistant:")

    def start(self, ids: list[int], params: SamplingParams, max_tokens: int | None, stop,
              ignore_eos: bool = False, chat: bool = False) -> Request:
        """Submit a request after checking that it fits the context; 429 when the queue is full. A
        chat of a harmony model has its answer split into channels (the final one is the text)."""
        max_tokens = self._max_tokens(ids, max_tokens)
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stops):
            raise APIError(400, "a stop string must not be empty", "stop")
        r = Request(list(ids), params, max_tokens, stops, ignore_eos, asyncio.get_running_loop(), asyncio.Queue())
        if chat and self.harmony is not None:
            r.harmony, r.stop_ids = self.harmony, frozenset(self.harmony.stop_ids)
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


async def _events(r: Request):
    """(kind, text) pieces of a request as they come, kind "text" or "reasoning"; cancels it when
    the consumer goes away."""
    try:
        while True:
            kind, payload = await r.events.get()
            if kind in ("text", "reasoning"):
                yield kind, payload
            elif kind == "error":
                raise RuntimeError(payload)
            else:
                return
    finally:
        if r.finish_reason is None:
            r.cancel()


async def _pieces(r: Request):
    """Text pieces of a request as they come (a harmony model's reasoning left out)."""
    async for kind, piece in _events(r):
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


def _finish(r: Request) -> str:
    return "length" if r.finish_reason == "length" else "stop"


# -- errors and the API key -------------------------------------------------------------------
def _error_response(path: str, status: int, message: str, param: str | None = None,
                    kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> JSONResponse:
    if path.startswith("/api/"):  # Ollama's shape
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return _error_response(request.url.path, exc.status, exc.message, exc.param, exc.kind, exc.headers)

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
    """/v1 and /api answer 401 without `Authorization: Bearer api_key`."""
    expected = f"Bearer {api_key}".encode()

    def unauthorized(scope):
        path = scope.get("path", "")
        if (path.startswith("/v1/") or path.startswith("/api/")) and _header(scope, b"authorization") != expected:
            return _error_response(path, 401, "missing or wrong API key (Authorization: Bearer ...)",
                                   kind="authentication_error")
        return None
    _guard(app, unauthorized)


# -- OpenAI -----------------------------------------------------------------------------------
def _add_openai_routes(app: FastAPI, s: _Served) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody):
        return await _openai_run(s, body, await asyncio.to_thread(s.chat_ids, body.messages), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompt = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
        return await _openai_run(s, body, await asyncio.to_thread(s.tokenizer.encode, prompt), chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                            "owned_by": "ktransformers",
                                            "context_length": s.scheduler.context_length}]}


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

    def choice(self, text: str, reason: str | None, streamed: bool, reasoning: str = "") -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if streamed:
            return {"index": 0, "delta": text, "finish_reason": reason}
        message = {"role": "assistant", "content": text}
        if reasoning:  # (a harmony model's analysis channel, as vLLM and SGLang return it)
            message["reasoning_content"] = reasoning
        return {"index": 0, "message": message, "finish_reason": reason}

    def chunk(self, delta_or_text, reason=None) -> str:
        """One server-sent event: a chat delta (dict) or a piece of completion text."""
        event = {"id": self.id, "object": self.kind + ".chunk" if self.chat else self.kind,
                 "created": int(time.time()), "model": self.model,
                 "choices": [self.choice(delta_or_text, reason, streamed=True)]}
        return f"data: {json.dumps(event)}\n\n"


async def _openai_run(s: _Served, body: OpenAISampling, ids: list[int], chat: bool):
    s.check_model(body.model)
    params = s.sampling(body.temperature, body.top_p, body.top_k, body.repetition_penalty, body.seed)
    r = s.start(ids, params, body.max_completion_tokens or body.max_tokens, body.stop, body.ignore_eos, chat=chat)
    reply = _OpenAIReply(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", chat, s.model_name)
    if not body.stream:
        parts = {"text": [], "reasoning": []}
        try:
            async for kind, piece in _events(r):
                parts[kind].append(piece)
        except RuntimeError as e:
            raise APIError(500, str(e), kind="server_error") from None
        choice = reply.choice("".join(parts["text"]), _finish(r), streamed=False, reasoning="".join(parts["reasoning"]))
        return {"id": reply.id, "object": reply.kind, "created": int(time.time()), "model": s.model_name,
                "choices": [choice], "usage": _usage(r)}
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(_openai_events(r, reply, include_usage), media_type="text/event-stream")


async def _openai_events(r: Request, reply: _OpenAIReply, include_usage: bool):
    if reply.chat:
        yield reply.chunk({"role": "assistant", "content": ""})
    try:
        async for kind, piece in _events(r):
            if kind == "reasoning":
                yield reply.chunk({"reasoning_content": piece})
            else:
                yield reply.chunk({"content": piece} if reply.chat else piece)
    except RuntimeError as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
        return
    yield reply.chunk({} if reply.chat else "", _finish(r))
    if include_usage:
        usage = {"id": reply.id, "object": reply.kind + ".chunk", "choices": [], "usage": _usage(r)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


# -- Ollama -----------------------------------------------------------------------------------
def _add_ollama_routes(app: FastAPI, s: _Served) -> None:
    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateBody):
        if body.raw or not getattr(s.tokenizer, "chat_template", None):
            ids = await asyncio.to_thread(s.tokenizer.encode, (body.system + "\n" if body.system else "") + body.prompt)
        else:
            messages = ([ChatMessage(role="system", content=body.system)] if body.system else []) + \
                [ChatMessage(role="user", content=body.prompt)]
            ids = await asyncio.to_thread(s.chat_ids, messages)
        return await _ollama_run(s, body, ids, chat=False)

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatBody):
        return await _ollama_run(s, body, await asyncio.to_thread(s.chat_ids, body.messages), chat=True)

    @app.get("/api/tags")
    async def ollama_tags():
        return {"models": [{"name": s.model_name, "model": s.model_name,
                            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.created)),
                            "size": 0, "details": {"format": "gguf", "family": s.model_name}}]}


async def _ollama_run(s: _Served, body: OllamaGenerateBody | OllamaChatBody, ids: list[int], chat: bool):
    s.check_model(body.model)
    o = body.options
    params = s.sampling(o.temperature, o.top_p, o.top_k, o.repeat_penalty, o.seed)
    max_tokens = o.num_predict if o.num_predict and o.num_predict > 0 else None
    r = s.start(ids, params, max_tokens, o.stop, chat=chat)
    model = body.model or s.model_name
    if not body.stream:
        return _ollama_message(r, model, chat, await _whole_text(r, "invalid_request_error"), done=True)
    return StreamingResponse(_ollama_lines(r, model, chat), media_type="application/x-ndjson")


def _ollama_message(r: Request, model: str, chat: bool, piece: str, done: bool) -> dict:
    out = {"model": model, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.update({"message": {"role": "assistant", "content": piece}} if chat else {"response": piece})
    out["done"] = done
    if done:  # Ollama's counts and durations (nanoseconds)
        first = r.t_first or r.t_done
        out.update({"done_reason": _finish(r), "total_duration": int((r.t_done - r.t_submit) * 1e9),
                    "prompt_eval_count": len(r.prompt_ids), "eval_count": len(r.tokens),
                    "prompt_eval_duration": int((first - r.t_submit) * 1e9),
                    "eval_duration": int((r.t_done - first) * 1e9)})
    return out


async def _ollama_lines(r: Request, model: str, chat: bool):
    try:
        async for piece in _pieces(r):
            yield json.dumps(_ollama_message(r, model, chat, piece, False)) + "\n"
    except RuntimeError as e:
        yield json.dumps({"error": str(e)}) + "\n"
        return
    yield json.dumps(_ollama_message(r, model, chat, "", True)) + "\n"


# -- the rest ---------------------------------------------------------------------------------
def _add_status_routes(app: FastAPI, s: _Served) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": s.model_name, "running": len(s.scheduler.running),
                "engine": dataclasses.asdict(s.scheduler.stats)}

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")
