"""Load a model dir for serving: plain HF checkpoints (safetensors only) or ``compress`` outputs."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from memfit.defaults import max_positions
from memfit.defaults import max_seq_len as default_max_seq_len
from memfit.errors import UserError
from memfit.hf import load_pretrained, load_tokenizer, nf4_config
from memfit.modeldir import check_model_dir, read_config
from memfit.runtime.dense import drop_file_pages, file_maps
from memfit.runtime.embeddings import embed_scale, quant_embedding, quantize_vocab_int8
from memfit.runtime.qlinear import quant_linear

log = logging.getLogger("serve.loader")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# end-of-turn markers of common chat templates: generation stops at them like at EOS
_END_MARKERS = ("<|end|>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<end_of_turn>")


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    eos_ids: set[int]
    max_positions: int
    quantized: str | None  # how: "compress", "int8", "nf4" or None
    plan: object | None = None  # serve.placement.Plan when --device-map/--max-memory placed the model
    tp: int = 1  # tensor-parallel ranks the model is sharded over
    bf16_weights: bool = False  # the engine packs the Linears in bf16 on memfit's kernels (activations fp32)


def resolve_dtype(name: str, config: dict) -> torch.dtype:
    """The dtype of a model run by torch's ops (placed, tensor-parallel, NF4): auto is fp32, as bf16 and fp16
    matmuls on CPU are much slower than fp32 there."""
    if name in DTYPES:
        return DTYPES[name]
    return torch.float32


def bf16_weights(name: str, cpu_kernels: str) -> bool:
    """Whether ``--dtype name`` runs the Linears with bf16 weights on memfit's kernels (activations fp32): bf16
    wherever the kernels are built; auto where they are and the CPU has AVX512-BF16 (the kernels are built with
    -march=native, so their build says), else fp32. Half the bytes a decode step reads; twice the prefill FLOPS
    with vdpbf16ps (bench/bf16.py)."""
    if name not in ("bf16", "auto") or cpu_kernels == "off":
        return False
    from memfit.runtime import kernels

    ops = kernels.load(cpu_kernels)
    return ops is not None and (name == "bf16" or bool(ops.has_avx512_bf16()))


def _quantize(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """int8: quantize the decoder's Linear layers in place (lm_head and embeddings stay as they are); nf4 is
    applied while loading (``load``)."""
    layers = model.model.layers
    if method == "int8":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        from memfit.runtime.dense import drop_file_pages, file_maps

        maps = file_maps()
        for layer in layers:
            # layer by layer and in place, each layer's fp32 file pages given back once it is quantized: the
            # default (a deep copy of all layers) held Gemma 3 270M's fp32 Linears twice at the load's peak
            replaced = [m.weight.detach() for m in layer.modules() if type(m) is torch.nn.Linear]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # a scale per output row: torch's default, one per tensor, cost Gemma 3 270M a KL of 0.08 to
                # fp32 (top-1 agreement 0.73) on held-out text, its outlier rows setting every row's step
                quantize_dynamic(layer, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8,
                                 inplace=True)
            for w in replaced:
                drop_file_pages(w, maps)
        return model
    raise UserError(f"--quantize: unknown method {method!r} (nf4 or int8)")


def _eos_ids(model: torch.nn.Module, tok) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    special = set(getattr(tok, "all_special_tokens", []))
    for m in _END_MARKERS:  # token_to_id, not get_vocab(): a 262k-entry dict built at the load's peak
        if m in special and (i := tok.convert_tokens_to_ids(m)) is not None and i != tok.unk_token_id:
            ids.add(int(i))
    return ids


def _drop_replaced(weights: list[torch.Tensor], model: torch.nn.Module) -> None:
    """Give back the page-cache pages of loaded weights that quantizing replaced: read zero-copy from the
    safetensors file, they stay resident (clean copies of it) while the file's mapping lives. On Gemma 3 270M
    with --quantize int8 --quantize-embeddings int8 that was 1.1 GiB of the server's RSS."""
    if not weights:
        return
    live = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    maps = file_maps()
    for w in weights:
        if w.data_ptr() not in live:
            drop_file_pages(w.detach(), maps)


def quantize_vocab_int4(model: torch.nn.Module) -> dict[str, int]:
    """The lm_head as a 4-bit Linear (RTN, compress.quant.vocab_args' groups: the int4 kernels) and the input
    embedding as 4-bit rows (runtime.embeddings.GroupEmbedding), from the same codes when the two are tied (each
    keeps its own layout: two copies). Returns the bytes of the tables before and after."""
    from compress.quant import vocab_args
    from compress.rtn import rtn

    head, emb = getattr(model, "lm_head", None), model.get_input_embeddings()
    if type(head) is not torch.nn.Linear or not isinstance(emb, torch.nn.Embedding):
        raise ValueError("quantize_vocab_int4: the model has no plain nn.Linear lm_head and nn.Embedding input")
    tied = head.weight.data_ptr() == emb.weight.data_ptr()
    before = head.weight.numel() * head.weight.element_size() * (1 if tied else 2)
    args = vocab_args("int4", head.in_features)  # as `compress quantize --quantize-embeddings int4`
    q = rtn(head.weight.detach().float(), args)
    qe = q if tied else rtn(emb.weight.detach().float(), args)
    model.lm_head = quant_linear(q, None if head.bias is None else head.bias.detach().float())
    model.set_input_embeddings(quant_embedding(qe, embed_scale(emb)))
    model.config.tie_word_embeddings = False
    after = sum(t.numel() * t.element_size() for m in (model.lm_head, model.get_input_embeddings())
                for t in [*m.buffers(), *m.parameters()])
    return {"before_bytes": before, "after_bytes": after}


