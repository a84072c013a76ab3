"""OpenAI-style JSON errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

FastAPI answers a body it cannot parse or validate with 422 ``{"detail": [...]}``; OpenAI clients
expect 400 and the ``error`` object, so ``install`` replaces those handlers (and the 404/405 of
unknown routes, and any exception a route did not expect: a 500 in the same shape, never a
dropped connection). ``type`` is the status's name as vLLM writes it (``BadRequestError``,
``NotFoundError``, ...); ``code`` is the HTTP status.
"""

from __future__ import annotations

from http import HTTPStatus

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """A request the server refuses: the status, a message saying what to change, the parameter."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(err: APIError):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status, headers=err.headers)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line from pydantic's errors, naming the first offending field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type") or "json" in kind:
        return f"the body is not valid JSON: {first.get('msg', '')}".rstrip(": "), None
    if not loc:
        return f"the body must be a JSON object ({first.get('msg', 'invalid')})", None
    # union members report one error each (prompt.str, prompt.list[int], ...): name the field once
    param = loc[0]
    path = ".".join(p for p in loc if not p.startswith(("str", "list", "int", "dict", "function")))
    got = first.get("input")
    got_text = f", got {type(got).__name__} {got!r}"[:120] if kind != "missing" else ""
    if kind == "missing":
        return f"{path or param} is required", param
    more = f" (and {len(errors) - 1} more problems)" if len({e['loc'][:2] for e in errors}) > 1 else ""
    return f"{path or param}: {first.get('msg', 'invalid value')}{got_text}{more}", param


def install(app) -> None:
    """Every error the app can answer, in the OpenAI shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        message, param = _validation_message(list(err.errors()))
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, err: StarletteHTTPException):
        message = err.detail if isinstance(err.detail, str) else HTTPStatus(err.status_code).phrase
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions"
        return JSONResponse(error_body(err.status_code, message), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        text = " ".join(str(err).split())[:300]
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}: {text}"), status_code=500)
