"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, as vLLM's server sends them
(type names BadRequestError / NotFoundError / ..., code = the HTTP status). Bad input is a 4xx
naming the field and the limit; nothing ever answers with a stack trace."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# fields a ValueError from SamplingParams / the engine may name first ("max_tokens must be ...")
KNOWN_PARAMS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "min_tokens",
    "stop_token_ids",
    "stop",
    "seed",
    "logprobs",
    "tier",
    "request_class",
    "cache_salt",
    "prompt",
    "messages",
    "n",
    "model",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_p",
    "include_stop_str_in_output",
    "response_format",
    "tools",
    "tool_choice",
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "APIError"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def param_of(message: str) -> str | None:
    """The field a ValueError message names first ("max_tokens must be ..." -> "max_tokens")."""
    head = message.split(" ", 1)[0].rstrip(":,.")
    if head.startswith("This model's maximum context length"):
        return "max_tokens"
    return head if head in KNOWN_PARAMS else ("max_tokens" if "maximum context length" in message else None)


def _short(v, limit: int = 80) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


def validation_message(errors: list) -> tuple[str, str | None]:
    """pydantic/FastAPI errors -> one message naming the field(s) and the limit, and the first field."""
    parts, first, seen_fields = [], None, set()
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path", "header")]
        # drop the union branch names pydantic adds ("prompt.str", "prompt.list[int].0")
        loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool", "list")]
        field = ".".join(loc)
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', msg)}", None
        if e.get("type") == "extra_forbidden":
            msg = "unknown field (not part of this endpoint's schema)"
        elif e.get("type") == "missing":
            msg = "field required"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
            if ":" in msg and not field:
                field = msg.split(":", 1)[0]
                msg = msg.split(":", 1)[1].strip()
        if "input" in e and e.get("type") not in ("missing",):
            msg += f" (got {_short(e['input'])})"
        first = first or field or None
        if field and field in seen_fields:
            # one value failing every branch of a union: say so once
            parts = [p for p in parts if not p.startswith(field + ": ")]
            msg = "does not match any accepted type" + (f" (got {_short(e['input'])})" if "input" in e else "")
        seen_fields.add(field)
        if not field and e.get("type") in ("model_attributes_type", "dict_type"):
            msg = f"the body must be a JSON object (got {_short(e.get('input'))})"
        parts.append(f"{field}: {msg}" if field else msg)
    if len(errors) > 5:
        parts.append(f"... and {len(errors) - 5} more")
    return "; ".join(parts), first


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    msg, param = validation_message(list(exc.errors()))
    return error_response(400, msg, param)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 404:
        msg = f"route {request.method} {request.url.path} not found"
    elif status == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    return error_response(status, msg, headers=getattr(exc, "headers", None))


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # a bug of ours: say what kind, never the trace
    return error_response(500, f"internal error ({type(exc).__name__}); the server keeps serving")


def install(app) -> None:
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_unexpected)


DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


async def _drain(receive, length: int) -> None:
    """Reads (and drops) an oversized body before the 413 goes out: a client still sending when
    the server answers and closes gets a connection reset instead of the JSON error. Bounded:
    past DRAIN_LIMIT_BYTES the answer goes out anyway."""
    seen = 0
    while seen < min(length, DRAIN_LIMIT_BYTES):
        msg = await receive()
        if msg["type"] != "http.request":
            return
        seen += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return


class GuardMiddleware:
    """Pure ASGI: API key check (every route but /health) and the body size limit (413), before
    any route runs. Counts streamed bodies too, not only Content-Length."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope.get("path") != "/health":
            auth = headers.get("authorization", "")
            if not auth:
                resp = error_response(401, "missing API key: send 'Authorization: Bearer <key>'")
                return await resp(scope, receive, send)
            if auth != f"Bearer {self.api_key}":
                return await error_response(401, "incorrect API key")(scope, receive, send)
        cl = headers.get("content-length")
        if cl is not None:
            if not cl.isdigit():
                return await error_response(400, "content-length is not a number")(scope, receive, send)
            if int(cl) > self.max_body:
                await _drain(receive, int(cl))
                return await error_response(
                    413,
                    f"request body is {int(cl)} bytes; the limit is {self.max_body} (--max-body-bytes)",
                    headers={"connection": "close"},
                )(scope, receive, send)
        if cl is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # chunked body without a length: read it here, bounded, then hand it on
            chunks, seen = [], 0
            while True:
                msg = await receive()
                if msg["type"] != "http.request":
                    return
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    return await error_response(
                        413, f"request body is over the limit of {self.max_body} bytes (--max-body-bytes)"
                    )(scope, receive, send)
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    break
            body = b"".join(chunks)
            sent = False

            async def replay():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)
