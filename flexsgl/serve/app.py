"""The OpenAI-compatible HTTP server (FastAPI): routes, request intake and error answers.

- POST /v1/completions, POST /v1/chat/completions: whole responses, or with stream: true
  server-sent events ending in `data: [DONE]` (a last chunk with usage when
  stream_options.include_usage is set).
- GET /v1/models, GET /health (200 once the model is loaded and its graphs captured, 503 before),
  GET /metrics (Prometheus text, metrics.py).
- Bad input is answered with 400 and an OpenAI error body (a body of the wrong types, a sampling
  parameter out of range, a prompt that does not fit), an unknown model with 404, a request while
  the engine is not serving with 503; a request the engine failed with 500.
- A client that disconnects (mid-stream, or while waiting for a whole response) aborts its
  requests, which release their KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from flexsgl.errors import InputError
from flexsgl.serve import chat
from flexsgl.serve.engine_client import EngineClient
from flexsgl.serve.protocol import ChatRequest, CompletionRequest
from flexsgl.serve.responses import Choices, error_body, sse

DISCONNECT_POLL_S = 0.5  # how often a handler waiting for a whole response checks its client is there


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def build_app(engine: EngineClient, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()

    app = FastAPI(title="flexsgl", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(error_body(e.message, e.status, e.kind, code=e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ())[1:]]
        where = loc[0] if loc else "body"
        message = f"{'.'.join(loc) or 'The request body'}: {first.get('msg', 'invalid')}."
        return JSONResponse(error_body(message, 400, param=where), status_code=400)

    @app.exception_handler(InputError)
    async def bad_input(request, e: InputError):
        return JSONResponse(error_body(str(e), 400), status_code=400)

    @app.get("/health")
    async def health():
        if not engine.serving:
            return JSONResponse({"status": engine.failure or "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "flexsgl",
                                            "max_model_len": engine.info.config.max_position if engine.serving else None}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        info = _check(engine, body.model, model_name)
        sampling = body.to_sampling(info.default_sampling)
        reqs = [r for i, p in enumerate(body.prompts()) for r in info.requests.make_requests(p, sampling, i)]
        return await _run(engine, request, reqs, Choices(False, model_name, info.tokenizer, len(reqs),
                                                          _prompt_tokens(reqs)), body, sampling.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        info = _check(engine, body.model, model_name)
        if info.tokenizer is None:
            raise APIError(400, f"Model {model_name!r} has no tokenizer, so it cannot chat.")
        text = chat.render(info.tokenizer, body.message_dicts(), body.add_generation_prompt, body.chat_template_kwargs)
        ids = chat.encode(info.tokenizer, text)
        sampling = body.to_sampling(info.default_sampling, info.config.max_position - len(ids))
        reqs = info.requests.make_requests(ids, sampling)
        return await _run(engine, request, reqs, Choices(True, model_name, info.tokenizer, len(reqs), len(ids)),
                          body, body.logprobs)

    return app


def _check(engine: EngineClient, model: str | None, model_name: str):
    if not engine.serving:
        raise APIError(503, engine.failure or "The model is still loading; try again when /health says ok.",
                       kind="service_unavailable")
    if model is not None and model != model_name:
        raise APIError(404, f"The model {model!r} does not exist; this server serves {model_name!r}.",
                       code="model_not_found")
    return engine.info


def _prompt_tokens(reqs) -> int:
    return sum(r.prompt_len for r in reqs if r.index == 0)


async def _run(engine: EngineClient, request: Request, reqs, choices: Choices, body, want_logprobs: bool):
    for r in reqs:
        reason = engine.info.requests.refusal(r)
        if reason is not None:
            raise APIError(400, f"Request refused: {reason}.")
    events: asyncio.Queue = asyncio.Queue()
    engine.submit(reqs, events)
    ids = [r.request_id for r in reqs]
    if body.stream:
        return StreamingResponse(_stream(engine, events, ids, choices, want_logprobs, body.include_usage),
                                 media_type="text/event-stream")
    getter, checked = None, time.monotonic()
    try:
        while not choices.done:
            getter = getter or asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # tokens or not: is the client still there?
                checked = time.monotonic()
                if await request.is_disconnected():
                    engine.abort(ids)
                    return JSONResponse(error_body("The client disconnected.", 499), status_code=499)
            if not done:
                continue
            ev, getter = getter.result(), None
            if ev.error is not None:
                raise APIError(500, ev.error, kind="internal_error")
            choices.add(ev)
    except asyncio.CancelledError:
        engine.abort(ids)
        raise
    finally:
        if getter is not None:
            getter.cancel()
    failed = [o for o in choices.outputs if o.finish_reason in ("error", "refused")]
    if failed:
        raise APIError(500 if failed[0].finish_reason == "error" else 400, failed[0].error,
                       kind="internal_error" if failed[0].finish_reason == "error" else "invalid_request_error")
    return choices.response(want_logprobs)


async def _stream(engine: EngineClient, events: asyncio.Queue, ids: list[int], choices: Choices, want_logprobs: bool,
                  include_usage: bool):
    failed = False
    try:
        while not choices.done and not failed:
            # One write carries every event queued so far: when the engine runs ahead of this loop,
            # a handler sends several steps' chunks at once instead of one write per token.
            batch = [await events.get()]
            while not events.empty():
                batch.append(events.get_nowait())
            lines = []
            for ev in batch:
                if ev.error is not None or (ev.output is not None and ev.output.finish_reason in ("error", "refused")):
                    lines.append(sse(error_body(ev.error or ev.output.error, 500, "internal_error")))
                    failed = True
                    break
                choices.add(ev)
                lines += choices.chunk(ev, want_logprobs, include_usage)
            if lines:
                yield "".join(lines)
        if include_usage and choices.done:
            yield choices.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        if not choices.done:  # the client went away (or the engine failed): free its pages
            engine.abort(ids)
