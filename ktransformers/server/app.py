"""The HTTP API: OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), Ollama
(`/api/chat`, `/api/generate`, `/api/tags`), `/health`, and the web chat page at `/`.

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
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import SamplingParams
from .scheduler import QueueFull, Request, Scheduler

STATIC = Path(__file__).parent / "static"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


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
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0)
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
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    repeat_penalty: float | None = Field(default=None, gt=0)
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
    return "".join(part.get("text", "") for part in content if part.get("type", "text") == "text")


# -- the app ----------------------------------------------------------------------------------
def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, default_max_tokens: int = 512,
               gen_defaults: SamplingParams | None = None) -> FastAPI:
    app = FastAPI(title="ktransformers", version="0.1.0")
    tokenizer = scheduler.tokenizer
    defaults = gen_defaults or SamplingParams()
    created = int(time.time())

    def is_ollama(path: str) -> bool:
        return path.startswith("/api/")

    def error_response(path: str, status: int, message: str, param: str | None = None,
                       kind: str = "invalid_request_error") -> JSONResponse:
        if is_ollama(path):
            return JSONResponse({"error": message}, status_code=status)
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                            status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, exc: APIError):
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: HTTPRequest, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
        return error_response(request.url.path, 400 if first.get("type") == "json_invalid" else 422, message,
                              where or None)

    if api_key:  # a plain ASGI wrapper: streamed bodies pass through untouched (no per-chunk hop)
        inner = app.build_middleware_stack

        def guarded():
            stack = inner()
            expected = f"Bearer {api_key}".encode()

            async def asgi(scope, receive, send):
                path = scope.get("path", "")
                if scope["type"] == "http" and (path.startswith("/v1/") or path.startswith("/api/")):
                    if dict(scope.get("headers", [])).get(b"authorization", b"") != expected:
                        response = error_response(path, 401, "missing or wrong API key (Authorization: Bearer ...)",
                                                  kind="authentication_error")
                        await response(scope, receive, send)
                        return
                await stack(scope, receive, send)
            return asgi
        app.build_middleware_stack = guarded

    def sampling(temperature, top_p, top_k, repetition_penalty, seed) -> SamplingParams:
        over = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty}
        params = SamplingParams(**{**{k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k",
                                                                        "repetition_penalty", "do_sample")},
                                   **{k: v for k, v in over.items() if v is not None}, "seed": seed})
        return params

    def check_model(name: str | None) -> None:
        if name and name not in (model_name, "default") and not name.startswith(model_name + ":"):
            raise APIError(404, f"model {name!r} is not served here; this server serves {model_name!r}", "model",
                           "not_found_error")

    def chat_ids(messages: list[ChatMessage]) -> list[int]:
        conversation = [{"role": m.role, "content": _text(m.content)} for m in messages]
        if getattr(tokenizer, "chat_template", None):
            try:
                return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
            except Exception as e:  # e.g. a template that insists on alternating roles
                raise APIError(400, f"the model's chat template refused the messages: {e}", "messages") from None
        return tokenizer.encode("\n".join(f"{m['role']}: {m['content']}" for m in conversation) + "\nassistant:")

    def start(ids: list[int], params: SamplingParams, max_tokens: int | None, stop, ignore_eos: bool = False) -> Request:
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        if len(ids) >= scheduler.context_length:
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in the context of "
                                f"{scheduler.context_length} tokens (--cache_lens)", "messages", "context_length_exceeded")
        max_tokens = max_tokens or min(default_max_tokens, scheduler.context_length - len(ids))
        if len(ids) + max_tokens > scheduler.context_length:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceed the context "
                                f"of {scheduler.context_length} tokens (--cache_lens)", "max_tokens",
                           "context_length_exceeded")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        loop = asyncio.get_running_loop()
        r = Request(list(ids), params, max_tokens, stops, ignore_eos, loop, asyncio.Queue())
        try:
            scheduler.submit(r)
        except QueueFull as e:
            raise APIError(429, str(e), kind="rate_limit_error") from None
        return r

    async def pieces(r: Request):
        """Text pieces of a request as they come; cancels it when the consumer goes away."""
        try:
            while True:
                kind, payload = await r.events.get()
                if kind == "text":
                    yield payload
                elif kind == "error":
                    raise RuntimeError(payload)
                else:
                    return
        finally:
            if r.finish_reason is None:
                r.cancel()

    def usage(r: Request) -> dict:
        return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": len(r.tokens),
                "total_tokens": len(r.prompt_ids) + len(r.tokens),
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def finish(r: Request) -> str:
        return "length" if r.finish_reason == "length" else "stop"

    # -- OpenAI ---------------------------------------------------------------------------
    async def openai_run(body: OpenAISampling, ids: list[int], chat: bool):
        check_model(body.model)
        params = sampling(body.temperature, body.top_p, body.top_k, body.repetition_penalty, body.seed)
        r = start(ids, params, body.max_completion_tokens or body.max_tokens, body.stop, body.ignore_eos)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        if not body.stream:
            try:
                text = "".join([p async for p in pieces(r)])
            except RuntimeError as e:
                raise APIError(500, str(e), kind="server_error") from None
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish(r)}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish(r)})
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                    "choices": [choice], "usage": usage(r)}
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(delta_or_text, reason=None) -> str:
            choice = ({"index": 0, "delta": delta_or_text, "finish_reason": reason} if chat else
                      {"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": reason})
            event = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": int(time.time()),
                     "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(event)}\n\n"

        async def events():
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            try:
                async for piece in pieces(r):
                    yield chunk({"content": piece} if chat else piece)
            except RuntimeError as e:
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
                return
            yield chunk({} if chat else "", finish(r))
            if include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': kind + '.chunk', 'choices': [], 'usage': usage(r)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody):
        return await openai_run(body, chat_ids(body.messages), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompt = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
        return await openai_run(body, tokenizer.encode(prompt), chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "ktransformers", "context_length": scheduler.context_length}]}

    # -- Ollama ---------------------------------------------------------------------------
    async def ollama_run(body, ids: list[int], chat: bool):
        check_model(body.model)
        o = body.options
        params = sampling(o.temperature, o.top_p, o.top_k, o.repeat_penalty, o.seed)
        max_tokens = o.num_predict if o.num_predict and o.num_predict > 0 else None
        r = start(ids, params, max_tokens, o.stop)

        def message(piece: str, done: bool) -> dict:
            out = {"model": body.model or model_name, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            out.update({"message": {"role": "assistant", "content": piece}} if chat else {"response": piece})
            out["done"] = done
            if done:
                out.update({"done_reason": finish(r), "total_duration": int((r.t_done - r.t_submit) * 1e9),
                            "prompt_eval_count": len(r.prompt_ids), "eval_count": len(r.tokens),
                            "prompt_eval_duration": int(((r.t_first or r.t_done) - r.t_submit) * 1e9),
                            "eval_duration": int((r.t_done - (r.t_first or r.t_done)) * 1e9)})
            return out
        if not body.stream:
            try:
                text = "".join([p async for p in pieces(r)])
            except RuntimeError as e:
                raise APIError(500, str(e)) from None
            return message(text, True)

        async def lines():
            try:
                async for piece in pieces(r):
                    yield json.dumps(message(piece, False)) + "\n"
            except RuntimeError as e:
                yield json.dumps({"error": str(e)}) + "\n"
                return
            yield json.dumps(message("", True)) + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateBody):
        if body.raw or not getattr(tokenizer, "chat_template", None):
            text = (body.system + "\n" if body.system else "") + body.prompt
            ids = tokenizer.encode(text)
        else:
            messages = ([ChatMessage(role="system", content=body.system)] if body.system else []) + \
                [ChatMessage(role="user", content=body.prompt)]
            ids = chat_ids(messages)
        return await ollama_run(body, ids, chat=False)

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatBody):
        return await ollama_run(body, chat_ids(body.messages), chat=True)

    @app.get("/api/tags")
    async def ollama_tags():
        return {"models": [{"name": model_name, "model": model_name,
                            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                            "size": 0, "details": {"format": "gguf", "family": model_name}}]}

    # -- the rest -------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "running": len(scheduler.running)}

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html")

    return app
