"""FastAPI app: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from memfit.defaults import max_seq_len
from memfit.errors import UserError
from memfit.heap import release_free_memory
from memfit.runtime.generic import PACKED, HFCacheModel, make_runner
from memfit.runtime.linear import format_counts
from memfit.runtime.slot_model import SlotModel
from serve import kv_config
from serve.engine import Engine
from serve.errors import APIError, error_body
from serve.generate import ServedModel, completion_prompts, generate
from serve.kv_config import format_bytes
from serve.loader import Loaded
from serve.metrics import Metrics
from serve.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("serve.api")


@dataclass
class ServeConfig:
    model_path: str
    served_name: str | None = None
    dtype: str = "auto"
    quantize: str | None = None
    quantize_embeddings: str | None = None  # "int8" / "int4": lm_head and input embedding quantized at load
    max_batch: int = 16
    max_seq_len: int | None = None
    prefill_chunk: int = kv_config.DEFAULT_PREFILL_CHUNK
    max_queue: int = 64
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    placement: object | None = None  # serve.placement.Placement: --device-map/--max-memory/--offload-folder
    tp: int = 1  # tensor-parallel ranks (rank 0 serves; see serve.tp)
    dense_kernel: str = "auto"  # fp32 CPU Linears on oneDNN: auto (where timed faster at load) | on | off
    cpu_kernels: str = "auto"  # fused fp32 CPU norm/RoPE/decode-attention kernels (memfit.runtime): auto | on | off
    kv_cache: str = "paged"  # paged (blocks, where the packed engine runs the model on one device) | static slots
    kv_cache_memory: int | None = None  # paged cache bytes; None: serve.kv_config's default share of free memory
    block_size: int = 16  # token positions per KV block
    kv_cache_dtype: str = "auto"  # auto (the engine's activation dtype) | int8 (a scale per token and KV head)
    prefix_caching: bool = True  # reuse the KV blocks of identical prompt prefixes (paged only)
    engine_on_event_loop: bool = False  # True: a task on the server's event loop (serve CLI); else its own thread


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
        self.served: ServedModel | None = None  # what request handling needs of the loaded model
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
        self.kv_static_reason: str | None = None  # why the KV cache is static slots (shown by /health)
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
            msl = max_seq_len(loaded.model.config, cfg.max_seq_len)
            kv_kw = self._kv_blocks(loaded, msl)
            # the packed engine where it knows the architecture, else HF's own forward and cache (slower);
            # tensor parallel is the packed engine's only
            sm = make_runner(loaded.model, cfg.max_batch, msl, generic_ok=loaded.tp == 1,
                             prefetch=getattr(cfg.placement, "prefetch", False), dense_kernel=cfg.dense_kernel,
                             cpu_kernels=cfg.cpu_kernels, bf16_weights=loaded.bf16_weights,
                             cache_dtype=kv_config.kv_torch_dtype(cfg.kv_cache_dtype),
                             **{k: kv_kw[k] for k in ("num_blocks", "block_size") if k in kv_kw})
            kv_config.check_kv_dtype(sm, cfg.kv_cache_dtype)
            if kv_kw and not getattr(sm, "paged", False):
                self.kv_static_reason = "the generic engine (HF's own cache)" \
                    if getattr(sm, "engine", PACKED) != PACKED else "the model's engine has no paged cache"
                log.info("KV cache: static slots (%s)", self.kv_static_reason)
            elif kv_kw and sm.bytes_per_block != kv_kw["bytes_per_block"]:
                log.warning("KV cache: %d bytes per block, %d predicted: it takes %s, not the budget's %s",
                            sm.bytes_per_block, kv_kw["bytes_per_block"], format_bytes(sm.cache_bytes),
                            format_bytes(kv_kw["num_blocks"] * kv_kw["bytes_per_block"]))
            if cfg.quantize_embeddings == "int8" and getattr(sm, "ops", None) is None:
                raise UserError("--quantize-embeddings needs memfit's CPU kernels (its int8 lm_head runs on them); "
                                "drop --cpu-kernels off")
            if loaded.tp > 1:
                from serve.tp import Driver

                sm = Driver(sm)
            self.placement = _placement_info(loaded, sm)
            _warmup(sm)
            gc.collect()
            release_free_memory()  # the load's transient copies (dtype casts, repacking) would stay as heap fragments
            self.loaded, self.tok, self.max_seq_len = loaded, loaded.tokenizer, msl
            self.engine = Engine(sm, loaded.tokenizer, loaded.eos_ids, cfg.prefill_chunk, cfg.max_queue, self.metrics,
                                 own_thread=not cfg.engine_on_event_loop, prefix_caching=cfg.prefix_caching)
            # no prompt is longer than the paged cache: it holds one --max-seq-len sequence at least (kv_config)
            self.served = ServedModel(self.name, loaded.tokenizer, loaded.model.config.vocab_size, msl, self.metrics)
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

    def _kv_blocks(self, loaded: Loaded, msl: int) -> dict:
        """make_runner's paged-cache arguments (num_blocks, block_size; and the bytes_per_block they were sized
        with), or {} for static slots: asked for, or a placed / tensor-parallel model. Logs the size chosen; a
        budget too small is a UserError."""
        cfg = self.cfg
        if cfg.kv_cache == "static":
            self.kv_static_reason = "--kv-cache static"
        elif loaded.tp > 1 or loaded.plan is not None:
            self.kv_static_reason = "tensor-parallel" if loaded.tp > 1 else "placed over devices (--device-map)"
        if self.kv_static_reason is not None:
            log.info("KV cache: static slots (%s)", self.kv_static_reason)
            return {}
        elem = kv_config.model_kv_elem_bytes(loaded.model, loaded.bf16_weights)
        return kv_config.paged_cache_size(loaded.model.config, elem, cfg.kv_cache_dtype, cfg.kv_cache_memory,
                                          cfg.block_size, cfg.max_batch, msl, cfg.prefill_chunk,
                                          next(loaded.model.parameters()).device)


def _placement_info(loaded: Loaded, sm: SlotModel | HFCacheModel) -> dict:
    packed, ops = getattr(sm, "dense_packed", 0), getattr(sm, "ops", None)
    info: dict = {"engine": getattr(sm, "engine", PACKED), "tp": loaded.tp,
                  "kv_cache_bytes": sm.cache_bytes_per_device(),  # the generic engine's: held now, grows
                  "cpu_kernels": ops is not None,  # memfit.runtime.kernels built and in use
                  "packed_linears": packed, "linear_kernel": ("panel" if ops is not None else "onednn") if packed
                  else "torch", "int4_kernel_linears": getattr(sm, "int4_kernel", 0),
                  # how many Linears of each weight format the model runs (memfit.runtime.linear.weight_format)
                  "linear_formats": format_counts(loaded.model)}
    if getattr(sm, "reason", ""):  # why the generic engine runs it
        info["engine_reason"] = sm.reason
    if loaded.plan is not None:
        info.update(loaded.plan.summary())
        info["offloaded_layers"] = len(sm.prefetch.offloaded)
        info["prefetch"] = sm.prefetch.active
    return info


def _warmup(sm: SlotModel | HFCacheModel) -> None:
    import torch

    from memfit.runtime.kv_groups import blocks_for
    from memfit.runtime.slot_model import Segment

    if getattr(sm, "paged", False):  # rows 0 and 1 on some blocks (the engine rewrites them before use)
        sm.assign_blocks(min(2, sm.max_batch), min(blocks_for(10, sm.block_size), sm.max_blocks_per_seq), wrap=True)
    sm.forward(torch.zeros(8, dtype=torch.long), [Segment(0, 0, 8)])
    other = 1 if sm.max_batch > 1 else 0
    sm.forward(torch.zeros(2, dtype=torch.long), [Segment(0, 8, 1), Segment(other, 9 * (1 - other), 1)])


def create_app(cfg: ServeConfig, load_fn: Callable[[], Loaded] | None = None,
               load_in_background: bool = True) -> FastAPI:
    if load_fn is None:
        from serve.loader import load

        def load_fn():
            return load(cfg.model_path, cfg.dtype, cfg.quantize, placement=cfg.placement, max_batch=cfg.max_batch,
                        max_seq_len=cfg.max_seq_len, tp=cfg.tp, quantize_embeddings=cfg.quantize_embeddings,
                        cpu_kernels=cfg.cpu_kernels)

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
            kv = state.engine.kv_info()
            if state.kv_static_reason:
                kv["static_reason"] = state.kv_static_reason
            return {"status": "ok", "placement": state.placement, "kv": kv}
        msg = {"loading": "model is loading", "draining": "server is shutting down"}.get(
            state.status, f"model unavailable: {state.error}")
        return JSONResponse(error_body(msg, "service_unavailable", code=state.status), status_code=503)

    @app.get("/metrics")
    async def metrics():
        if state.engine is not None:
            state.engine.update_gauges()
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
        prompts = completion_prompts(body.prompt, state.served)
        return await generate(state.served, engine, request, body, prompts, chat=False, logprobs=body.logprobs)

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
        return await generate(state.served, engine, request, body, [(ids, "")], chat=True, logprobs=lp)

    return app
