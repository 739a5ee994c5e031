"""The FastAPI application of `fourfold serve`: routes, API-key check, body-size limit, health, models, metrics.

    app = build_app(engine, ServeSettings(model_name="smollm2", api_key="secret"))

Routes: POST /v1/completions, POST /v1/chat/completions (fourfold.serve.handlers), GET /v1/models,
GET /health (never needs a key), GET /metrics (Prometheus text), GET / (the chat page: static HTML with
no data of its own, so it loads without a key; the calls it makes carry the key typed into it).
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass
from importlib import resources
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from fourfold.serve.errors import APIError, error_body, install_error_handlers
from fourfold.serve.handlers import Generation
from fourfold.serve.metrics import ServerMetrics
from fourfold.serve.protocol import ChatCompletionRequest, CompletionRequest
from fourfold.serve.streams import Admission

PUBLIC_PATHS = {"/health", "/"}


@dataclass
class ServeSettings:
    """What the server does beyond the engine: names, limits and the optional API key."""

    model_name: str
    api_key: Optional[str] = None
    max_requests_in_flight: int = 256
    """Requests inside the server at once; more get 429 with Retry-After."""
    request_timeout_s: Optional[float] = 600.0
    max_body_bytes: int = 2 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before anything parses it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(send, self.limit)
        # Read the whole body here (it is bounded), then replay it to the app.
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _too_large(send, self.limit)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _too_large(send, limit: int) -> None:
    response = JSONResponse(error_body(413, f"The request body exceeds {limit} bytes.", code="body_too_large"),
                            status_code=413)
    await response({"type": "http"}, None, send)


def _page() -> str:
    return resources.files("fourfold.serve").joinpath("page.html").read_text(encoding="utf-8")


def build_app(engine, settings: ServeSettings) -> FastAPI:
    """The application serving `engine` (an async engine: generate/abort/stats, tokenizer, chat template)."""
    app = FastAPI(title="fourfold", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    admission = Admission(settings.max_requests_in_flight)
    metrics = ServerMetrics(engine.stats, lambda: admission.inside)
    generation = Generation(engine, settings.model_name, engine.tokenizer, engine.chat_template, engine.max_model_len,
                            admission, metrics, settings.request_timeout_s)
    created = int(time.time())
    expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if expected is not None and request.url.path not in PUBLIC_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                metrics.rejected.labels("401").inc()
                return JSONResponse(error_body(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                                               code="invalid_api_key"), status_code=401)
        response = await call_next(request)
        if response.status_code >= 400:
            metrics.rejected.labels(str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return _page()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": created,
                                            "owned_by": "fourfold", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generation.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generation.chat(body, request)

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
