"""`compress export MODEL -o OUT.gguf --format gguf [--type T]`: one GGUF file that llama.cpp and Ollama load.

Why: GGUF is what llama.cpp-based runtimes take; this writes memfit's output (or any plain HF dir of a supported
architecture) as one, keeping memfit's quantized weights where a GGUF block type holds them exactly.

Metadata, tensor names and transforms follow llama.cpp's convert_hf_to_gguf.py: llama/mistral -> "llama" (Q/K
rows permuted to llama.cpp's RoPE layout), qwen2 -> "qwen2", gemma3_text -> "gemma3" (RMSNorm weights stored as
1 + w, two RoPE bases, sliding window). Tokenizer metadata: gguf_vocab.py. Input is read with
compress.store.WeightSource; sparse (pruned) layers are written dense.

Types: f32 f16 bf16 q8_0 q4_0 q4_1, or auto (default). Mapping rule: a memfit weight W = (q - z) * s per row and
group of G input columns, G a multiple of 32, is copied into GGUF blocks of 32 without requantizing ("mapped")
where the block type holds its codes: Q4_0 (d = s, q - z + 8) for symmetric 2-4 bit, Q4_1 (d = s, m = -z*s
rounded to fp16, q) for any 2-4 bit, Q8_0 (d = s, q - z) for symmetric up to 8 bit and asymmetric up to 7 bit.
All are bit-exact except Q4_1's m for asymmetric groups (fp16 rounding). auto takes the first of Q4_0, Q4_1,
Q8_0 that holds a weight, else f16. Everything else is dequantized and quantized again by gguf.quants
("requantized"). As llama.cpp does: norms and 1-D tensors stay f32, rows not a multiple of 32 fall back to f16,
token_embd gets the chosen type, and at q4_0/q4_1 output.weight (or the tied token_embd), Q6_K in
llama-quantize, gets Q8_0, the nearest type gguf-py writes. The file is written beside OUT and renamed into place.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from compress import ctformat, sparse_store
from compress.gguf_vocab import add_vocab
from compress.quant import QuantArgs, Quantized
from compress.skeleton import hf_config
from compress.store import WeightSource
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, read_config

Q = gguf.GGMLQuantizationType
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}
TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
BLOCKS = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # auto's order: the smallest that holds a weight exactly
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
              Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}
QUANT_AUX = (".weight_scale", ".weight_shape", ".weight_zero_point")
SPARSE_AUX = (".weight.shape", ".weight.compressed", ".weight.row_offsets")
RULE = ("mapped: memfit codes copied into GGUF blocks of 32 unchanged (groups a multiple of 32; symmetric 2-4 bit "
        "-> Q4_0, 2-4 bit -> Q4_1, symmetric <= 8 / asymmetric <= 7 bit -> Q8_0); requantized: memfit codes "
        "dequantized, then quantized by gguf.quants; quantized/converted: from the float weights")


@dataclass
class Item:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # torch order
    qtype: Q
    how: str  # mapped, requantized, quantized, dequantized, converted
    data: Callable[[], np.ndarray]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a model dir as one GGUF file (llama.cpp, Ollama)",
                       description="Export a plain HF dir or memfit compress output (llama, mistral, qwen2, "
                       "gemma3_text) as one GGUF file. " + RULE + ".")
    p.add_argument("model", help="input model dir (plain HF safetensors or memfit compress output)")
    p.add_argument("-o", "--output", required=True, help="output file, *.gguf (refused if it exists, unless "
                   "--overwrite)")
    p.add_argument("--format", choices=["gguf"], default="gguf", help="output format (gguf, the only one)")
    p.add_argument("--type", choices=["auto", *TYPES], default="auto", help="tensor type: auto (default) keeps "
                   "memfit's codes where a GGUF block type holds them exactly, else f16")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_export)


def cmd_export(a: argparse.Namespace) -> int:
    s = export(Path(a.model), Path(a.output), a.type, a.overwrite)
    print(f"wrote {s['path']}: GGUF arch {s['arch']}, --type {s['type']} (file type {s['file_type']}), "
          f"{s['bytes'] / 2**20:.2f} MiB, {s['tensors']} tensors, tokenizer {s['vocab']}")
    print(f"  {'tensor class':<28} {'type':<5} {'how':<12} count")
    for (cls, qt, how), n in sorted(s["classes"].items()):
        print(f"  {cls:<28} {qt:<5} {how:<12} {n}")
    print(f"  ({RULE})")
    return 0


def check_paths(model: Path, out: Path, overwrite: bool) -> dict[str, Any]:
    """Bad input before any work: the model dir, its architecture, the output path. Returns config.json."""
    if out.suffix != ".gguf":
        raise UserError(f"--output {out}: a GGUF export is one file; give a path ending in .gguf")
    check_model_dir(model)
    cfg = read_config(model)
    mt = cfg.get("model_type")
    if mt not in ARCHS:
        raise UserError(f"{model}: model_type {mt!r} is not supported by the GGUF export (supported: "
                        f"{', '.join(ARCHS)})")
    if out.is_dir():
        raise UserError(f"--output {out} is a directory; give a .gguf file path")
    if out.exists() and not overwrite:
        raise UserError(f"--output {out} already exists (pass --overwrite to replace it)")
    return cfg


class Source:
    """The weights of a model dir by HF name: dense tensors, memfit's quantized ones, sparse ones densified."""

    def __init__(self, path: Path, cfg: dict[str, Any]) -> None:
        self.src = WeightSource(path)
        qc = cfg.get("quantization_config") or {}
        if qc and qc.get("quant_method") != "compressed-tensors":
            raise UserError(f"{path}: quantization method {qc.get('quant_method')!r} cannot be exported to GGUF "
                            "(memfit's compressed-tensors output and plain HF dirs can)")
        if (qc.get("memfit") or {}).get("lowrank"):
            raise UserError(f"{path}: low-rank layers (compress lowrank) have no GGUF form; export the model "
                            "before factorization, or a quantized/pruned one")
        packed = [k.removesuffix(".weight_packed") for k in self.src.keys() if k.endswith(".weight_packed")]
        self.qargs: dict[str, QuantArgs] = ctformat.parse_config(qc, packed) if packed else {}
        if set(packed) - set(self.qargs):
            raise UserError(f"{path}: quantization_config does not cover {sorted(set(packed) - set(self.qargs))[0]}")

    def names(self) -> list[str]:
        out = []
        for k in self.src.keys():
            mod = k.rsplit(".", 1)[0]
            if k.endswith(".weight_packed"):
                out.append(k.removesuffix("_packed"))
            elif k.endswith(".weight.bitmask"):
                out.append(k.removesuffix(".bitmask"))
            elif not (k.endswith(QUANT_AUX) and mod in self.qargs) and not k.endswith(SPARSE_AUX) \
                    and not k.endswith("rotary_emb.inv_freq"):
                out.append(k)
        return out

    def quantized(self, name: str) -> Quantized | None:
        mod = name.removesuffix(".weight")
        return ctformat.read_quantized(self.src.get, mod, self.qargs[mod]) if mod in self.qargs else None

    def args(self, name: str) -> QuantArgs | None:
        return self.qargs.get(name.removesuffix(".weight")) if name.endswith(".weight") else None

    def dense(self, name: str) -> torch.Tensor:
        q = self.quantized(name)
        if q is not None:
            return q.dequantize()
        if f"{name}.bitmask" in self.src:
            return sparse_store.read_sparse(self.src.get, name.removesuffix(".weight")).float()
        return self.src.get(name).float()

    def shape(self, name: str) -> tuple[int, ...]:
        mod = name.removesuffix(".weight")
        if mod in self.qargs:
            return tuple(int(v) for v in self.src.get(f"{name}_shape").tolist())
        if f"{name}.bitmask" in self.src:
            return tuple(int(v) for v in self.src.get(f"{name}.shape").tolist())
        return tuple(self.src.handles[self.src.key_file[name]].get_slice(name).get_shape())


