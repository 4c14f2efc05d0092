"""The OpenAI-compatible HTTP server (FastAPI): routes and request intake.

- POST /v1/completions, POST /v1/chat/completions: whole responses, or with stream: true
  server-sent events ending in `data: [DONE]` (a last chunk with usage when
  stream_options.include_usage is set, and the usage so far on every chunk with
  continuous_usage_stats too). Chat takes tools (tools.py), reasoning parsers
  (reasoning.py) and response_format; both take structured-output constraints (protocol.py).
- POST /tokenize, POST /detokenize (vLLM's): token ids of a prompt or of chat messages, and text
  of token ids.
- GET /v1/models, GET /health (200 once the model is loaded and its graphs captured, 503 before),
  GET /metrics (Prometheus, metrics.py).
- Errors (errors.py): every 4xx and 5xx but /health's 503 in OpenAI's error format: bad input
  400, a missing or wrong API key 401, an unknown model or route 404, a method a route does not
  take 405, a body over the limit 413, a request while the engine is not serving 503, a request
  the engine failed 500.
- A handler's work before the engine (templates, tokenizing, parsing constraints) runs on the
  intake's threads (intake.py), after a check of the text's length, so the event loop keeps
  answering other clients. Bodies are parsed here (pydantic's JSON parser, in one pass); one larger
  than BIG_BODY_BYTES waits for any other such body to be parsed first, and for one turn of the
  event loop, so that several large bodies at once never hold the loop for longer than one parse.
- A client that disconnects (mid-stream, or while waiting for a whole response) aborts its
  requests, which release their KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from flexsgl.errors import PromptError, short_repr
from flexsgl import chat_template as chat
from flexsgl.request_factory import kept_tokens
from flexsgl.serve import errors, reasoning, tools
from flexsgl.serve.engine_client import EngineClient
from flexsgl.serve.errors import APIError, error_body
from flexsgl.serve.intake import Intake
from flexsgl.serve.message import MessageParser
from flexsgl.serve.metrics import CONTENT_TYPE_LATEST
from flexsgl.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from flexsgl.serve.responses import Choices, sse

DISCONNECT_POLL_S = 0.5  # how often a handler waiting for a whole response checks its client is there
BIG_BODY_BYTES = 1 << 20
DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20
request_log = logging.getLogger("flexsgl.requests")


@dataclass
class ServerOptions:
    """What `flexsgl serve` takes besides the engine's options."""

    api_key: str | None = None  # clients must send `Authorization: Bearer KEY`
    chat_template: str | None = None  # the template's text, in place of the model's
    reasoning_parser: str | None = None  # reasoning.PARSERS
    tool_call_parser: str | None = None  # tools.PARSERS
    request_log: bool = False  # log each request (its prompt, parameters and end) at info level
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def build_app(engine: EngineClient, model_name: str | Sequence[str], options: ServerOptions | None = None) -> FastAPI:
    """The server's routes over `engine`. `model_name`: the name clients pass, or several (vLLM's
    --served-model-name A B): requests may name any, responses carry the first."""
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    model_name = names[0]
    options = options or ServerOptions()
    intake = Intake()
    big_bodies = asyncio.Semaphore(1)

    async def parse(request: Request, model):
        raw = await request.body()
        if len(raw) <= BIG_BODY_BYTES:
            return _validate(raw, model)
        async with big_bodies:
            await asyncio.sleep(0)  # what else is ready runs first
            return _validate(raw, model)
    # its own level either way: under the "flexsgl" logger it would otherwise log at --log-level info
    request_log.setLevel(logging.INFO if options.request_log else logging.WARNING)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        yield
        engine.stop()
        intake.shutdown()

    app = FastAPI(title="flexsgl", lifespan=lifespan)
    app.add_middleware(errors.Guard, api_key=options.api_key, max_bytes=options.max_request_bytes)
    errors.install(app)

    @app.get("/health")
    async def health():
        if not engine.serving:
            status = engine.failure or ("stopping" if engine.draining else "loading")
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    started = int(time.time())

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": started, "owned_by": "flexsgl",
                "max_model_len": engine.info.config.max_position if engine.serving else None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes (a hub id)
    async def model(model_id: str):
        if model_id not in names:
            raise _no_such_model(model_id, names)
        return card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        info = _check(engine, body.model, names)
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            if isinstance(p, str) and body.truncate_prompt_tokens is None:  # truncated, a prompt may be longer
                intake.check_chars(len(p), info, f"Prompt {i}")
        sampling = body.to_sampling(info.default_sampling)

        def make():
            reqs = [r for i, p in enumerate(prompts) for r in info.requests.make_requests(p, sampling, i)]
            echo = None
            if body.echo:  # the prompt as given, or, truncated, the text of the tokens kept
                echo = [_decode(info.tokenizer, r.prompt_ids) if body.truncate_prompt_tokens is not None
                        else p if isinstance(p, str) else _decode(info.tokenizer, p)
                        for p, r in zip((p for p in prompts for _ in range(sampling.n)), reqs)]
            return reqs, echo

        reqs, echo = await intake.run(make)
        choices = Choices(False, model_name, info.tokenizer, len(reqs), _prompt_tokens(reqs), echo=echo,
                          continuous_usage=body.continuous_usage, prompt_logprobs=body.prompt_logprobs is not None,
                          scores_prompt=body.scores_prompt)
        _log_request(choices.id, prompts, sampling)
        return await _run(engine, request, reqs, choices, body, sampling.logprobs is not None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        info = _check(engine, body.model, names)
        if info.tokenizer is None:
            raise APIError(400, f"Model {model_name!r} has no tokenizer, so it cannot chat.")
        plan = tools.plan(body.tools, body.tool_choice, options.tool_call_parser, body.parallel_tool_calls is not False)
        truncated = body.truncate_prompt_tokens
        if truncated is None:  # truncated, the messages may be longer
            intake.check_chars(body.characters(), info, "The messages")

        def make():
            text = chat.render(info.tokenizer, body.message_dicts(), body.add_generation_prompt,
                               body.chat_template_kwargs, body.tools, options.chat_template,
                               body.continue_final_message)
            if truncated is None:
                intake.check_chars(len(text), info, "The rendered chat prompt")
            ids = chat.encode(info.tokenizer, text)
            kept = kept_tokens(len(ids), truncated, info.config.max_position)
            thinking = options.reasoning_parser is not None and reasoning.thinks(text, body.chat_template_kwargs)
            # the default limit: the room the context, or a KV cache holding less, leaves (as vLLM's)
            sampling = body.to_sampling(info.default_sampling, info.requests.longest() - kept, plan.constraint(),
                                        reasoning.END if thinking else None)
            return text, sampling, info.requests.make_requests(ids, sampling)

        text, sampling, reqs = await intake.run(make)
        parser = None
        if options.reasoning_parser or plan.mode != "none":
            def parser():
                return MessageParser(options.reasoning_parser, plan, options.tool_call_parser, text,
                                     body.chat_template_kwargs)
        choices = Choices(True, model_name, info.tokenizer, len(reqs), reqs[0].prompt_len, parser=parser,
                          continuous_usage=body.continuous_usage, prompt_logprobs=body.prompt_logprobs is not None)
        _log_request(choices.id, [text], sampling)
        return await _run(engine, request, reqs, choices, body, body.logprobs)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest)
        info = _check(engine, body.model, names)
        if info.tokenizer is None:
            raise APIError(400, f"Model {model_name!r} has no tokenizer.")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give a prompt or messages (one of them).")
        if body.prompt is not None:
            intake.check_chars(len(body.prompt), info, "The prompt")
        else:
            intake.check_chars(sum(len(m.content) for m in body.messages if isinstance(m.content, str)), info,
                               "The messages")

        def make():
            if body.prompt is not None:
                ids = list(info.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
            else:
                messages = ChatRequest(messages=body.messages).message_dicts()
                text = chat.render(info.tokenizer, messages, body.add_generation_prompt, body.chat_template_kwargs,
                                   body.tools, options.chat_template, body.continue_final_message)
                ids = chat.encode(info.tokenizer, text)
            strs = _token_strs(info.tokenizer, ids) if body.return_token_strs else None
            return ids, strs

        ids, strs = await intake.run(make)
        out = {"count": len(ids), "max_model_len": info.config.max_position, "tokens": ids}
        if strs is not None:
            out["token_strs"] = strs
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest)
        info = _check(engine, body.model, names)
        vocab = info.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"Token id {bad} is outside the vocabulary [0, {vocab}).")
        if info.tokenizer is None:
            raise APIError(400, f"Model {model_name!r} has no tokenizer.")
        return {"prompt": await intake.run(_decode, info.tokenizer, body.tokens)}

    return app


