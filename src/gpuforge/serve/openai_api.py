"""OpenAI-style routes for a causal LM behind a GenerationEngine (serve/generate.py).

    router = create_openai_router(lambda: app.state.engine)
    app.include_router(router)      # the engine getter returns None while loading: 503 with Retry-After

    POST /v1/completions        {"prompt": "def add(a, b):", "max_tokens": 32, "stop": ["\\n\\n"]}
    POST /v1/chat/completions   {"messages": [{"role": "user", "content": "hi"}], "stream": true}
    GET  /v1/models             the one model served

Request fields as OpenAI clients send them: model (echoed; one model is served), prompt (a string, a
list of one string, or token ids) or messages, max_tokens (chat: also max_completion_tokens), temperature
(0 = greedy), top_p, stop (a string or up to 4), stream (server-sent events ending with `data: [DONE]`;
stream_options.include_usage adds a usage chunk), n (1 only), seed. Non-streamed answers carry `usage`.
Fields asking for what is not implemented (logprobs, echo, best_of > 1, penalties, logit_bias, tools,
suffix, response_format other than text) are refused with 422 rather than ignored; other unknown fields
are ignored.

max_tokens defaults to 16 for a completion and to the rest of the context for a chat answer.

Errors come as {"error": {"message", "type", "param", "code"}, "detail": message}, where OpenAI clients
look: 422 for bad input (empty prompt, max_tokens < 1, n != 1, a body that is not JSON, ...), 413 for a
prompt that leaves no room in the model's context (prompts are never truncated), 400 with code
"context_length_exceeded" for a max_tokens that would run past the context after the prompt (the message
names the context and the most that fits). 429 with Retry-After when the engine's queue is full, 503
while the model loads. A client that disconnects frees its place in the batch. In the worker, a missing
key (401) and a body over its limit (413) are refused before the route runs, in the same shape.

Chat prompts use the tokenizer's chat template when it has one; otherwise one line per message,
"role: content" (developer counts as system), then "assistant:" for the model to continue, and the
answer stops before a "\\nuser:" the model starts on its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gpuforge.serve.batcher import QueueFull
from gpuforge.serve.endpoint import client_gone
from gpuforge.serve.generate import Generation, GenerationEngine, PromptTooLong, SamplingParams

MAX_PROMPT_CHARS = 1_000_000  # refused (413) before tokenizing
MAX_STOPS = 4
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
FALLBACK_STOP = "\nuser:"
# Fields OpenAI clients may send that this server does not implement: refused unless neutral.
UNSUPPORTED = (
    "logprobs top_logprobs echo best_of logit_bias suffix tools functions tool_choice function_call"
    " response_format presence_penalty frequency_penalty"
).split()
NEUTRAL = {"best_of": [1], "response_format": [{"type": "text"}], "tool_choice": ["none", "auto"]}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields this server has no use for (user, ...)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    seed: int | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (send one request per answer)")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    def wants_usage(self) -> bool:
        """A streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _supported(self):
        for key in UNSUPPORTED:
            value = (self.model_extra or {}).get(key)
            if value not in (None, False, 0, "", [], {}) and value not in NEUTRAL.get(key, []):
                raise ValueError(f"{key}: not supported by this server")
        return self


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(description="text, a list of one text, or token ids")
    max_tokens: int | None = Field(None, ge=1, description=f"default {DEFAULT_COMPLETION_TOKENS}")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" for part in self.content):
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT, "messages: only text content is supported"
            )
        return "".join(part.text or "" for part in self.content)


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class OpenAIError(HTTPException):
    """An HTTPException that also names the request field at fault and OpenAI's code for the error."""

    def __init__(self, status_code: int, detail: str, param: str | None = None, code: str | None = None):
        super().__init__(status_code, detail)
        self.param, self.code = param, code


def create_openai_router(
    get_engine: Callable[[], GenerationEngine | None],
    model_name: str | None = None,
    dependencies: Sequence[Any] = (),
) -> APIRouter:
    """Routes under /v1 for the engine `get_engine()` returns (None while loading: 503). `model_name`
    defaults to the engine's; `dependencies` (e.g. an API-key check) apply to every route."""
    router = APIRouter(
        prefix="/v1", tags=["openai"], dependencies=list(dependencies), route_class=_OpenAIErrors
    )

    @router.post("/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse | Any:
        """Continue a prompt (OpenAI's completions API); `stream: true` for server-sent events."""
        engine = _ready(get_engine)
        return await _complete(engine, body, request, model_name or engine.name)

    @router.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatRequest, request: Request) -> ChatCompletionResponse | Any:
        """Answer a conversation (OpenAI's chat completions API); `stream: true` for server-sent events."""
        engine = _ready(get_engine)
        return await _chat(engine, body, request, model_name or engine.name)

    @router.get("/models")
    def models() -> dict[str, Any]:
        """The model this server answers with."""
        engine = _ready(get_engine)
        return {
            "object": "list",
            "data": [
                {"id": model_name or engine.name, "object": "model", "created": 0, "owned_by": "gpuforge"}
            ],
        }

    return router


