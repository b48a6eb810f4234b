"""FastAPI app: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine import Engine, EngineStopped, Event, QueueFull, Sequence
from serve.loader import Loaded
from serve.metrics import Metrics
from serve.model import SlotModel
from serve.sampling import SamplingParams
from serve.schemas import ChatCompletionRequest, CompletionRequest
from training.errors import UserError

log = logging.getLogger("serve.api")


@dataclass
class ServeConfig:
    model_path: str
    served_name: str | None = None
    dtype: str = "auto"
    quantize: str | None = None
    max_batch: int = 16
    max_seq_len: int | None = None
    prefill_chunk: int = 256
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    placement: object | None = None  # serve.placement.Placement: --device-map/--max-memory/--offload-folder
    tp: int = 1  # tensor-parallel ranks (rank 0 serves; see serve.tp)
    dense_kernel: str = "auto"  # fp32 CPU Linears on oneDNN: auto (where timed faster at load) | on | off
    engine_on_event_loop: bool = False  # True: a task on the server's event loop (serve CLI); else its own thread


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``limit`` bytes (413) before they reach the app,
    then replay the buffered body; later ``receive`` calls (disconnect) go to the server."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _reject(self, receive, send, more_body: bool = True) -> None:
        # Lingering close, as nginx does: read and discard the rest of the body (bounded) before answering.
        # Closing a socket with unread bytes in its receive buffer makes the kernel send RST, and the client
        # then loses the 413 it was about to read (seen as a flaky "peer closed connection" in CI).
        drained = 0
        while more_body and drained <= 16 * self.limit:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            drained += len(msg.get("body", b""))
            more_body = msg.get("more_body", False)
        body = json.dumps(error_body(f"request body larger than {self.limit} bytes", "invalid_request_error",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length":
                try:
                    if int(v) > self.limit:
                        return await self._reject(receive, send)
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                chunks.clear()
                return await self._reject(receive, send, msg.get("more_body", False))
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        data = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class State:
    def __init__(self, cfg: ServeConfig, load_fn: Callable[[], Loaded]):
        self.cfg = cfg
        self.load_fn = load_fn
        self.status = "loading"  # loading | ready | failed | draining
        self.error: str | None = None
        self.engine: Engine | None = None
        self.tok = None
        self.loaded: Loaded | None = None
        self.max_seq_len = 0
        self.metrics = Metrics()
        self.name = cfg.served_name or cfg.model_path
        self.aliases = {self.name, cfg.model_path, os.path.basename(os.path.normpath(cfg.model_path))}
        self.created = int(time.time())
        self.on_failed: Callable[[BaseException], None] | None = None
        self.ready_event = threading.Event()
        self.placement: dict | None = None  # where the model runs: shown by /health and /v1/models
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop (set by the lifespan)
        self.engine_task: asyncio.Task | None = None

    def _start_engine_task(self) -> None:
        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("engine loop failed", exc_info=t.exception())
                self.status, self.error = "failed", f"engine loop failed: {t.exception()}"
        self.engine_task = asyncio.ensure_future(self.engine.run_async())
        self.engine_task.add_done_callback(done)

    def load(self) -> None:
        try:
            loaded = self.load_fn()
            cfg = self.cfg
            maxpos = loaded.max_positions
            msl = cfg.max_seq_len or min(maxpos, 2048)
            if msl > maxpos:
                raise UserError(f"--max-seq-len {msl} exceeds the model's max_position_embeddings {maxpos}")
            sm = SlotModel(loaded.model, cfg.max_batch, msl,
                           prefetch=getattr(cfg.placement, "prefetch", False), dense_kernel=cfg.dense_kernel)
            if loaded.tp > 1:
                from serve.tp import Driver

                sm = Driver(sm)
            self.placement = _placement_info(loaded, sm)
            _warmup(sm)
            self.loaded, self.tok, self.max_seq_len = loaded, loaded.tokenizer, msl
            self.engine = Engine(sm, loaded.tokenizer, loaded.eos_ids, cfg.prefill_chunk, cfg.max_queue, self.metrics,
                                 own_thread=not cfg.engine_on_event_loop)
            if cfg.engine_on_event_loop:
                self.loop.call_soon_threadsafe(self._start_engine_task)
            if self.status == "loading":
                self.status = "ready"
            log.info("model %s ready: max_batch=%d max_seq_len=%d kv_cache=%.1f MiB quantized=%s", self.name,
                     cfg.max_batch, msl, sm.cache_bytes / 2 ** 20, loaded.quantized)
        except BaseException as e:  # noqa: BLE001 - reported via /health and the CLI exit code
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("model load failed: %s", self.error)
            if self.on_failed is not None:
                self.on_failed(e)
        finally:
            self.ready_event.set()


def _placement_info(loaded: Loaded, sm: SlotModel) -> dict:
    info: dict = {"tp": loaded.tp, "kv_cache_bytes": sm.cache_bytes_per_device(),
                  "onednn_linears": getattr(sm, "dense_packed", 0)}
    if loaded.plan is not None:
        info.update(loaded.plan.summary())
        info["offloaded_layers"] = len(sm.prefetch.offloaded)
        info["prefetch"] = sm.prefetch.active
    return info


def _warmup(sm: SlotModel) -> None:
    import torch

    from serve.model import Segment

    sm.forward(torch.zeros(8, dtype=torch.long), [Segment(0, 0, 8)])
    other = 1 if sm.max_batch > 1 else 0
    sm.forward(torch.zeros(2, dtype=torch.long), [Segment(0, 8, 1), Segment(other, 9 * (1 - other), 1)])


def create_app(cfg: ServeConfig, load_fn: Callable[[], Loaded] | None = None,
               load_in_background: bool = True) -> FastAPI:
    if load_fn is None:
        from serve.loader import load

        def load_fn():
            return load(cfg.model_path, cfg.dtype, cfg.quantize, placement=cfg.placement, max_batch=cfg.max_batch,
                        max_seq_len=cfg.max_seq_len, tp=cfg.tp)

    state = State(cfg, load_fn)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        if load_in_background:
            threading.Thread(target=state.load, name="serve-load", daemon=True).start()
        else:
            state.load()
        yield
        if state.engine is not None:
            await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="memfit serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible generation server with continuous batching.")
    app.state.serve = state
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: {er.get('msg')}"
                        for er in errs[:5])
        return JSONResponse(error_body(msg or "invalid request", "invalid_request_error", ".".join(loc) or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", code=e.status_code),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    def auth(request: Request) -> None:
        key = cfg.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        token = got[7:].strip() if got[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")

    def ready() -> Engine:
        if state.status == "loading":
            state.metrics.rejected.labels(reason="loading").inc()
            raise APIError(503, "model is loading", "service_unavailable", code="model_loading",
                           headers={"Retry-After": "2"})
        if state.status == "draining":
            state.metrics.rejected.labels(reason="draining").inc()
            raise APIError(503, "server is shutting down", "service_unavailable", code="shutting_down")
        if state.status != "ready" or state.engine is None or not state.engine.alive:
            raise APIError(503, f"model unavailable: {state.error or 'engine stopped'}", "service_unavailable",
                           code="model_unavailable")
        return state.engine

    def check_model(name: str | None) -> None:
        if name is not None and name not in state.aliases:
            raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")

    @app.get("/health")
    async def health():
        if state.status == "ready" and state.engine is not None and state.engine.alive:
            return {"status": "ok", "placement": state.placement}
        msg = {"loading": "model is loading", "draining": "server is shutting down"}.get(
            state.status, f"model unavailable: {state.error}")
        return JSONResponse(error_body(msg, "service_unavailable", code=state.status), status_code=503)

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:
            state.engine._update_gauges()
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": state.name, "object": "model", "created": state.created,
                                            "owned_by": "memfit", "max_model_len": state.max_seq_len or None,
                                            "placement": state.placement}]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(auth)])
    async def model_info(model_id: str):
        check_model(model_id)
        return {"id": state.name, "object": "model", "created": state.created, "owned_by": "memfit",
                "max_model_len": state.max_seq_len or None, "placement": state.placement}

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request):
        engine = ready()
        check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported", param="echo")
        prompts = _completion_prompts(body.prompt, state)
        return await _generate(state, engine, request, body, prompts, chat=False, logprobs=body.logprobs)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        engine = ready()
        check_model(body.model)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        tok = state.tok
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        msgs = []
        for m in body.messages:
            c = m.content
            if isinstance(c, list):
                c = "".join(p.text for p in c)
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": c or ""})
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        ids = tok(text, add_special_tokens=False)["input_ids"]
        lp = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        return await _generate(state, engine, request, body, [(ids, "")], chat=True, logprobs=lp)

    return app


def _completion_prompts(prompt, state: State) -> list[tuple[list[int], str]]:
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


async def _generate(state: State, engine: Engine, request: Request, body, prompts, chat: bool,
                    logprobs: int | None):
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    seqs: list[Sequence] = []
    meta: list[tuple[int, str]] = []  # (prompt index, prompt text)
    vocab = state.loaded.model.config.vocab_size
    for pi, (ids, ptext) in enumerate(prompts):
        for j in range(body.n):
            idx = len(seqs)
            params = _params(body, len(ids), state, logprobs, j)

            def sink(ev: Event, idx=idx) -> None:
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
