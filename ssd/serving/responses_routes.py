"""The Responses API's routes of `ssd serve`: POST /v1/responses (streamed as its typed events,
or not), GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items; request checks, shapes and the kept responses in
responses_protocol.py."""
import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ssd.request.sequence import Sequence
from ssd.serving import responses_protocol as rp
from ssd.serving.gateway import Gateway
from ssd.serving.openai_protocol import APIError, speculation


def routes(gw: Gateway) -> APIRouter:
    router = APIRouter(dependencies=[Depends(gw.bearer)])
    store = rp.ResponseStore()
    llm, name = gw.llm, gw.served_name

    @router.post("/v1/responses")
    async def create(request: Request):
        req = rp.parse_request(await gw.body_json(request), gw.served, store)
        try:
            seqs, queue = await gw.start(req.chat)
        except APIError as e:
            raise rp.renamed(e) from None
        rid, created = rp.new_id("resp"), rp.now()
        if req.chat.stream:
            return StreamingResponse(stream(rid, created, req, seqs[0], queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answers = await gw.collect(seqs, queue, request)
        if answers is None:
            return Response(status_code=499)
        (a,) = answers
        body = rp.response(rid, created, name, req, rp.output_items(a.text, a.last.tool_calls),
                           a.last.finish_reason, a.last.metrics,
                           {"ssd_metrics": speculation(a.last.metrics, llm.config.mode)})
        if req.echo["store"]:
            store.keep(body, req.conversation, a.text, a.last.tool_calls, req.items)
        return JSONResponse(body)

    @router.get("/v1/responses/{rid}")
    async def get(rid: str):
        return store.get(rid)

    @router.get("/v1/responses/{rid}/input_items")
    async def items(rid: str, request: Request):
        return rp.item_page(store.input_items(rid), request.query_params)

    @router.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        store.delete(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def stream(rid: str, created: float, req: rp.ResponsesRequest, seq: Sequence, queue: asyncio.Queue
                     ) -> AsyncIterator[str]:
        """created, in_progress; the text as a message item (added, its part added, deltas, text
        done, part done, item done); each call as a function_call item (added, its arguments'
        delta and done, item done); completed (or incomplete, or failed) with the whole response."""
        event, last = rp.Events(), [None]

        def start_message(msg_id: str) -> str:
            item = rp.message_item(msg_id, "", "in_progress")
            return event("response.output_item.added", output_index=0, item=item) + event(
                "response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": []})

        output: list[dict] = []
        text, msg_id = [], None
        try:
            body = rp.response(rid, created, name, req, [], None, None)
            yield event("response.created", response=body)
            yield event("response.in_progress", response=body)
            async for _, c in gw.chunks(queue, 1):
                last[0] = c
                if c.error:
                    yield event("response.failed", response=rp.failed(body, c.error))
                    return
                if c.text:
                    if msg_id is None:
                        msg_id = rp.new_id("msg")
                        yield start_message(msg_id)
                    text.append(c.text)
                    yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                delta=c.text, logprobs=[])
                if not c.finish_reason:
                    continue
                whole = "".join(text)
                if msg_id is not None or not c.tool_calls:
                    if msg_id is None:  # (an empty answer: its message, as the non-streamed one has)
                        msg_id = rp.new_id("msg")
                        yield start_message(msg_id)
                    item = rp.message_item(msg_id, whole)
                    yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                                text=whole, logprobs=[])
                    yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
                                part=item["content"][0])
                    yield event("response.output_item.done", output_index=0, item=item)
                    output.append(item)
                for call in c.tool_calls or []:
                    index, item_id = len(output), rp.new_id("fc")
                    yield event("response.output_item.added", output_index=index,
                                item=rp.call_item(item_id, call, "in_progress"))
                    yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                delta=call.arguments)
                    yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                name=call.name, arguments=call.arguments)
                    item = rp.call_item(item_id, call)
                    yield event("response.output_item.done", output_index=index, item=item)
                    output.append(item)
                final = rp.response(rid, created, name, req, output, c.finish_reason, c.metrics,
                                    {"ssd_metrics": speculation(c.metrics, llm.config.mode)})
                if req.echo["store"]:
                    store.keep(final, req.conversation, whole, c.tool_calls, req.items)
                kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                yield event(kind, response=final)
        finally:
            gw.settle([seq], last)

    return router

