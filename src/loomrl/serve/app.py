"""The endpoint's HTTP side: a FastAPI app (served by uvicorn, ``loomrl.serve.server``).

Routes, under ``/v1`` and, bound to an episode, under ``/e/{episode_id}/v1`` (an agent's
``base_url``; the ``X-Loomrl-Episode`` header does the same):

- ``GET /v1/models``; ``POST /v1/completions``; ``POST /v1/chat/completions`` (``stream``:
  server-sent events ending in ``data: [DONE]``);
- ``POST /v1/episodes``: open an episode (for a harness in another process: it takes the
  next row the job hands out, when the job runs external episodes); ``POST
  /v1/episodes/{id}/reward``: close it with ``{"reward": float, "metrics": {...}}``;
- ``GET /healthz``: no token needed, says nothing but ok.

Every other request needs ``Authorization: Bearer <the job's token>``: none is 401, another
token 403. Errors come back as OpenAI error bodies, so the ``openai`` client raises its own
exception classes (``AuthenticationError``, ``PermissionDeniedError``, ``NotFoundError`` ...).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Model
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from loomrl.runtime.supervision import ExecutorLostError
from loomrl.serve.episodes import Episode, EpisodeBook, EpisodeError
from loomrl.serve.policy import RequestError, ServedPolicy
from loomrl.serve.protocol import (
    EPISODE_HEADER,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
)


class RewardBody(BaseModel):
    reward: float | None = Field(
        None, description="The episode's reward; None: the job's scorers score it."
    )
    metrics: dict[str, float] = Field(default_factory=dict)


class OpenBody(BaseModel):
    row: dict[str, Any] | None = None


@dataclass
class ServeState:
    """What the routes share: the policy, the episodes, the job's token and, for a job that
    runs external episodes, where ``POST /v1/episodes`` takes the next one from."""

    policy: ServedPolicy
    book: EpisodeBook
    token: str
    model_name: str
    max_body_bytes: int = 4 << 20
    # The job's next episode for a harness (None: a harness opens free-standing ones).
    claim: Callable[[], Awaitable[Episode]] | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def _check_token(state: ServeState, request: Request) -> JSONResponse | None:
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        state.count("serve/unauthenticated")
        return _error(
            401,
            "this endpoint needs 'Authorization: Bearer <the job's token>'",
            "authentication_error",
        )
    if not secrets.compare_digest(given.strip().encode(), state.token.encode()):
        state.count("serve/wrong_token")
        return _error(403, "this token is not the job's (see `loomrl status`)", "permission_error")
    return None


def episode_path(path: str) -> tuple[str, str | None]:
    """``/e/ID/v1/...`` -> (``/v1/...``, ID); other paths unchanged."""
    if path.startswith("/e/"):
        episode_id, _, rest = path[3:].partition("/")
        return "/" + rest, episode_id
    return path, None


def build_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="loomrl endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path, episode_id = episode_path(request.url.path)
        if path == "/healthz":
            return JSONResponse({"ok": True})
        if (refused := _check_token(state, request)) is not None:
            return refused
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > state.max_body_bytes):
            return _error(413, f"request body over {state.max_body_bytes} bytes")
        request.scope["path"] = path
        if episode_id is not None:
            request.state.episode_id = episode_id
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, err: RequestValidationError):
        return _error(400, f"invalid request: {err.errors()[:3]}")

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, err: HTTPException):
        return _error(err.status_code, str(err.detail))

    @app.exception_handler(EpisodeError)
    async def episode_error(_request: Request, err: EpisodeError):
        return _error(err.status, str(err))

    @app.exception_handler(ExecutorLostError)
    async def generator_lost(_request: Request, err: ExecutorLostError):
        return _error(
            503, f"the generator was lost under this request (asked twice): {err}", "server_error"
        )

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, err: RequestError):
        return _error(400, str(err))

    app.include_router(_routes(state), prefix="/v1")
    app.include_router(_episode_routes(state), prefix="/v1")
    return app


def _episode_of(state: ServeState, request: Request) -> Episode | None:
    episode_id = getattr(request.state, "episode_id", None) or request.headers.get(EPISODE_HEADER)
    return None if episode_id is None else state.book.get(episode_id)


def _check_model(state: ServeState, model: str) -> None:
    if model != state.model_name:
        raise EpisodeError(
            404, f"model {model!r} is not served here; this endpoint serves {state.model_name!r}"
        )


def _sse(chunks: list[BaseModel]) -> StreamingResponse:
    async def events():
        for chunk in chunks:
            yield f"data: {chunk.model_dump_json(exclude_unset=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _record(episode: Episode | None, choices) -> None:
    if episode is not None:
        episode.calls.extend(choices)


def _routes(state: ServeState) -> APIRouter:
    router = APIRouter()
    policy = state.policy

    @router.get("/models")
    async def models():
        model = Model(id=state.model_name, created=0, object="model", owned_by="loomrl")
        return {"object": "list", "data": [model.model_dump()]}

    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request):
        _check_model(state, req.model)
        episode = _one_sample_episode(state, request, req.n)
        choices = await policy.sample(policy.encode_prompt(req.prompt), req, req.max_tokens)
        _record(episode, choices)
        body = completion_body(state.model_name, choices, episode and episode.id)
        if req.stream:
            return _sse(completion_chunks(body, [policy.pieces(c) for c in choices]))
        return body

    @router.post("/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        _check_model(state, req.model)
        episode = _one_sample_episode(state, request, req.n)
        prompt_ids = policy.render_chat(req)
        choices = await policy.sample(prompt_ids, req, req.max_completion_tokens or req.max_tokens)
        _record(episode, choices)
        if episode is not None:
            episode.messages = list(req.messages)
        messages = [policy.message_of(c) for c in choices]
        logprobs = [policy.logprobs_of(c) if req.logprobs else None for c in choices]
        body = chat_body(state.model_name, choices, messages, logprobs, episode and episode.id)
        if req.stream:
            return _sse(chat_chunks(body, [policy.pieces(c) for c in choices]))
        return body

    return router


def _episode_routes(state: ServeState) -> APIRouter:
    router = APIRouter()

    @router.post("/episodes")
    async def open_episode(body: OpenBody | None = None):
        episode = (
            await state.claim()
            if state.claim is not None
            else state.book.start(body.row if body else None)
        )
        state.count("serve/episodes_opened_by_harness")
        return {"id": episode.id, "row": episode.row, "base_path": f"/e/{episode.id}/v1"}

    @router.post("/episodes/{episode_id}/reward")
    async def close_episode(episode_id: str, body: RewardBody):
        episode = state.book.close(episode_id, {"reward": body.reward, **body.metrics}, "rewarded")
        return {"id": episode_id, "requests": len(episode.calls)}

    return router


def _one_sample_episode(state: ServeState, request: Request, n: int) -> Episode | None:
    episode = _episode_of(state, request)
    if episode is not None and n != 1:
        raise RequestError(f"a request of an episode samples one completion (n=1), got n={n}")
    return episode
