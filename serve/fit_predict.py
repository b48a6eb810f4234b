"""``serve fit``'s candidates and their predicted memory, from shapes alone (no weights read).

A candidate is a weight format (how ``serve`` loads the model: ``--dtype``, ``--quantize int8``,
``--quantize-embeddings``, or a compress output), a KV cache dtype, the sequences that run at once and the
prefill chunk. Its bytes come from the model built on the meta device (parameter counts per kind) and from
safetensors headers (a compress output's packed tensors), by the rules serve's loader and engine follow:

- steady = base + weights held + KV cache (paged: exactly the workload's blocks, written full) + workspace;
- load peak = base - tokenizer (loaded after the weights) + what the load holds at its worst point
  (``Format.load``: file pages read, conversions alive at once);
- peak = max(steady, load peak).

``base`` is measured (serve.fit_probe --base-only: interpreter, torch, serve, memfit's kernels, the tokenizer):
it does not depend on the candidate. The workspace is one prefill chunk's activations plus the logits rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from memfit.modeldir import read_config, weight_files
from serve.kv_config import kv_layout

CHUNKS = (256, 128)
"""Prefill chunks, in order of preference: serve's default 256 unless memory needs less. 512 is not tried: in
bench/fit.py's first run, the same command line with --prefill-chunk 512 served the workload at 0.87x (Gemma 3
270M) and 0.79x (the shipped model) of 256's throughput."""


@dataclass
class Shapes:
    """What a dense HF checkpoint holds, counted on the meta device."""

    linear: int
    """Weights of the decoder's Linear layers (lm_head excluded)."""
    linear_rows: int
    """Their output rows: one int8 scale each."""
    vocab: int
    """One vocabulary table (vocab x hidden); the embedding, and lm_head's when untied, are this size."""
    tied: bool
    """lm_head shares the input embedding."""
    other: int
    """Everything else: norms, biases."""
    hidden: int
    intermediate: int
    vocab_size: int
    file_bytes: int
    """The safetensors files' size."""

    @property
    def tables(self) -> int:
        return self.vocab * (1 if self.tied else 2)


@dataclass
class Format:
    """One way ``serve`` can hold the weights."""

    name: str
    model: str
    """The dir ``serve --model`` gets: the checkpoint, or a compress output."""
    flags: list[str]
    held: int
    """Weight bytes the engine holds once loaded."""
    load: int
    """Bytes the load holds at its peak besides base: file pages read, conversions alive at once."""
    kv_elem: int
    """KV cache element bytes with --kv-cache-dtype auto."""
    stream: int = 0
    """Placed over RAM and disk (--max-memory): the largest offloaded module (a layer, or the embedding), read into
    RAM while it runs (serve.placement.Plan.working)."""

    @property
    def placed(self) -> bool:
        return "--max-memory" in self.flags


@dataclass
class Candidate:
    """One ``serve`` command line and what fit knows of it."""

    fmt: Format
    kv_dtype: str
    running: int
    """--max-batch: sequences that run at once (the workload's concurrency, or fewer when memory is short)."""
    prefill_chunk: int
    kv_bytes: int
    max_seq_len: int
    predicted: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    status: str = "not verified"

    @property
    def name(self) -> str:
        kv = "" if self.kv_dtype == "auto" else " kv-int8"
        return f"{self.fmt.name}{kv} r{self.running} c{self.prefill_chunk}"

    def serve_args(self) -> list[str]:
        args = ["--model", self.fmt.model, *self.fmt.flags, "--max-batch", str(self.running),
                "--max-seq-len", str(self.max_seq_len), "--prefill-chunk", str(self.prefill_chunk)]
        if not self.fmt.placed:  # a placed model's cache is static: --max-batch x --max-seq-len, counted in RAM
            args += ["--kv-cache-memory", str(self.kv_bytes)]
        return args + (["--kv-cache-dtype", self.kv_dtype] if self.kv_dtype != "auto" else [])