def holds(a: QuantArgs, t: Q) -> bool:
    """Whether GGUF block type t holds memfit's codes of a exactly (the module docstring's mapping rule)."""
    if a.group_size % 32:
        return False
    if t == Q.Q4_0:
        return a.sym and a.bits <= 4
    if t == Q.Q4_1:
        return a.bits <= 4
    return t == Q.Q8_0 and a.bits <= (8 if a.sym else 7)


def choose(gname: str, shape: tuple[int, ...], req: str, a: QuantArgs | None, has_output: bool) -> tuple[Q, str]:
    """The GGUF type of one tensor and how it gets there."""
    if len(shape) == 1 or gname.endswith("_norm.weight"):
        return Q.F32, "dequantized" if a else "converted"
    if req == "auto":
        t = next((t for t in BLOCKS if a and holds(a, t)), Q.F16)
    else:
        t = TYPES[req]
        if t in (Q.Q4_0, Q.Q4_1) and (gname == "output.weight" or (gname == "token_embd.weight" and not has_output)):
            t = Q.Q8_0
    if t in BLOCKS and shape[-1] % 32:
        t = Q.F16
    if t in BLOCKS:
        return t, "mapped" if a and holds(a, t) else "requantized" if a else "quantized"
    return t, "dequantized" if a else "converted"


