"""Request -> engine sequences -> OpenAI response: prompt tokenization and checks, sampling parameters, and the
streamed (SSE chunks ending in ``data: [DONE]``) or whole completion / chat completion bodies."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from serve.engine import Engine, EngineStopped, Event, QueueFull, Sequence
from serve.errors import APIError, error_body
from serve.sampling import SamplingParams

if TYPE_CHECKING:
    from serve.api import State


def completion_prompts(prompt, state: State) -> list[tuple[list[int], str]]:
    tok = state.tok
    items: list
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    vocab = state.loaded.model.config.vocab_size
    for it in items:
        if isinstance(it, str):
            ids = tok(it)["input_ids"]
            out.append((ids, it))
        else:
            if any(not (0 <= t < vocab) for t in it):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append((list(it), tok.decode(it)))
    return out


def _params(body, prompt_len: int, state: State, logprobs: int | None, i: int) -> SamplingParams:
    msl = state.max_seq_len
    if prompt_len == 0:
        raise APIError(400, "prompt is empty (0 tokens)", param="prompt")
    if prompt_len >= msl:
        raise APIError(400, f"This model's maximum context length is {msl} tokens. However, your prompt is "
                            f"{prompt_len} tokens (it needs room for at least one new token).",
                       param="messages" if hasattr(body, "messages") else "prompt", code="context_length_exceeded")
    room = msl - prompt_len
    max_tokens = room if body.max_tokens is None else min(body.max_tokens, room)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop = [s for s in stop if s]
    seed = None if body.seed is None else (body.seed + i) % (2 ** 63)
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                          min_p=body.min_p, presence_penalty=body.presence_penalty,
                          frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                          stop=stop, seed=seed, logprobs=logprobs, ignore_eos=body.ignore_eos)


async def _watch_disconnect(request: Request, engine: Engine, seqs: list[Sequence]) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for s in seqs:
                engine.abort(s)
            return


def _lp_completion(toks, offset0: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for t in toks:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({a: b for a, b in t.top})
        out["text_offset"].append(off)
        off += len(t.text)
    return out


def _lp_chat(toks) -> dict:
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                         "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in t.top]}
                        for t in toks], "refusal": None}


async def generate(state: State, engine: Engine, request: Request, body, prompts, chat: bool,
                    logprobs: int | None):
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    q: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    seqs: list[Sequence] = []
    meta: list[tuple[int, str]] = []  # (prompt index, prompt text)
    vocab = state.loaded.model.config.vocab_size
    for pi, (ids, ptext) in enumerate(prompts):
        for j in range(body.n):
            idx = len(seqs)
            params = _params(body, len(ids), state, logprobs, j)

            def sink(ev: Event, idx=idx) -> None:
                # `serve` steps the engine on this event loop's thread: put straight into the queue there (the
                # threadsafe call costs a self-pipe write and read per token); an engine thread must go through it
                if threading.get_ident() == loop_thread:
                    q.put_nowait((idx, ev))
                else:
                    loop.call_soon_threadsafe(q.put_nowait, (idx, ev))

            seqs.append(Sequence(ids, params, sink, vocab))
            meta.append((pi, ptext))
    try:
        engine.submit(seqs)
    except QueueFull:
        state.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(429, "server is at capacity (request queue full); retry later", "rate_limit_exceeded",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except EngineStopped:
        raise APIError(503, "server is shutting down", "service_unavailable", code="shutting_down") from None
    watcher = asyncio.create_task(_watch_disconnect(request, engine, seqs))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    obj = "chat.completion" if chat else "text_completion"

    def usage() -> dict:
        c = sum(len(s.out_ids) for s in seqs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c}

    if not body.stream:
        texts = ["" for _ in seqs]
        toks: list[list] = [[] for _ in seqs]
        reasons: list[str | None] = [None] * len(seqs)
        try:
            left = len(seqs)
            while left:
                idx, ev = await q.get()
                texts[idx] += ev.text
                if ev.token is not None:
                    toks[idx].append(ev.token)
                if ev.finish_reason is not None:
                    reasons[idx] = ev.finish_reason
                    left -= 1
                    if ev.finish_reason in ("error", "abort"):
                        for s in seqs:
                            engine.abort(s)
                        if ev.finish_reason == "error" or ev.error:
                            raise APIError(500 if ev.finish_reason == "error" else 503, ev.error or "aborted",
                                           "server_error")
                        return Response(status_code=499)  # client went away; nobody reads this
        finally:
            watcher.cancel()
            for s in seqs:
                engine.abort(s)
        choices = []
        for i, (_pi, ptext) in enumerate(meta):
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]},
                                "logprobs": _lp_chat(toks[i]) if logprobs is not None else None,
                                "finish_reason": reasons[i]})
            else:
                text = (ptext + texts[i]) if body.echo else texts[i]
                choices.append({"index": i, "text": text,
                                "logprobs": _lp_completion(toks[i], 0) if logprobs is not None else None,
                                "finish_reason": reasons[i]})
        return {"id": rid, "object": obj, "created": created, "model": state.name, "choices": choices,
                "usage": usage(), **({"system_fingerprint": None} if chat else {})}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, use: dict | None = None) -> str:
        d = {"id": rid, "object": chunk_obj, "created": created, "model": state.name, "choices": choices}
        if include_usage:
            d["usage"] = use
        return "data: " + json.dumps(d, ensure_ascii=False) + "\n\n"

    async def stream():
        offsets = [0] * len(seqs)
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(seqs))])
            elif body.echo:
                yield chunk([{"index": i, "text": meta[i][1], "logprobs": None, "finish_reason": None}
                             for i in range(len(seqs))])
            left = len(seqs)
            while left:
                idx, ev = await q.get()
                if ev.finish_reason in ("error", "abort"):
                    if ev.finish_reason == "abort" and not ev.error:
                        return  # the client disconnected: nothing to send to
                    err = error_body(ev.error or "generation failed", "server_error", code=500)
                    yield "data: " + json.dumps(err) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if ev.finish_reason is not None:
                    left -= 1
                if not ev.text and ev.token is None and ev.finish_reason is None:
                    continue
                lp = None
                if logprobs is not None and ev.token is not None:
                    lp = _lp_chat([ev.token]) if chat else _lp_completion([ev.token], offsets[idx])
                offsets[idx] += len(ev.text)
                if chat:
                    delta = {"content": ev.text} if (ev.text or ev.finish_reason is None) else {}
                    c = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
                else:
                    c = {"index": idx, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
                yield chunk([c])
            if include_usage:
                yield chunk([], usage())
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            for s in seqs:
                engine.abort(s)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