def shapes(model_dir: str) -> Shapes:
    import torch

    from serve.placement import meta_model

    model = meta_model(model_dir, torch.float32)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight is emb.weight
    linear = rows = 0
    seen = {id(emb.weight)} | ({id(head.weight)} if head is not None else set())
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            linear += m.weight.numel()
            rows += m.weight.shape[0]
            seen.add(id(m.weight))
    other = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return Shapes(linear, rows, emb.weight.numel(), tied, other, text.hidden_size,
                  getattr(text, "intermediate_size", 4 * text.hidden_size), emb.weight.shape[0],
                  sum((Path(model_dir) / f).stat().st_size for f in weight_files(model_dir)))


def dense_formats(model_dir: str, s: Shapes, kernels: bool) -> list[Format]:
    """fp32, bf16 (on memfit's kernels: bf16 weights, fp32 activations and KV), int8 Linears (serve --quantize
    int8), and int8 Linears with an int8 vocabulary table (--quantize-embeddings int8, kernels only)."""
    fp32 = 4 * (s.linear + s.tables + s.other)
    int8_linears = s.linear + 4 * s.linear_rows + 4 * s.other
    int8_tables = s.tables + 4 * s.vocab_size * (1 if s.tied else 2)
    out = [
        # fp32 is read zero-copy and packed Linear by Linear (the vocabulary a block of rows at a time), each
        # one's file pages dropped once packed: the load never holds more than the weights
        Format("fp32", model_dir, ["--dtype", "fp32"], fp32, fp32, 4),
        # --quantize int8 quantizes the Linears of the lazily read fp32 model, dropping their pages right after
        Format("int8", model_dir, ["--quantize", "int8", "--dtype", "fp32"], int8_linears + 4 * s.tables,
               int8_linears + 4 * s.tables, 4),
    ]
    if kernels:
        # transformers converts every fp32 tensor to bf16 while the whole file is mapped and read
        out.insert(1, Format("bf16", model_dir, ["--dtype", "bf16"], fp32 // 2, s.file_bytes + fp32 // 2, 4))
        out.append(Format("int8+vocab8", model_dir, ["--quantize", "int8", "--quantize-embeddings", "int8",
                                                     "--dtype", "fp32"],
                          int8_linears + int8_tables, int8_linears + int8_tables, 4))
    return out


def compressed_formats(out_dir: str, name: str, s: Shapes, kernels: bool) -> list[Format]:
    """A compress output as it is (its vocabulary table upcast to fp32 by compress.load), and with an int8
    table (--quantize-embeddings int8)."""
    vocab_file, rest = 0, 0
    for f in (Path(out_dir) / n for n in weight_files(out_dir)):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                n = math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
                if "embed_tokens" in k or k.startswith("lm_head"):
                    vocab_file += n
                else:
                    rest += n
    file_bytes = vocab_file + rest
    # compress.load reads the file and upcasts the (fp16) vocabulary table to fp32; serve then packs that copy
    # (another fp32 table while the first is alive) or quantizes it to int8 rows
    upcast = 4 * s.tables
    out = [Format(name, out_dir, [], rest + upcast, file_bytes + 2 * upcast, 4)]
    if kernels:
        int8_tables = s.tables + 4 * s.vocab_size * (1 if s.tied else 2)
        out.append(Format(name + "+vocab8", out_dir, ["--quantize-embeddings", "int8"], rest + int8_tables,
                          file_bytes + upcast + int8_tables, 4))
    return out


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "I8": 1, "U8": 1, "I16": 2}


def kv_plan(config: dict, fmt: Format, kv_dtype: str, running: int, seq_len: int, block_size: int,
            chunk: int) -> int:
    """The paged cache that holds ``running`` sequences of ``seq_len`` tokens prefilled ``chunk`` at a time:
    exactly their blocks (a sliding-window layer's only inside its window)."""
    lay = kv_layout(config, fmt.kv_elem, kv_dtype, block_size, seq_len)
    return running * lay.seq_blocks(seq_len, chunk) * lay.bytes_per_block


LOGIT_COPIES = 6
"""fp32 [running, vocab] tensors alive at once in a step: the logits and the sampler's working copies. Gemma 3
270M's steps peaked 70-120 MiB over its settled RSS at 16 rows of a 262k vocabulary: 4.5-7.5 such rows."""


def workspace(s: Shapes, config: dict, running: int, chunk: int, seq_len: int) -> int:
    """One prefill chunk's fp32 activations (hidden states, q/k/v, the MLP's gate/up, one layer's attention
    scores over the sequence) and the step's logits rows with their sampling copies."""
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads", 1)
    acts = chunk * (8 * s.hidden + 3 * s.intermediate + heads * seq_len) * 4
    return acts + LOGIT_COPIES * running * s.vocab_size * 4


def predict(base: int, tokenizer: int, s: Shapes, config: dict, fmt: Format, kv_bytes: int, running: int,
            chunk: int, seq_len: int) -> dict:
    """``base``: the process before any weight (tokenizer included); ``tokenizer``: its part, loaded after the
    weights, so not alive at the load's peak."""
    ws = workspace(s, config, running, chunk, seq_len)
    steady = base + fmt.held + kv_bytes + fmt.stream + ws
    load = base - tokenizer + fmt.load
    return {"base": base, "weights": fmt.held, "kv": kv_bytes, "workspace": ws, "steady": steady, "load": load,
            "peak": max(steady, load)}


def disk_offload(model_dir: str, s: Shapes, config: dict, running: int, chunk: int, seq_len: int, base: int,
                 budget: int) -> tuple[Format, int] | None:
    """fp32 weights placed over RAM and disk by serve's own planner (serve.placement.compute_plan, as
    ``serve --max-memory cpu=X`` runs it): X is what the budget leaves after base and the workspace, less the
    room the planner keeps for the layer it streams. The layers that do not fit are read from the checkpoint's
    safetensors every step (fp32: read in place, no converted copy). Returns the format and its static KV cache
    bytes, or None when nothing would be on disk (an in-RAM format does better) or not even one layer fits."""
    import torch

    from memfit.errors import UserError
    from serve.placement import compute_plan

    model = _fp32_meta_model(model_dir)
    room = budget - base - workspace(s, config, running, chunk, seq_len)
    x = room
    for _ in range(3):  # accelerate keeps room in X for the layer it streams; if not, shrink X by the excess
        if x <= 0:
            return None
        try:
            plan = compute_plan(model, "auto", {"cpu": x}, running, seq_len, torch.float32)
        except UserError:
            return None
        need = plan.resident.get("cpu", 0) + plan.working.get("cpu", 0)
        if need <= room:
            break
        x -= need - room
    else:
        return None
    stream = plan.working.get("cpu", 0)
    if "disk" not in plan.device_map.values():
        return None
    kv = sum(m.kv_bytes for m in plan.modules)
    held = plan.resident.get("cpu", 0) - kv
    on_disk = sum(m.param_bytes for m in plan.modules if m.device == "disk")
    name = f"fp32+disk({on_disk / 2**20:.0f}MiB)"
    return Format(name, model_dir, ["--dtype", "fp32", "--max-memory", f"cpu={x}"], held, held + stream, 4,
                  stream), kv


@functools.cache
def _fp32_meta_model(model_dir: str):
    """The model on the meta device, built once per directory: disk_offload tries several running counts."""
    import torch

    from serve.placement import meta_model

    return meta_model(model_dir, torch.float32)


def read_model_config(model_dir: str) -> dict:
    config = read_config(model_dir, "MODEL")
    return config | config.get("text_config", {}) if isinstance(config.get("text_config"), dict) else config
