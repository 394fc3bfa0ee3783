"""`ssd serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one EngineLoop.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events, or
not), POST /v1/messages (Anthropic's Messages API, anthropic_protocol.py), GET /v1/models,
GET /health, GET /metrics (Prometheus). Errors use OpenAI's JSON shape, and Anthropic's on
/v1/messages.
A client that goes away cancels its request. SIGTERM / SIGINT: uvicorn stops accepting and
lets requests in flight finish (for up to --shutdown-timeout seconds, then cancels them);
then the engine stops and the SSD draft worker with it.
"""
import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ssd.errors import SSDError
from ssd.llm import LLM
from ssd.request.sequence import Sequence
from ssd.sampling_params import MAX_SEED
from ssd.serving import anthropic_protocol as anthropic
from ssd.serving.engine_loop import EngineLoop, Event, QueueFullError, ShuttingDownError
from ssd.serving.metrics import ServerMetrics
from ssd.serving.openai_protocol import (APIError, Choice, api_error, chunk, completion, logprobs_json, new_id,
                                         parse_request, speculation, usage)

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


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/models", "/health", "/metrics")


def build_app(engine: EngineLoop, served_name: str, api_key: str | None, metrics: ServerMetrics,
              aliases: tuple[str, ...] = ()) -> FastAPI:
    llm = engine.llm
    served = {served_name, *aliases}

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="ssd-engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def on_http_error(request, e: HTTPException):  # unknown route, wrong method
        kind = "not_found" if e.status_code == 404 else None
        return JSONResponse(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                     code=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request, e: Exception):
        log.exception("ssd: request failed")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", "mode": llm.config.mode, "running": engine.running(), "waiting": engine.queued()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "ssd-engine", "max_model_len": llm.config.max_model_len}]}

    def key_given(request: Request) -> None:
        """Anthropic's clients send the key as x-api-key (a Bearer header is taken too)."""
        if api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is needed: send 'x-api-key: <key>'")

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            key_given(request)
            req = anthropic.parse_request(await body_json(request), served)
            seqs, queue = await start(req)
            if req.stream:
                return StreamingResponse(anthropic_stream(seqs[0], queue), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            done = await collect(seqs, queue, request)
        except APIError as e:
            return JSONResponse(anthropic.error_body(e), status_code=e.status)
        if done is None:
            return Response(status_code=499)
        (seq,), (pieces,), _, (ev,) = seqs, *done
        text, calls = llm.tool_calls(seq) or ("".join(pieces), None)
        finish = "tool_calls" if calls and ev.finish_reason == "stop" else ev.finish_reason
        return JSONResponse(anthropic.message(anthropic.new_id(), served_name, text, calls, finish,
                                              seq.detokenizer.matched, ev.metrics))

    async def body_json(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    async def start(req) -> tuple[list[Sequence], asyncio.Queue]:
        """Submit a request's choices; their (choice, event) pairs come to the queue."""
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        seqs = await asyncio.to_thread(submit, req, lambda i, ev: aloop.call_soon_threadsafe(queue.put_nowait, (i, ev)))
        return seqs, queue

    async def collect(seqs: list[Sequence], queue: asyncio.Queue, request: Request):
        """A non-streamed request's texts, logprobs and last events per choice; None if the
        client went away (nobody reads an answer then)."""
        texts, lps, last = [[] for _ in seqs], [[] for _ in seqs], [None] * len(seqs)
        try:
            async for i, ev in events(queue, len(seqs), request):
                texts[i].append(ev.text)
                lps[i] += ev.logprobs or []
                last[i] = ev
        finally:
            settle(seqs, last)
        if any(ev is None or not ev.finish_reason for ev in last):
            return None
        failed = next((ev for ev in last if ev.error), None)
        if failed:
            raise APIError(500, failed.error, type="server_error")
        return texts, lps, last

    async def generate(request: Request, chat: bool) -> Response:
        req = parse_request(await body_json(request), chat, served, default_max_tokens=16)  # OpenAI's for completions
        seqs, queue = await start(req)
        rid = new_id(chat)
        if req.stream:
            return StreamingResponse(stream(chat, rid, req, seqs, queue),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        done = await collect(seqs, queue, request)
        if done is None:
            return Response(status_code=499)
        texts, lps, last = done
        choices = []
        for seq, t, lp, ev in zip(seqs, texts, lps, last):
            text, calls = llm.tool_calls(seq) or ("".join(t), None)
            finish = "tool_calls" if calls and ev.finish_reason == "stop" else ev.finish_reason
            choices.append(Choice(text, finish, ev.metrics, lp if req.logprobs else None, calls or None))
        return JSONResponse(completion(chat, rid, served_name, choices, llm.config.mode, llm.tokenizer))

    def submit(req, sink) -> list[Sequence]:
        """The engine's checks, in a worker thread (tokenizing a long prompt must not hold up
        the event loop): one sequence per choice, each seeded apart when the request has a
        seed; a choice that cannot be queued cancels those before it."""
        seqs: list[Sequence] = []
        try:
            for i in range(req.n):
                params = req.params
                if req.n > 1 and params.seed is not None:
                    params = dataclasses.replace(params, seed=(params.seed + i) % MAX_SEED)
                seqs.append(engine.submit(req.prompt, params, functools.partial(sink, i), req.fill_context, req.tools))
            return seqs
        except QueueFullError as e:
            raise APIError(429, str(e), type="requests", code="rate_limit_exceeded") from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except SSDError as e:
            raise api_error(e, req.constraint_field) from None
        finally:
            if len(seqs) < req.n:
                for seq in seqs:
                    engine.cancel(seq)

    async def events(queue: asyncio.Queue, n: int, request: Request | None = None
                     ) -> AsyncIterator[tuple[int, Event]]:
        """A request's (choice, event) pairs until each of its n choices has had its last; the
        token gaps go to the metrics. A non-streamed request polls for its client going away
        (a streamed one is cancelled by Starlette)."""
        previous, checked, open_choices = [None] * n, time.perf_counter(), n
        while open_choices:
            if request is None:
                item = await queue.get()
            else:
                try:
                    item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    item = None
                if time.perf_counter() - checked > 0.5:
                    checked = time.perf_counter()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
            i, ev = item
            now = time.perf_counter()
            if ev.token_ids and previous[i] is not None:
                metrics.tokens_arrived(now - previous[i], len(ev.token_ids))
            previous[i] = now if ev.token_ids else previous[i]
            open_choices -= bool(ev.finish_reason)
            yield i, ev

    def settle(seqs: list[Sequence], last: list[Event | None]) -> None:
        """Count the choices that ended, and cancel those whose client went away."""
        for seq, ev in zip(seqs, last):
            if ev is not None and ev.finish_reason:
                metrics.request_done(ev.metrics, ev.finish_reason)
            else:
                engine.cancel(seq)
                metrics.request_done(seq.metrics(), "cancelled")

    async def stream(chat: bool, rid: str, req, seqs: list[Sequence], queue: asyncio.Queue) -> AsyncIterator[str]:
        data = lambda obj: f"data: {json.dumps(obj)}\n\n"  # noqa: E731
        last: list[Event | None] = [None] * len(seqs)
        offsets = [0] * len(seqs)  # completions' text_offset
        calls = [llm.call_stream(seq) for seq in seqs]  # requests with tools: content until a call begins
        try:
            if chat:
                for i in range(len(seqs)):
                    yield data(chunk(True, rid, served_name, None, None, index=i, role=True))
            async for i, ev in events(queue, len(seqs)):
                last[i] = ev
                if ev.error:
                    yield data(APIError(500, ev.error, type="server_error").body())
                    break
                text, found, finish = ev.text, None, ev.finish_reason
                if calls[i] is not None:
                    text = calls[i].push(ev.token_ids)
                    if ev.finish_reason and not ev.error:
                        rest, found = calls[i].finish()
                        text += rest
                        finish = "tool_calls" if found and finish == "stop" else finish
                if text or (req.logprobs and ev.logprobs):
                    lps = logprobs_json(chat, llm.tokenizer, ev.logprobs, offsets[i]) if req.logprobs else None
                    offsets[i] += len(text)
                    yield data(chunk(chat, rid, served_name, text, None, index=i, logprobs=lps))
                if found:
                    yield data(chunk(chat, rid, served_name, None, None, index=i, calls=found))
                if ev.finish_reason:
                    final = chunk(chat, rid, served_name, None, finish, index=i)
                    final["ssd_metrics"] = speculation(ev.metrics, llm.config.mode)
                    yield data(final)
            else:
                if req.include_usage:
                    yield data({**chunk(chat, rid, served_name, None, None, choices=False),
                                "usage": usage([ev.metrics for ev in last])})
            yield "data: [DONE]\n\n"
        finally:
            settle(seqs, last)

    async def anthropic_stream(seq: Sequence, queue: asyncio.Queue) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start (sent with the first tokens, when the
        prompt's cached part is known), a text block's start, deltas and stop, a tool_use
        block per call, message_delta with the stop reason and usage, message_stop."""
        last: list[Event | None] = [None]
        calls, index, text_open = llm.call_stream(seq), 0, False
        try:
            async for _, ev in events(queue, 1):
                if last[0] is None:
                    start = {"id": anthropic.new_id(), "type": "message", "role": "assistant", "model": served_name,
                             "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {**anthropic.usage(seq.metrics()), "output_tokens": 0}}
                    yield anthropic.event("message_start", message=start)
                last[0] = ev
                if ev.error:
                    yield anthropic.event("error", error={"type": "api_error", "message": ev.error})
                    break
                text, found = ev.text, []
                if calls is not None:
                    text = calls.push(ev.token_ids)
                    if ev.finish_reason:
                        rest, found = calls.finish()
                        text += rest
                if text:
                    if not text_open:
                        yield anthropic.event("content_block_start", index=index,
                                              content_block={"type": "text", "text": ""})
                        text_open = True
                    yield anthropic.event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})
                if not ev.finish_reason:
                    continue
                if text_open:
                    yield anthropic.event("content_block_stop", index=index)
                    index += 1
                for call in found:
                    block = anthropic.tool_use(call)
                    yield anthropic.event("content_block_start", index=index, content_block={**block, "input": {}})
                    yield anthropic.event("content_block_delta", index=index,
                                          delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                    yield anthropic.event("content_block_stop", index=index)
                    index += 1
                finish = "tool_calls" if found and ev.finish_reason == "stop" else ev.finish_reason
                matched = seq.detokenizer.matched
                yield anthropic.event("message_delta", delta={"stop_reason": anthropic.stop_reason(finish, matched),
                                                              "stop_sequence": matched},
                                      usage={"output_tokens": ev.metrics.output_tokens})
                yield anthropic.event("message_stop")
        finally:
            settle([seq], last)

    app.add_middleware(_StatusCounter, metrics=metrics)
    return app


def serve(llm: LLM, *, name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_queue: int = 64, shutdown_timeout: float = 30.0, log_level: str = "warning") -> None:
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
    app = build_app(engine, name, api_key, metrics, aliases=(llm.config.model.name,))
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
        print(f"ssd serve: {name} ({llm.config.mode}) on http://{host}:{port}/v1" + (" (API key required)" if api_key else ""),
              file=sys.stderr, flush=True)
    try:
        engine.run(keep_going=http.is_alive)  # returns when the lifespan ends or uvicorn could not start
        http.join(shutdown_timeout + 10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SSDError(f"could not listen on {host}:{port} (is the port in use?)")
