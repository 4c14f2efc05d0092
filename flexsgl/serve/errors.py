"""Every error the server answers, in OpenAI's error format, and the checks made before a body is read.

- APIError: a handler's own answer (status, message, type, code).
- Guard (ASGI middleware, before routing): `--api-key` (a missing or wrong key: 401; /health and
  /metrics are open), and the body limit (`--max-request-bytes`: a Content-Length over it is
  answered 413 without parsing or keeping the body, a body that grows past it while read is cut
  off with 413).
- install(): the handlers that give every other 4xx and 5xx its OpenAI body: a body that is not
  JSON, or nested too deeply to parse, a body of the wrong shape (400, naming the field), bad
  input from the engine's checks (400), an unknown route (404), a method a route does not take
  (405), and anything unexpected (500).
"""

from __future__ import annotations

import hmac
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from flexsgl.errors import InputError, PromptError
from flexsgl.log import logger
from flexsgl.serve.protocol import ChatRequest, CompletionRequest

OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|[a-z-]+\[.*\]|function-[a-z]+|constrained-[a-z]+)$")


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def named_field(message: str) -> str | None:
    """The request field a range error names first ("temperature must be ...", "logit_bias keys
    ..."), for the error body's `param`, or None."""
    word = message.split(" ", 1)[0]
    return word if word in CompletionRequest.model_fields or word in ChatRequest.model_fields else None


def error_response(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param, code), status_code=status, headers=headers)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"The request body is larger than this server takes ({limit} bytes, --max-request-bytes).")


class Guard:
    """ASGI middleware: the API key, then the body limit, before a route sees the request."""

    def __init__(self, app, api_key: str | None, max_bytes: int):
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                message = ("Missing API key: pass it as 'Authorization: Bearer KEY'." if not given
                           else "Incorrect API key provided.")
                return await error_response(message, 401, code="invalid_api_key",
                                            headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            while (await receive()).get("more_body"):  # read and drop it: a client still sending gets the answer
                pass
            return await error_response(f"The request body has {int(length)} bytes; this server takes at most "
                                        f"{self.max_bytes} (--max-request-bytes).", 413)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        return await self.app(scope, counted, send)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.message, e.status, e.kind, code=e.code)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, e: BodyTooLarge):
        return error_response(str(e), 413)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            reason = (first.get("ctx") or {}).get("error") or first.get("msg", "invalid JSON")
            if "recursion limit" in reason:
                return error_response(f"The request body is nested too deeply to parse ({reason}).", 400)
            if "hex escape" in reason:  # a \ud800-\udfff escape without its pair (Python's json.dumps writes them)
                reason += "; a UTF-16 surrogate escape without its pair is no Unicode character"
            return error_response(f"The request body is not valid JSON ({reason}).", 400)
        raw = [str(x) for x in first.get("loc", ())[1:]]
        loc = [x for x in raw if not _TYPE_TAG.match(x)]  # a union's member types are not fields
        where = ".".join(loc) or None
        if where is None and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
            return error_response("The request body must be a JSON object (sent as application/json).", 400)
        msg = first.get("msg", "invalid").rstrip(".")
        message = f"{where} has a value of the wrong type ({msg})." if len(loc) < len(raw) else \
            f"{where or 'The request body'}: {msg}."
        return error_response(message, 400, param=where)

    @app.exception_handler(InputError)
    async def bad_input(request, e: InputError):
        param = named_field(str(e))
        if param is None and isinstance(e, PromptError):
            param = "messages" if request.url.path.endswith("/chat/completions") else "prompt"
        return error_response(str(e), 400, param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        if e.status_code == 404:
            message = f"Not found: this server has no route {request.url.path}."
        elif e.status_code == 405:
            allowed = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow")
            message = (f"Method {request.method} is not allowed on {request.url.path}"
                       + (f"; it takes {allowed}." if allowed else "."))
        elif e.status_code == 400 and "parsing the body" in str(e.detail):
            message = "The request body could not be parsed as JSON (it may be nested too deeply)."
        else:
            message = str(e.detail).rstrip(".") + "."
        kind = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return error_response(message, e.status_code, kind, headers=e.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e: ClientDisconnect):  # nobody reads this: no traceback in the log
        return error_response("The client disconnected before the request's body arrived.", 400)

    @app.exception_handler(Exception)
    async def unexpected(request, e: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(f"The server failed on this request: {type(e).__name__}.", 500, "internal_error")