def load(path: str, dtype: str = "auto", quantize: str | None = None, placement=None, max_batch: int = 16,
         max_seq_len: int | None = None, tp: int = 1, quantize_embeddings: str | None = None,
         cpu_kernels: str = "off") -> Loaded:
    """``placement`` (serve.placement.Placement) spreads the model over devices/RAM/disk; ``tp`` > 1 shards
    it over the torchrun ranks with transformers' tp_plan="auto" (every rank calls this);
    ``quantize_embeddings``: the lm_head and input embedding as int8 rows (runtime.embeddings) or 4-bit
    (quantize_vocab_int4);
    ``cpu_kernels``: the mode the engine will load memfit's kernels in (``bf16_weights`` asks it)."""
    if quantize_embeddings not in (None, "int8", "int4"):
        raise UserError(f"--quantize-embeddings must be int8 or int4, got {quantize_embeddings!r}")
    if quantize_embeddings and (tp > 1 or placement is not None):
        raise UserError("--quantize-embeddings cannot be combined with --device-map/--max-memory/--tp")
    config = read_config(check_model_dir(path, "--model"), "--model")
    how = None
    compress_load = None
    if "quantization_config" in config:
        try:
            import compress

            compress_load = getattr(compress, "load", None)
        except ImportError:
            compress_load = None
    plan = None
    if tp > 1 or placement is not None:
        if quantize:
            raise UserError("--quantize cannot be combined with --device-map/--max-memory/--tp (quantize with "
                            "`compress quantize` first; compress outputs place like any model)")
        torch_dtype = resolve_dtype(dtype, config)
    if tp > 1:
        if compress_load is not None:
            raise UserError("--tp: compress outputs cannot be tensor-parallel (their packed Linears have no "
                            "tp_plan); serve the original checkpoint with --tp, or a compress output on one device")
        if placement is not None:
            raise UserError("--tp cannot be combined with --device-map/--max-memory")
        from transformers.distributed.configuration_utils import DistributedConfig

        model = load_pretrained(path, dtype=torch_dtype, distributed_config=DistributedConfig(tp_plan="auto"))
    elif placement is not None:
        from serve.placement import load_placed

        model, plan = load_placed(path, torch_dtype, placement.device_map, placement.max_memory,
                                  placement.offload_folder, max_batch, default_max_seq_len(config, max_seq_len),
                                  compressed=compress_load is not None, prefetch=placement.prefetch)
        how = "compress" if compress_load is not None else None
        from serve.placement import format_plan

        log.info("placement of %s:\n%s", path, format_plan(plan))
    elif compress_load is not None:
        try:
            model = compress_load(path, device="cpu")
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - surface as a user-facing load error
            raise UserError(f"--model: compress.load({path}) failed: {type(e).__name__}: {e}") from None
        how = "compress"
    elif quantize == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            raise UserError(f"--quantize nf4 needs bitsandbytes: {e}") from None
        torch_dtype = resolve_dtype(dtype, config)
        model = load_pretrained(path, dtype=torch_dtype, flag="--model", device_map={"": "cpu"},
                                quantization_config=nf4_config(torch_dtype, skip=["lm_head"]))
        how = "nf4"
    else:
        bf16 = bf16_weights(dtype, cpu_kernels)  # loaded in bf16 then: no fp32 copy of a bf16 checkpoint
        torch_dtype = torch.bfloat16 if bf16 else resolve_dtype(dtype, config)
        model = load_pretrained(path, dtype=torch_dtype, flag="--model")
        model = model.to(torch_dtype)
    model.eval()
    loaded_weights = list(model.parameters()) if quantize or quantize_embeddings else []
    if quantize and how != "nf4":
        if how == "compress":
            raise UserError("--quantize: the model is already quantized by compress")
        model = _quantize(model, quantize)
        how = quantize
        _drop_replaced(loaded_weights, model)  # now, not only at the end: the vocabulary's quantization peaks next
    if quantize_embeddings:
        try:
            sizes = quantize_vocab_int8(model) if quantize_embeddings == "int8" else quantize_vocab_int4(model)
        except ValueError as e:
            raise UserError(f"--quantize-embeddings: {e}") from None
        log.info("vocabulary tables as %s: %.1f -> %.1f MiB", quantize_embeddings, sizes["before_bytes"] / 2**20,
                 sizes["after_bytes"] / 2**20)
    _drop_replaced(loaded_weights, model)
    del loaded_weights  # a replaced table not read from a file (compress.load's fp32 upcast) is freed now
    tok = load_tokenizer(path, flag="--model")
    # compress outputs and --quantize int8 keep their quantized layers; their fp32 lm_head (and any fp32 Linear)
    # gets bf16 weights too
    bf16 = placement is None and tp == 1 and how != "nf4" and bf16_weights(dtype, cpu_kernels)
    return Loaded(model, tok, _eos_ids(model, tok), max_positions(model.config), how, plan, tp, bf16)