def _validate(raw: bytes, model):
    """`raw` as `model`; a body that is not JSON, or not of the model's shape, raises
    RequestValidationError (errors.py answers it), its fields' places under "body"."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError([{k: v for k, v in err.items() if k != "input"} | {"loc": ("body", *err["loc"])}
                                      for err in e.errors()]) from None


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if hasattr(tokenizer, "convert_ids_to_tokens") \
        else tokenizer.decode(ids)


def _token_strs(tokenizer, ids: list[int]) -> list[str]:
    """The vocabulary's entry of each token (vLLM's /tokenize token_strs: '▁the', '<0x0A>', 'Ġthe'),
    or, for a tokenizer without entries (bytes), its text."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return list(tokenizer.convert_ids_to_tokens(ids))
    return [tokenizer.decode([t]) for t in ids]


def _check(engine: EngineClient, model: str | None, names: tuple[str, ...]):
    if not engine.serving:
        raise APIError(503, engine.unavailable, kind="service_unavailable")
    if model is not None and model not in names:
        raise _no_such_model(model, names)
    return engine.info


def _no_such_model(model: str, names: tuple[str, ...]) -> APIError:
    return APIError(404, f"The model {model!r} does not exist; this server serves "
                         f"{' or '.join(repr(n) for n in names)}.", code="model_not_found")


def _prompt_tokens(reqs) -> int:
    return sum(r.prompt_len for r in reqs if r.index == 0)


def _log_request(call_id: str, prompts: list, sampling) -> None:
    if request_log.isEnabledFor(logging.INFO):
        shown = [short_repr(p, 200) for p in prompts]
        request_log.info(f"request {call_id}: prompts {', '.join(shown)}; {sampling}")


def _log_end(choices: Choices) -> None:
    if request_log.isEnabledFor(logging.INFO):
        done = [o for o in choices.outputs if o is not None]
        request_log.info(f"request {choices.id} finished: {', '.join(str(o.finish_reason) for o in done)}; "
                         f"{sum(len(o.token_ids) for o in done)} tokens")


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
            choices.add(choices.shown(ev))
    except asyncio.CancelledError:
        engine.abort(ids)
        raise
    finally:
        if getter is not None:
            getter.cancel()
    _log_end(choices)
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
                ev = choices.shown(ev)
                choices.add(ev)
                lines += choices.chunk(ev, want_logprobs, include_usage)
            if lines:
                yield "".join(lines)
        if include_usage and choices.done:
            yield choices.usage_chunk()
        yield "data: [DONE]\n\n"
        _log_end(choices)
    finally:
        if not choices.done:  # the client went away (or the engine failed): free its pages
            engine.abort(ids)
