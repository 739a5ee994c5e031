"""OpenAI-style JSON errors: every failure the server reports is {"error": {message, type, param, code}}.

Request validation (pydantic), malformed JSON, unknown routes and methods, oversized bodies, missing
API keys and a full queue all come out in this shape with the matching 4xx status, so clients such as
the `openai` package raise their usual exception types. Anything unexpected becomes a 500 in the same
shape; the server keeps serving.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fourfold.errors import FourfoldError

log = logging.getLogger("fourfold.serve")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 504: "timeout_error",
         503: "service_unavailable"}


class APIError(Exception):
    """An error answered to the client: HTTP status, message and OpenAI's type/param/code fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code), status_code=error.status,
                        headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code) for the first validation problem, naming the field the way the client sent it."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}).", None, \
            "invalid_json"
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param is None:
        if first.get("type") == "missing":
            return "The request body is empty; send a JSON object.", None, "missing_body"
        return f"The request body must be a JSON object with the documented fields ({msg}).", None, "invalid_body"
    if first.get("type") == "missing":
        return f"Missing required parameter '{param}'.", param, "missing_required_parameter"
    return f"Invalid value for '{param}': {msg}.", param, "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to an OpenAI-style JSON response."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param, code = _validation_message(exc)
        return error_response(APIError(400, message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        messages = {404: f"Unknown route {request.method} {request.url.path}.",
                    405: f"Method {request.method} is not allowed on {request.url.path}."}
        return error_response(APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(request: Request, exc: json.JSONDecodeError):
        return error_response(APIError(400, f"The request body is not valid JSON ({exc}).", code="invalid_json"))

    @app.exception_handler(FourfoldError)
    async def _engine_refused(request: Request, exc: FourfoldError):
        return error_response(APIError(400, str(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal error: {type(exc).__name__}. The server keeps serving."))
