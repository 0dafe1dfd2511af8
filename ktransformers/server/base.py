"""What the server's API modules share: the request-body base model, APIError (answered in
each API's own shape by app._error_response), and reading a request's events through a chat's
Answer."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .chat import Answer
from .scheduler import Request


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


async def events(r: Request, answer: Answer | None = None):
    """(kind, payload) pieces of a request as they come: "text" and "reasoning" (str) and, read
    through a chat's `answer`, "tool_call" (a toolcalls.ToolCall); cancels the request when the
    consumer goes away."""
    try:
        while True:
            kind, payload = await r.events.get()
            if kind in ("text", "reasoning", "tool"):
                if answer is not None:
                    for event in answer.push(kind, payload):
                        yield event
                elif kind != "tool":
                    yield kind, payload
            elif kind == "error":
                raise RuntimeError(payload)
            else:
                if answer is not None:
                    for event in answer.finish():
                        yield event
                return
    finally:
        if r.finish_reason is None:
            r.cancel()


async def whole_answer(r: Request, answer: Answer | None, error_kind: str = "server_error") -> dict:
    """{"text", "reasoning", "tool_calls"} of a whole answer; a generation error becomes a 500."""
    parts = {"text": [], "reasoning": [], "tool_call": []}
    try:
        async for kind, piece in events(r, answer):
            parts[kind].append(piece)
    except RuntimeError as e:
        raise APIError(500, str(e), kind=error_kind) from None
    return {"text": "".join(parts["text"]), "reasoning": "".join(parts["reasoning"]), "tool_calls": parts["tool_call"]}
