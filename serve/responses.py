"""OpenAI response bodies from a :class:`~serve.stream.RequestStream`: completion or chat completion, whole (one
JSON body once every choice finished) or streamed (SSE chunks, one per Event, ending in ``data: [DONE]``).

Plain functions over a :class:`ResponseInfo` (what the request fixed: ids, shape, options), so each shape reads
top to bottom and can be tested alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response, StreamingResponse

from serve.errors import APIError, error_body
from serve.sequence import TokenInfo
from serve.stream import RequestStream

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class ResponseInfo:
    id: str
    created: int
    model: str
    chat: bool
    prompt_texts: list[str]  # per choice: its prompt's text (completions' echo)
    prompt_tokens: int
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the top k
    echo: bool = False
    include_usage: bool = False  # streamed: a last chunk with the usage

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def usage(info: ResponseInfo, completion_tokens: int) -> dict:
    return {"prompt_tokens": info.prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": info.prompt_tokens + completion_tokens}


def logprobs_completion(toks: list[TokenInfo], offset0: int) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for t in toks:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(dict(t.top))
        out["text_offset"].append(off)
        off += len(t.text)
    return out


def logprobs_chat(toks: list[TokenInfo]) -> dict:
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                         "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in t.top]}
                        for t in toks], "refusal": None}


# ---- whole ---------------------------------------------------------------------------------------

def whole_body(info: ResponseInfo, texts: list[str], toks: list[list[TokenInfo]], reasons: list[str | None],
               completion_tokens: int) -> dict:
    """The (chat) completion object once every choice finished."""
    choices = []
    for i, text in enumerate(texts):
        if info.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs_chat(toks[i]) if info.logprobs is not None else None,
                            "finish_reason": reasons[i]})
        else:
            choices.append({"index": i, "text": info.prompt_texts[i] + text if info.echo else text,
                            "logprobs": logprobs_completion(toks[i], 0) if info.logprobs is not None else None,
                            "finish_reason": reasons[i]})
    body = {"id": info.id, "object": info.object, "created": info.created, "model": info.model,
            "choices": choices, "usage": usage(info, completion_tokens)}
    if info.chat:
        body["system_fingerprint"] = None
    return body


async def whole_response(stream: RequestStream, info: ResponseInfo, watcher: asyncio.Task) -> dict | Response:
    """Collect every choice's Events into one body. An error fails the request (500); a sequence aborted at
    shutdown answers 503; a client that went away gets a 499 nobody reads."""
    n = len(stream.seqs)
    texts = [""] * n
    toks: list[list[TokenInfo]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    try:
        async for idx, ev in stream:
            texts[idx] += ev.text
            if ev.token is not None:
                toks[idx].append(ev.token)
            if ev.finish_reason is None:
                continue
            reasons[idx] = ev.finish_reason
            if ev.finish_reason in ("error", "abort"):
                stream.abort()
                if ev.finish_reason == "error" or ev.error:
                    raise APIError(500 if ev.finish_reason == "error" else 503, ev.error or "aborted",
                                   "server_error")
                return Response(status_code=499)
    finally:
        watcher.cancel()
        stream.abort()
    return whole_body(info, texts, toks, reasons, stream.completion_tokens())


# ---- streamed ------------------------------------------------------------------------------------

def sse_chunk(info: ResponseInfo, choices: list, use: dict | None = None) -> str:
    d = {"id": info.id, "object": info.chunk_object, "created": info.created, "model": info.model,
         "choices": choices}
    if info.include_usage:
        d["usage"] = use
    return "data: " + json.dumps(d, ensure_ascii=False) + "\n\n"


def first_chunk(info: ResponseInfo, n: int) -> str | None:
    """Chat: the assistant role of every choice; completions with echo: the prompts; else nothing."""
    if info.chat:
        return sse_chunk(info, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None} for i in range(n)])
    if info.echo:
        return sse_chunk(info, [{"index": i, "text": info.prompt_texts[i], "logprobs": None, "finish_reason": None}
                                for i in range(n)])
    return None


def stream_choice(info: ResponseInfo, idx: int, text: str, token: TokenInfo | None, finish_reason: str | None,
                  offset: int) -> dict:
    """One choice's part of a chunk; ``offset``: the characters of this choice sent before (text_offset)."""
    lp = None
    if info.logprobs is not None and token is not None:
        lp = logprobs_chat([token]) if info.chat else logprobs_completion([token], offset)
    if info.chat:
        delta = {"content": text} if (text or finish_reason is None) else {}
        return {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish_reason}


async def sse_events(stream: RequestStream, info: ResponseInfo, watcher: asyncio.Task) -> AsyncIterator[str]:
    """The SSE body: a chunk per Event with something in it; an error becomes a data chunk, then ``[DONE]``."""
    offsets = [0] * len(stream.seqs)
    try:
        first = first_chunk(info, len(stream.seqs))
        if first is not None:
            yield first
        async for idx, ev in stream:
            if ev.finish_reason in ("error", "abort"):
                if ev.finish_reason == "abort" and not ev.error:
                    return  # the client disconnected: nothing to send to
                err = error_body(ev.error or "generation failed", "server_error", code=500)
                yield "data: " + json.dumps(err) + "\n\n"
                yield "data: [DONE]\n\n"
                return
            if not ev.text and ev.token is None and ev.finish_reason is None:
                continue
            c = stream_choice(info, idx, ev.text, ev.token, ev.finish_reason, offsets[idx])
            offsets[idx] += len(ev.text)
            yield sse_chunk(info, [c])
        if info.include_usage:
            yield sse_chunk(info, [], usage(info, stream.completion_tokens()))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        stream.abort()


def streaming_response(stream: RequestStream, info: ResponseInfo, watcher: asyncio.Task) -> StreamingResponse:
    return StreamingResponse(sse_events(stream, info, watcher), media_type="text/event-stream", headers=SSE_HEADERS)