async def _complete(
    engine: GenerationEngine, body: CompletionRequest, request: Request, model: str
) -> CompletionResponse | Response:
    prompt = _completion_prompt(body)
    if isinstance(prompt, str):  # off the event loop: a long prompt must not stall other requests
        prompt = await asyncio.to_thread(engine.encode, prompt)
    sampling = _sampling(engine, body, prompt, ("max_tokens", body.max_tokens), DEFAULT_COMPLETION_TOKENS)
    generation = _submit(engine, prompt, sampling, body.stream)
    answer = _Answer(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, "text_completion")
    if body.stream:
        return _stream(generation, answer, _completion_choice, body.wants_usage())
    result = await _collect(request, generation)
    if isinstance(result, JSONResponse):
        return result
    return CompletionResponse(
        id=answer.id,
        created=answer.created,
        model=model,
        usage=_usage(result),
        choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
    )


async def _chat(
    engine: GenerationEngine, body: ChatRequest, request: Request, model: str
) -> ChatCompletionResponse | Response:
    messages = _chat_messages(body)
    prompt, extra_stop = await asyncio.to_thread(chat_prompt, engine, messages)  # off the event loop
    if body.max_completion_tokens is not None:
        asked = ("max_completion_tokens", body.max_completion_tokens)
    else:
        asked = ("max_tokens", body.max_tokens)
    sampling = _sampling(engine, body, prompt, asked, None, extra_stop)
    generation = _submit(engine, prompt, sampling, body.stream)
    answer = _Answer(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, "chat.completion.chunk")
    if body.stream:
        return _stream(generation, answer, _chat_choice, body.wants_usage(), opening=_chat_choice(None, None))
    result = await _collect(request, generation)
    if isinstance(result, JSONResponse):
        return result
    return ChatCompletionResponse(
        id=answer.id,
        created=answer.created,
        model=model,
        usage=_usage(result),
        choices=[ChatChoice(message=ChatMessageOut(content=result.text), finish_reason=result.finish_reason)],
    )


def _ready(get_engine: Callable[[], GenerationEngine | None]) -> GenerationEngine:
    engine = get_engine()
    if engine is None:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, "the model is still loading", headers={"Retry-After": "5"}
        )
    return engine


def _completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (422 for none, or for several)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "prompt: one prompt per request")
        prompt = prompt[0]
    if not prompt:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "prompt: empty")
    if isinstance(prompt, str) and len(prompt) > MAX_PROMPT_CHARS:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"prompt: {len(prompt)} characters, over the {MAX_PROMPT_CHARS} allowed",
        )
    return prompt


def _chat_messages(body: ChatRequest) -> list[dict[str, str]]:
    """The conversation as {"role", "content"} texts (developer counts as system); 422 for none, 413 for
    one over MAX_PROMPT_CHARS in all."""
    if not body.messages:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "messages: empty")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
    ]
    if sum(len(m["content"]) for m in messages) > MAX_PROMPT_CHARS:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE, f"messages: over the {MAX_PROMPT_CHARS} characters allowed"
        )
    return messages


def _sampling(
    engine: GenerationEngine,
    body: _Request,
    prompt: list[int],
    asked: tuple[str, int | None],
    default: int | None,
    extra_stop: Sequence[str] = (),
) -> SamplingParams:
    """How to sample `prompt`; `asked` is the max_tokens field's name and value (None: `default`, or
    the rest of the context). An answer that cannot fit after the prompt is refused, not cut short."""
    field_name, max_tokens = asked
    room = engine.context - len(prompt)  # < 1: the engine refuses the prompt itself (413)
    if max_tokens is not None and room >= 1 and max_tokens > room:
        raise OpenAIError(
            status.HTTP_400_BAD_REQUEST,
            f"{field_name}: {max_tokens} after the prompt's {len(prompt)} tokens is "
            f"{len(prompt) + max_tokens}, over the model's context of {engine.context} tokens; ask for "
            f"at most {room}",
            param=field_name,
            code="context_length_exceeded",
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        max_tokens=max_tokens or max(1, min(default or room, room)),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=[*stops, *extra_stop],
        seed=body.seed,
    )


