"""What every route of `ssd serve` shares: a request's body, its choices submitted to the
engine loop and their chunks back on the event loop, a client that goes away, the counters,
and the two ways a client shows its API key."""
import asyncio
import dataclasses
import functools
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from ssd.errors import SSDError
from ssd.outputs import StreamChunk, TokenLogprob
from ssd.request.sequence import Sequence
from ssd.sampling_params import MAX_SEED
from ssd.serving.engine_loop import EngineLoop, QueueFullError, ShuttingDownError
from ssd.serving.metrics import ServerMetrics
from ssd.serving.openai_protocol import APIError, api_error


@dataclass
class Answer:
    """A choice of a non-streamed request, whole: its text (a tool request's content), its
    logprobs, and its last chunk (how it finished, its metrics and calls)."""

    text: str
    logprobs: list[TokenLogprob]
    last: StreamChunk


class Gateway:
    def __init__(self, engine: EngineLoop, metrics: ServerMetrics, served_name: str, aliases: tuple[str, ...],
                 api_key: str | None):
        self.engine, self.metrics, self.api_key = engine, metrics, api_key
        self.llm = engine.llm
        self.served_name, self.served = served_name, {served_name, *aliases}

    # ---- API keys ------------------------------------------------------------------------------
    def bearer(self, request: Request) -> None:
        """OpenAI's clients send the key as 'Authorization: Bearer <key>'."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def x_api_key(self, request: Request) -> None:
        """Anthropic's clients send the key as x-api-key (a Bearer header is taken too)."""
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "a valid API key is needed: send 'x-api-key: <key>'")

    # ---- a request's life ----------------------------------------------------------------------
    @staticmethod
    async def body_json(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    async def start(self, req) -> tuple[list[Sequence], asyncio.Queue]:
        """Submit a request's choices; their (choice, chunk) pairs come to the queue."""
        queue: asyncio.Queue[tuple[int, StreamChunk]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        seqs = await asyncio.to_thread(self._submit, req,
                                       lambda i, chunk: aloop.call_soon_threadsafe(queue.put_nowait, (i, chunk)))
        return seqs, queue

    def _submit(self, req, sink) -> list[Sequence]:
        """The engine's checks, in a worker thread (tokenizing a long prompt must not hold up
        the event loop): one sequence per choice, each seeded apart when the request has a
        seed; a choice that cannot be queued cancels those before it."""
        seqs: list[Sequence] = []
        try:
            for p, prompt in enumerate(req.prompts):  # (choice p * n + i: prompt p's i-th)
                for i in range(req.n):
                    params = req.params
                    if req.n > 1 and params.seed is not None:
                        params = dataclasses.replace(params, seed=(params.seed + i) % MAX_SEED)
                    seqs.append(self.engine.submit(prompt, params, functools.partial(sink, len(seqs)),
                                                   req.fill_context, req.tools))
            return seqs
        except QueueFullError as e:
            raise APIError(429, str(e), type="requests", code="rate_limit_exceeded") from None
        except ShuttingDownError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except SSDError as e:
            raise api_error(e, req.constraint_field) from None
        finally:
            if len(seqs) < req.n * len(req.prompts):
                for seq in seqs:
                    self.engine.cancel(seq)

    async def collect(self, seqs: list[Sequence], queue: asyncio.Queue, request: Request) -> list[Answer] | None:
        """A non-streamed request's choices, whole; None if the client went away (nobody reads
        an answer then)."""
        texts, lps, last = [[] for _ in seqs], [[] for _ in seqs], [None] * len(seqs)
        try:
            async for i, chunk in self.chunks(queue, len(seqs), request):
                texts[i].append(chunk.text)
                lps[i] += chunk.logprobs or []
                last[i] = chunk
        finally:
            self.settle(seqs, last)
        if any(chunk is None or not chunk.finish_reason for chunk in last):
            return None
        failed = next((chunk for chunk in last if chunk.error), None)
        if failed:
            raise APIError(500, failed.error, type="server_error")
        return [Answer("".join(t), lp, chunk) for t, lp, chunk in zip(texts, lps, last)]

    async def chunks(self, queue: asyncio.Queue, n: int, request: Request | None = None
                     ) -> AsyncIterator[tuple[int, StreamChunk]]:
        """A request's (choice, chunk) pairs until each of its n choices has had its last; the
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
            i, chunk = item
            now = time.perf_counter()
            if chunk.token_ids and previous[i] is not None:
                self.metrics.tokens_arrived(now - previous[i], len(chunk.token_ids))
            previous[i] = now if chunk.token_ids else previous[i]
            open_choices -= bool(chunk.finish_reason)
            yield i, chunk

    def settle(self, seqs: list[Sequence], last: list[StreamChunk | None]) -> None:
        """Count the choices that ended, and cancel those whose client went away."""
        for seq, chunk in zip(seqs, last):
            if chunk is not None and chunk.finish_reason:
                self.metrics.request_done(chunk.metrics, chunk.finish_reason)
            else:
                self.engine.cancel(seq)
                self.metrics.request_done(seq.metrics(), "cancelled")
