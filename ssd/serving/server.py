"""`ssd serve`: an HTTP server (FastAPI on uvicorn) over one EngineLoop, with OpenAI's and
Anthropic's APIs.

Routes: POST /v1/chat/completions and /v1/completions, GET /v1/models and /v1/models/{id}
(openai_routes.py), POST /v1/responses, GET and DELETE /v1/responses/{id} (responses_routes.py),
POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, anthropic_routes.py),
GET /health, GET /metrics (Prometheus), and a chat page at / (page_routes.py); what the routes
share is gateway.py. Errors use
OpenAI's JSON shape, and Anthropic's under /v1/messages. A client that goes away cancels its
request. SIGTERM / SIGINT: uvicorn stops accepting and lets requests in flight finish (for up
to --shutdown-timeout seconds, then cancels them); then the engine stops and the SSD draft
worker with it.
"""
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from ssd.errors import SSDError
from ssd.llm import LLM
from ssd.serving import anthropic_protocol, anthropic_routes, openai_routes, page_routes, responses_routes
from ssd.serving.engine_loop import EngineLoop
from ssd.serving.gateway import Gateway
from ssd.serving.metrics import ServerMetrics
from ssd.serving.openai_protocol import APIError

API_KEY_ENV = "SSD_API_KEY"
log = logging.getLogger("ssd.serving")


class _StatusCounter:
    """Counts every answer by route and status code (a plain ASGI wrapper: unlike an
    http middleware, it leaves streaming and disconnect detection alone)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in ROUTES else "other"
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)


ROUTES = ("/", "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/models", "/health", "/metrics")


def build_app(engine: EngineLoop, served_name: str, api_key: str | None, metrics: ServerMetrics,
              aliases: tuple[str, ...] = (), page: bool = True) -> FastAPI:
    """The app: OpenAI's routes (openai_routes.py), Anthropic's (anthropic_routes.py), health,
    Prometheus' metrics, the chat page (page=False: none), and errors in OpenAI's shape."""
    gw = Gateway(engine, metrics, served_name, aliases, api_key)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="ssd-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def answer(request, e: APIError) -> JSONResponse:
        """An error in the shape of the API the route belongs to: Anthropic's under /v1/messages."""
        anthropic = request.url.path.rstrip("/") == "/v1/messages" or request.url.path.startswith("/v1/messages/")
        return JSONResponse(anthropic_protocol.error_body(e) if anthropic else e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        return answer(request, e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, e: HTTPException):  # unknown route, wrong method
        kind = "not_found" if e.status_code == 404 else None
        return answer(request, APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=kind))

    @app.exception_handler(Exception)
    async def on_bug(request, e: Exception):
        log.exception("ssd: request failed")
        return answer(request, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", "mode": gw.llm.config.mode, "running": engine.running(), "waiting": engine.queued()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(openai_routes.routes(gw))
    app.include_router(anthropic_routes.routes(gw))
    app.include_router(responses_routes.routes(gw))
    if page:
        app.include_router(page_routes.routes())
    app.add_middleware(_StatusCounter, metrics=metrics)
    return app


def serve(llm: LLM, *, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 64, shutdown_timeout: float = 30.0, log_level: str = "warning", page: bool = True) -> None:
    """Serve `llm` until SIGTERM / SIGINT; the LLM is closed on the way out (`ssd serve`).

    The engine steps in this (the main) thread, see engine_loop.py for why; uvicorn and its
    event loop run in a second thread. The first SIGTERM / SIGINT asks uvicorn to shut down
    gracefully (its lifespan end then stops the engine), a second one cuts it short."""
    import uvicorn

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    metrics = ServerMetrics()
    engine = EngineLoop(llm, max_queue)
    engine.on_step = lambda llm: metrics.engine_state(llm, engine.queued())
    metrics.engine_state(llm, 0)
    app = build_app(engine, name, api_key, metrics, aliases=(llm.config.model.name,), page=page)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    http = threading.Thread(target=server.run, name="ssd-http", daemon=True)

    def on_signal(signum, frame):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if server.started:
        key = " (API key required)" if api_key else ""
        print(f"ssd serve: {name} ({llm.config.mode}) on http://{host}:{port}/v1{key}"
              + (f"; a chat page at http://{host}:{port}/" if page else ""), file=sys.stderr, flush=True)
    try:
        engine.run(keep_going=http.is_alive)  # returns when the lifespan ends or uvicorn could not start
        http.join(shutdown_timeout + 10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SSDError(f"could not listen on {host}:{port} (is the port in use?)")
