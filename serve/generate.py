"""Request -> engine sequences: prompt tokenization and checks, sampling parameters, submission (429 when the
queue is full), then the response from :mod:`serve.responses`.

It gets what it needs of the server as a :class:`ServedModel` (built by ``serve.api.State`` once the model is
loaded), not the server's state itself, so ``serve.api`` imports this module and not the other way round.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from serve.engine import Engine, EngineStopped, QueueFull
from serve.errors import APIError
from serve.metrics import Metrics
from serve.responses import ResponseInfo, streaming_response, whole_response
from serve.sampling import SamplingParams
from serve.stream import RequestStream


@dataclass(frozen=True)
class ServedModel:
    name: str  # the served model name, echoed in responses
    tokenizer: object
    vocab_size: int
    max_seq_len: int
    metrics: Metrics


def completion_prompts(prompt, served: ServedModel) -> list[tuple[list[int], str]]:
    """``/v1/completions``' prompt (text, texts, ids or lists of ids) as (ids, text) pairs."""
    tok = served.tokenizer
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
    vocab = served.vocab_size
    for it in items:
        if isinstance(it, str):
            out.append((tok(it)["input_ids"], it))
        else:
            if any(not (0 <= t < vocab) for t in it):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append((list(it), tok.decode(it)))
    return out


def sampling_params(body, prompt_len: int, max_seq_len: int, logprobs: int | None, i: int) -> SamplingParams:
    """The i-th choice's parameters: max_tokens capped by the context left, seed + i (n choices differ)."""
    msl = max_seq_len
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


async def generate(served: ServedModel, engine: Engine, request: Request, body, prompts: list[tuple[list[int], str]],
                   chat: bool, logprobs: int | None):
    """Run ``body.n`` choices per prompt; the whole body (dict) or a streaming response."""
    stream = RequestStream(engine, served.vocab_size)
    texts = []
    for ids, ptext in prompts:
        for j in range(body.n):
            stream.add(ids, sampling_params(body, len(ids), served.max_seq_len, logprobs, j))
            texts.append(ptext)
    try:
        stream.submit()
    except QueueFull:
        served.metrics.rejected.labels(reason="queue_full").inc()
        raise APIError(429, "server is at capacity (request queue full); retry later", "rate_limit_exceeded",
                       code="queue_full", headers={"Retry-After": "1"}) from None
    except EngineStopped:
        raise APIError(503, "server is shutting down", "service_unavailable", code="shutting_down") from None
    watcher = asyncio.create_task(stream.watch_disconnect(request.receive))
    info = ResponseInfo(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, created=int(time.time()),
                        model=served.name, chat=chat, prompt_texts=texts,
                        prompt_tokens=sum(len(ids) for ids, _ in prompts), logprobs=logprobs,
                        echo=bool(getattr(body, "echo", False)),
                        include_usage=bool(body.stream_options and body.stream_options.include_usage))
    if body.stream:
        return streaming_response(stream, info, watcher)
    out: dict | Response = await whole_response(stream, info, watcher)
    return out
