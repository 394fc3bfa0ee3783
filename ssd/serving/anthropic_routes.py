"""Anthropic's routes of `ssd serve`: POST /v1/messages (streamed as Anthropic's events, or
not) and /v1/messages/count_tokens, with errors in Anthropic's shape; request checks and
response shapes in anthropic_protocol.py."""
import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ssd.errors import SSDError
from ssd.outputs import StreamChunk
from ssd.request.sequence import Sequence
from ssd.serving import anthropic_protocol as anthropic
from ssd.serving.gateway import Gateway
from ssd.serving.openai_protocol import APIError, api_error


def routes(gw: Gateway) -> APIRouter:
    router = APIRouter()
    name = gw.served_name

    @router.post("/v1/messages")
    async def messages(request: Request):
        try:
            gw.x_api_key(request)
            req = anthropic.parse_request(await gw.body_json(request), gw.served)
            seqs, queue = await gw.start(req)
            if req.stream:
                return StreamingResponse(stream(seqs[0], queue), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            answers = await gw.collect(seqs, queue, request)
        except APIError as e:
            return JSONResponse(anthropic.error_body(e), status_code=e.status)
        if answers is None:
            return Response(status_code=499)
        (seq,), (a,) = seqs, answers
        return JSONResponse(anthropic.message(anthropic.new_id(), name, a.text, a.last.tool_calls,
                                              a.last.finish_reason, seq.detokenizer.matched, a.last.metrics))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The tokens the model would read for these messages, system prompt and tools."""
        try:
            gw.x_api_key(request)
            chat, tools = anthropic.parse_count(await gw.body_json(request), gw.served)
            ids = await asyncio.to_thread(gw.llm.encode, chat, tools)
        except APIError as e:
            return JSONResponse(anthropic.error_body(e), status_code=e.status)
        except SSDError as e:
            e = api_error(e)
            return JSONResponse(anthropic.error_body(e), status_code=e.status)
        return {"input_tokens": len(ids)}

    async def stream(seq: Sequence, queue: asyncio.Queue) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start (sent with the first tokens, when the
        prompt's cached part is known), a text block's start, deltas and stop, a tool_use
        block per call, message_delta with the stop reason and usage, message_stop."""
        last: list[StreamChunk | None] = [None]
        index, text_open = 0, False
        try:
            async for _, c in gw.chunks(queue, 1):
                if last[0] is None:
                    start = {"id": anthropic.new_id(), "type": "message", "role": "assistant", "model": name,
                             "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {**anthropic.usage(seq.metrics()), "output_tokens": 0}}
                    yield anthropic.event("message_start", message=start)
                last[0] = c
                if c.error:
                    yield anthropic.event("error", error={"type": "api_error", "message": c.error})
                    break
                if c.text:
                    if not text_open:
                        yield anthropic.event("content_block_start", index=index,
                                              content_block={"type": "text", "text": ""})
                        text_open = True
                    yield anthropic.event("content_block_delta", index=index,
                                          delta={"type": "text_delta", "text": c.text})
                if not c.finish_reason:
                    continue
                if text_open:
                    yield anthropic.event("content_block_stop", index=index)
                    index += 1
                for call in c.tool_calls or []:
                    block = anthropic.tool_use(call)
                    yield anthropic.event("content_block_start", index=index, content_block={**block, "input": {}})
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                    yield anthropic.event("content_block_delta", index=index, delta=delta)
                    yield anthropic.event("content_block_stop", index=index)
                    index += 1
                matched = seq.detokenizer.matched
                yield anthropic.event("message_delta",
                                      delta={"stop_reason": anthropic.stop_reason(c.finish_reason, matched),
                                             "stop_sequence": matched},
                                      usage={"output_tokens": c.metrics.output_tokens})
                yield anthropic.event("message_stop")
        finally:
            gw.settle([seq], last)

    return router