def _submit(
    engine: GenerationEngine, prompt: str | list[int], sampling: SamplingParams, stream: bool
) -> Generation:
    """The engine's Generation; its refusals as HTTP answers (429 queue full, 413, 422)."""
    try:
        return engine.submit(prompt, sampling, stream=stream)
    except QueueFull as err:
        raise HTTPException(
            status.HTTP_429_TOO_MANY_REQUESTS,
            str(err),
            headers={"Retry-After": str(math.ceil(err.retry_after_s))},
        ) from None
    except PromptTooLong as err:
        raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, f"prompt: {err}") from None
    except ValueError as err:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"prompt: {err}") from None


def chat_prompt(engine: GenerationEngine, messages: list[dict[str, str]]) -> tuple[list[int], list[str]]:
    """Token ids of a conversation, and the stop strings its format implies (none with a template)."""
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return engine.encode(text, add_special_tokens=False), []
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return engine.encode(text), [FALLBACK_STOP]


def _usage(result) -> Usage:
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
    )


async def _collect(request: Request, generation: Generation):
    """The whole answer; a client that disconnects first cancels it (a 499 nobody reads)."""
    work = asyncio.ensure_future(generation.collect())
    gone = asyncio.ensure_future(client_gone(request))  # waits for the disconnect: no polling
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return JSONResponse({"detail": "client closed the request"}, 499)
        return work.result()
    except HTTPException:
        raise
    except Exception as err:
        raise HTTPException(status.HTTP_500_INTERNAL_SERVER_ERROR, f"generation failed: {err}") from None
    finally:
        gone.cancel()
        generation.cancel()


@dataclass(frozen=True)
class _Answer:
    """What every streamed chunk of one answer carries: its id, creation time, model and object kind."""

    id: str
    created: int
    model: str
    kind: str  # "text_completion" or "chat.completion.chunk"

    def chunk(self, choice: dict[str, Any] | None, usage: Usage | None = None) -> dict[str, Any]:
        """A chunk with `choice`, or (None) the closing one with `usage` and no choice."""
        head = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model}
        if choice is None:
            return {**head, "choices": [], "usage": usage.model_dump()}
        return {**head, "choices": [choice]}


def _completion_choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


def _chat_choice(text: str | None, finish: str | None) -> dict[str, Any]:
    """A chat chunk's choice; text None: the opening one, that names the role."""
    delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
    return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}


def _stream(
    generation: Generation,
    answer: _Answer,
    choice: Callable[[str, str | None], dict[str, Any]],
    include_usage: bool,
    opening: dict[str, Any] | None = None,
) -> StreamingResponse:
    """The answer as server-sent events: `opening` first if any, each text delta, the finish reason, the
    usage if asked for, then `data: [DONE]`."""

    async def events() -> AsyncIterator[str]:
        try:
            if opening is not None:
                yield _sse(answer.chunk(opening))
            async for event in generation:
                if event.text:
                    yield _sse(answer.chunk(choice(event.text, None)))
                if event.finish_reason is not None:
                    yield _sse(answer.chunk(choice("", event.finish_reason)))
                    if include_usage:
                        yield _sse(answer.chunk(None, _usage(event)))
            yield "data: [DONE]\n\n"
        except Exception as err:  # the status line is sent already: say it in the stream
            yield _sse({"error": {"message": f"generation failed: {err}", "type": "server_error"}})
            yield "data: [DONE]\n\n"
        finally:
            generation.cancel()  # also when the client went away mid-stream

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _OpenAIErrors(APIRoute):
    """Errors of these routes in the shape OpenAI clients read ({"error": {"message", "type", ...}}), with
    gpuforge's usual "detail" beside it; the router cannot install app-wide exception handlers."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as err:
                return error_response(422, _validation_message(err.errors()))
            except OpenAIError as err:
                return error_response(err.status_code, str(err.detail), err.headers, err.param, err.code)
            except HTTPException as err:
                return error_response(err.status_code, str(err.detail), err.headers)

        return route


def error_response(
    code: int,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    error_code: str | None = None,
) -> JSONResponse:
    """An error as OpenAI clients read it; also the worker's 401 and 413 on /v1 (serve/gate.py)."""
    kind = {429: "rate_limit_error", 401: "authentication_error"}.get(code)
    kind = kind or ("server_error" if code >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param, "code": error_code}
    body = {"error": error, "detail": message}
    return JSONResponse(body, code, headers=headers)


def _validation_message(errors: Sequence[Any]) -> str:
    """pydantic's errors as one line: `max_tokens: Input should be greater than or equal to 1; ...`."""
    parts = []
    for error in errors:
        if error.get("type") == "json_invalid":  # loc is ("body", offset): say what is wrong instead
            why = (error.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not JSON ({why})" if why else "the body is not JSON")
            continue
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