def pack(q: Quantized, t: Q) -> np.ndarray:
    """memfit's codes as GGUF blocks of 32 (holds(q, t) must be true): rows of [d fp16, (m fp16,) codes]."""
    rows, cols = q.codes.shape
    per = q.group_size // 32
    s = q.scale.float().repeat_interleave(per, 1).numpy()
    z = q.zero.to(torch.int16).repeat_interleave(per, 1).numpy()
    c = q.codes.numpy().astype(np.int16).reshape(rows, cols // 32, 32)
    head = [s.astype(np.float16)[..., None].view(np.uint8)]
    if t == Q.Q8_0:
        body = (c - z[..., None]).astype(np.int8).view(np.uint8)
    else:
        if t == Q.Q4_1:
            head.append((-z.astype(np.float32) * s).astype(np.float16)[..., None].view(np.uint8))
        c = (c - z[..., None] + 8) if t == Q.Q4_0 else c
        body = (c[..., :16] | (c[..., 16:] << 4)).astype(np.uint8)
    return np.concatenate([*head, body], axis=-1).reshape(rows, -1)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split RoPE rows to llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    full = dict(rp.get("full_attention", rp))
    if "rope_theta" not in full and cfg.get("rope_theta") is not None:
        full["rope_theta"] = cfg["rope_theta"]
    return full, (rp.get("sliding_attention") or {}).get("rope_theta")


def add_hparams(w: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], n_vocab: int) -> list[Item]:
    """The {arch}.* keys convert_hf_to_gguf.py writes; returns extra tensors (Llama 3 rope_freqs)."""
    n_head, hidden, layers = int(cfg["num_attention_heads"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    full, swa_theta = _rope(cfg)
    w.add_block_count(layers)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(n_head)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or n_head))
    extra: list[Item] = []
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    elif kind == "llama3" and arch == "llama":
        factors = _llama3_factors(full, head_dim)
        extra.append(Item("rope_freqs.weight", (len(factors),), Q.F32, "converted", lambda: factors))
    elif kind != "default":
        raise UserError(f"rope_type {kind!r} is not supported by the GGUF export (default, linear, llama3)")
    if full.get("rope_theta") is not None:
        w.add_rope_freq_base(float(full["rope_theta"]))
    if swa_theta is not None:
        w.add_rope_freq_base_swa(float(swa_theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps") or 1e-6))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        _gemma3(w, cfg, layers, hidden // n_head if layers == 62 else head_dim)
    return extra


def _gemma3(w: gguf.GGUFWriter, cfg: dict[str, Any], layers: int, llama_cpp_scalar: int) -> None:
    """Gemma 3's keys, and refusals where llama.cpp's gemma3 graph would compute something else than HF."""
    if cfg.get("attn_logit_softcapping") is not None or cfg.get("use_bidirectional_attention"):
        raise UserError("gemma3: attention logit softcapping / bidirectional attention are not in llama.cpp's gemma3")
    if int(cfg.get("query_pre_attn_scalar") or llama_cpp_scalar) != llama_cpp_scalar:
        raise UserError(f"gemma3: query_pre_attn_scalar {cfg['query_pre_attn_scalar']} differs from what llama.cpp "
                        f"uses for this size ({llama_cpp_scalar})")
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    types = list(cfg.get("layer_types") or [])
    swa = cfg.get("sliding_window") and cfg.get("sliding_window_pattern") != 1
    if swa and (not types or "sliding_attention" in types):  # all full attention: no window, as llama.cpp runs it
        want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        if types and types != want:
            raise UserError("gemma3: layer_types differ from llama.cpp's fixed pattern (5 sliding, 1 full)")
        w.add_sliding_window(int(cfg["sliding_window"]))


def _llama3_factors(rp: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for rope_type llama3."""
    base, factor = float(rp["rope_theta"]), float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    ctx = float(rp.get("original_max_position_embeddings", 8192))
    out = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        smooth = (ctx / wavelen - low) / (high - low)
        out.append(1.0 if wavelen < ctx / high else factor if wavelen > ctx / low else
                   1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def plan(src: Source, arch: str, cfg: dict[str, Any], req: str) -> list[Item]:
    """Every weight's GGUF name, type and producer, in input order."""
    layers, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    names = src.names()
    has_output = any(n.startswith("lm_head.") for n in names)
    items = []
    for name in names:
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise UserError(f"tensor {name} has no GGUF name in llama.cpp's {arch!r} architecture")
        heads = n_head if ".q_proj." in name else n_kv if ".k_proj." in name else 0
        heads = heads if arch == "llama" else 0
        shift = 1.0 if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        shape, a = src.shape(name), src.args(name)
        t, how = choose(gname, shape, req, a, has_output)
        items.append(Item(gname, shape, t, how, _producer(src, name, t, how, heads, shift)))
    return items


def _producer(src: Source, name: str, t: Q, how: str, heads: int, shift: float) -> Callable[[], np.ndarray]:
    def make() -> np.ndarray:
        if how == "mapped":
            q = src.quantized(name)
            assert q is not None
            if heads:
                q = replace(q, codes=_permute(q.codes, heads), scale=_permute(q.scale, heads),
                            zero=_permute(q.zero, heads))
            return pack(q, t)
        x = src.dense(name)
        x = _permute(x, heads) if heads else x
        return gguf.quants.quantize((x + shift if shift else x).numpy(), t)
    return make


def export(model: Path, out: Path, req: str = "auto", overwrite: bool = False) -> dict[str, Any]:
    """Write model as the GGUF file out; returns the summary (per tensor class: type, how, count)."""
    if req not in ("auto", *TYPES):
        raise UserError(f"--type {req!r}: one of auto, {', '.join(TYPES)}")
    raw = check_paths(model, out, overwrite)
    arch = ARCHS[raw["model_type"]]
    cfg = hf_config(str(model)).to_dict()
    n_vocab = int(cfg["vocab_size"])
    src = Source(model, raw)
    w = gguf.GGUFWriter(None, arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(model.resolve().name)
    extra = add_hparams(w, arch, cfg, n_vocab)
    items = plan(src, arch, cfg, req) + extra
    params: Counter[Q] = Counter()
    for i in items:  # the file type: the type of most layer weights
        params[i.qtype] += math.prod(i.shape) if i.name.startswith("blk.") and len(i.shape) == 2 else 0
    main = TYPES[req] if req in TYPES else max((t for t in params if t != Q.F32), key=params.__getitem__,
                                               default=Q.F16)
    w.add_file_type(FILE_TYPES[main])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = add_vocab(w, model, n_vocab)
    for i in items:
        block, size = gguf.GGML_QUANT_SIZES[i.qtype]
        w.add_tensor_info(i.name, i.shape, np.dtype(np.float32), math.prod(i.shape) // block * size, i.qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i in items:
            w.write_tensor_data(i.data())
        w.close()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    classes = Counter((i.name.split(".", 2)[2] if i.name.startswith("blk.") else i.name, i.qtype.name, i.how)
                      for i in items)
    return {"path": str(out), "arch": arch, "type": req, "file_type": FILE_TYPES[main].name,
            "bytes": out.stat().st_size, "tensors": len(items), "classes": dict(classes), "vocab": vocab}
