"""OpenAI's routes of `ssd serve`: POST /v1/chat/completions and /v1/completions (streamed as
server-sent events, or not), GET /v1/models and /v1/models/{id}; request checks and response
shapes in openai_protocol.py."""
import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ssd.outputs import StreamChunk, TokenLogprob
from ssd.request.sequence import Sequence
from ssd.serving.gateway import Answer, Gateway
from ssd.serving.openai_protocol import (APIError, Choice, chunk, completion, logprobs_json, new_id, parse_request,
                                         speculation, speculation_json, usage)


def routes(gw: Gateway) -> APIRouter:
    router = APIRouter(dependencies=[Depends(gw.bearer)])
    llm, name = gw.llm, gw.served_name

    def card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "ssd-engine",
                "max_model_len": llm.config.max_model_len}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name)]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The served model by its name or an alias (ids may hold a slash, as hub ids do)."""
        if model_id not in gw.served:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")
        return card(model_id)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    async def generate(request: Request, chat: bool) -> Response:
        req = parse_request(await gw.body_json(request), chat, gw.served, default_max_tokens=16)  # OpenAI's
        seqs, queue = await gw.start(req)
        rid = new_id(chat)
        if req.stream:
            return StreamingResponse(stream(chat, rid, req, seqs, queue),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answers = await gw.collect(seqs, queue, request)
        if answers is None:
            return Response(status_code=499)
        choices = [echoed(seq, a, req) if req.echo else
                   Choice(a.text, a.last.finish_reason, a.last.metrics, a.logprobs if req.logprobs else None,
                          a.last.tool_calls) for seq, a in zip(seqs, answers)]
        return JSONResponse(completion(chat, rid, name, choices, llm.config.mode, llm.tokenizer, req.n))

    def echoed(seq: Sequence, a: Answer, req) -> Choice:
        """A completion with its prompt before it (echo): the prompt's text and, with logprobs, its
        tokens' (the first null); score_only (max_tokens 0): the prompt alone."""
        text, lps, m = a.text, a.logprobs if req.logprobs else None, a.last.metrics
        if req.score_only:
            text, lps, m = "", [] if req.logprobs else None, dataclasses.replace(m, output_tokens=0)
        if lps is not None:
            lps = prompt_logprobs(seq) + lps
        return Choice(seq.prompt + text, "length" if req.score_only else a.last.finish_reason, m, lps)

    def prompt_logprobs(seq: Sequence) -> list[TokenLogprob]:
        """An echoed prompt's tokens' logprobs, the first null (nothing before it scores it)."""
        return [TokenLogprob(seq.token_ids[0], None, None)] + seq.prompt_logprobs[1:seq.num_prompt_tokens]

    def dropped(c: StreamChunk) -> StreamChunk:
        """score_only's chunk: the one token drawn is not the answer's (max_tokens 0)."""
        m = None if c.metrics is None else dataclasses.replace(c.metrics, output_tokens=0)
        return dataclasses.replace(c, text="", token_ids=[], from_draft=[], sources=[], pieces=[], logprobs=None,
                                   metrics=m, finish_reason=c.finish_reason and "length")

    async def stream(chat: bool, rid: str, req, seqs: list[Sequence], queue: asyncio.Queue) -> AsyncIterator[str]:
        data = lambda obj: f"data: {json.dumps(obj)}\n\n"  # noqa: E731
        last: list[StreamChunk | None] = [None] * len(seqs)
        offsets = [0] * len(seqs)  # completions' text_offset
        echo = [req.echo] * len(seqs)  # (each prompt's echo goes first, once its prefill has scored it)
        try:
            if chat:
                for i in range(len(seqs)):
                    yield data(chunk(True, rid, name, None, None, index=i, role=True))
            async for i, c in gw.chunks(queue, len(seqs)):
                if c.error:
                    last[i] = c
                    yield data(APIError(500, c.error, type="server_error").body())
                    break
                if echo[i]:
                    echo[i], seq = False, seqs[i]
                    lps = logprobs_json(False, llm.tokenizer, prompt_logprobs(seq)) if req.logprobs else None
                    offsets[i] += len(seq.prompt)
                    yield data(chunk(False, rid, name, seq.prompt, None, index=i, logprobs=lps))
                if req.score_only:
                    c = dropped(c)
                last[i] = c
                # With include_speculation, every step that made tokens (the text may be held back).
                if c.text or (req.logprobs and c.logprobs) or (req.include_speculation and c.token_ids):
                    lps = logprobs_json(chat, llm.tokenizer, c.logprobs, offsets[i]) if req.logprobs else None
                    offsets[i] += len(c.text)
                    out = chunk(chat, rid, name, c.text, None, index=i, logprobs=lps)
                    if req.include_speculation:
                        out["ssd_speculation"] = speculation_json(c)
                    yield data(out)
                if c.tool_calls:
                    yield data(chunk(chat, rid, name, None, None, index=i, calls=c.tool_calls))
                if c.finish_reason:
                    final = chunk(chat, rid, name, None, c.finish_reason, index=i)
                    final["ssd_metrics"] = speculation(c.metrics, llm.config.mode)
                    yield data(final)
            else:
                if req.include_usage:
                    yield data({**chunk(chat, rid, name, None, None, choices=False),
                                "usage": usage([c.metrics for c in last], req.n)})
            yield "data: [DONE]\n\n"
        finally:
            gw.settle(seqs, last)

    return router
