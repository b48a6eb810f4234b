"""`compress quantize` (and a recipe's quantize step): the layer walk with a quantize method, stored as
compressed-tensors pack-quantized codes (ctformat.py). Linears outside the decoder layers that are not
skipped (lm_head with --skip '') get RTN after the walk; a tied lm_head is then untied. With
--quantize-embeddings the input embedding and lm_head are stored quantized too (vocab_args).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress import ctformat, methods, rtn
from compress.calib import Calibration
from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized, resolve_group_size, vocab_args
from compress.walk import LayerWalk
from memfit.defaults import GROUP_SIZE
from memfit.errors import UserError


@dataclass
class QuantizeOptions:
    """How a model is quantized: one field per `compress quantize` flag."""

    bits: int
    """Bits per weight (quant.SUPPORTED_BITS)."""
    method: str
    """A layer-by-layer quantize method of the registry (methods.py): rtn, gptq, awq or sparse-gptq."""
    group_size: int = GROUP_SIZE
    """Input columns per scale; layers it does not divide get the largest divisor (see group_fallback)."""
    sym: bool = False
    """Symmetric codes (no zero points)."""
    calibration: Calibration | None = None
    """Calibration text, for the methods that need it (methods.Method.calibration builds it)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names/patterns kept in fp16."""
    act_order: bool = True
    """gptq: quantize columns by decreasing Hessian diagonal (static groups: no format change), as llm-compressor
    and GPTQModel do by default; on Gemma 3 270M at 4 bits it cuts GPTQ's KL to fp32 from 0.149 to 0.114
    (bench/results/quantize_peers.md)."""
    mse: bool | None = None
    """Per group, shrink the range to the clipping that minimises the weight error (every method); None: the
    method's default (methods.Method.clip_search)."""
    group_fallback: bool = True
    """False: refuse layers the group size does not divide instead of falling back."""
    trust_remote_code: bool = False
    """Allow model code from the model dir."""
    progress: bool = True
    """A tqdm bar per layer."""
    bits_per_module: dict[str, int] | None = None
    """Bits per module name, overriding `bits` (a size budget's allocation, budget.py); others get `bits`."""
    record: dict[str, Any] | None = None
    """Entries added to (or replacing) the output's memfit record, e.g. a size budget's allocation."""
    embeddings: str | None = None
    """"int8" / "int4": the input embedding and lm_head quantized too (RTN, untied where tied; vocab_args says
    how). The output then loads with memfit (compress.load, serve), not with transformers 5's own loader,
    which reads a quantized nn.Embedding's ``.weight`` in ``_init_weights``."""


def _targets(walk: LayerWalk, opt: QuantizeOptions, mse: bool) -> tuple[dict[str, QuantArgs], dict[str, str]]:
    """QuantArgs per target module (group size resolved), and the fallback notes (printed once per kind)."""
    targets: dict[str, QuantArgs] = {}
    notes: dict[str, str] = {}
    for name, m in walk.linears.items():
        if name not in walk.targets and name not in walk.outer:
            continue
        g, note = resolve_group_size(name, m.in_features, opt.group_size, opt.group_fallback)
        targets[name] = QuantArgs((opt.bits_per_module or {}).get(name, opt.bits), g, opt.sym, mse)
        if note:
            notes[name] = note
    head = walk.model.get_output_embeddings()
    if opt.embeddings and not any(m is head for m in walk.outer.values()):
        raise UserError("--quantize-embeddings quantizes lm_head too: drop it from --skip")
    for name, m in walk.outer.items():
        if opt.embeddings and m is head:
            targets[name] = vocab_args(opt.embeddings, m.in_features)
            notes.pop(name, None)
    kinds: dict[str, str] = {}
    for name, note in notes.items():
        kinds.setdefault(name.split(".")[-1], note)
    for kind, note in kinds.items():
        n = sum(1 for k in notes if k.endswith("." + kind) or k == kind)
        print(f"note: {note} ({n} layer(s) named *{kind})", file=sys.stderr)
    return targets, notes


def quantize_model(model_dir: str, out: Path, opt: QuantizeOptions) -> dict[str, Any]:
    """Quantize model_dir into out (written atomically). Returns a summary dict."""
    t0 = time.time()
    method = methods.get(opt.method, "quantize")
    walk = LayerWalk(model_dir, opt.skip, opt.trust_remote_code, outer=True)
    mse = method.clip_search if opt.mse is None else opt.mse
    targets, notes = _targets(walk, opt, mse)
    walk.calibrate(method, opt.calibration)
    quantized: list[str] = []

    def store(job: LayerJob, results: dict[str, Quantized]) -> None:
        for n, q in results.items():
            job.linears[n].weight.data = q.dequantize()
            walk.tensors.update(ctformat.tensors_for(job.prefix + n, q))
            walk.handled.add(f"{job.prefix}{n}.weight")
            quantized.append(job.prefix + n)

    awq_record: dict[str, set[str]] = {}  # awq: the folds made and the groups left unscaled (awqfold.py)
    walk.run(method, store, {"act_order": opt.act_order, "awq_record": awq_record}, targets,
             f"{opt.method} {'mixed' if opt.bits_per_module else opt.bits}-bit", opt.progress)
    for note in sorted(awq_record.get("not_scaled", ())):
        print(f"note: awq: {note}: searched clipping + RTN only", file=sys.stderr)
    untie = False
    for name, m in walk.outer.items():  # lm_head etc.: RTN
        walk.tensors.update(ctformat.tensors_for(name, rtn.rtn(m.weight.data, targets[name])))
        walk.handled.add(f"{name}.weight")
        quantized.append(name)
        untie = untie or (walk.tied and name.startswith("lm_head"))
    if opt.embeddings:
        emb = walk.model.get_input_embeddings()
        name = next(n for n, m in walk.model.named_modules() if m is emb)
        targets[name] = vocab_args(opt.embeddings, emb.embedding_dim)
        walk.tensors.update(ctformat.tensors_for(name, rtn.rtn(emb.weight.data, targets[name])))
        walk.handled.add(f"{name}.weight")
        quantized.append(name)
    c = opt.calibration
    memfit = {"method": opt.method, "bits": opt.bits, "group_size": opt.group_size, "symmetric": opt.sym,
              "act_order": opt.act_order, "mse_clip": mse, "skipped": walk.skipped,
              "group_size_fallbacks": {n: targets[n].group_size for n in notes},
              "calibration": {"files": len(c.files), "samples": c.samples, "seqlen": c.seqlen}
              if method.calibrated and c else None,
              **({"embeddings": opt.embeddings} if opt.embeddings else {}), **(opt.record or {})}
    if awq_record:
        memfit["awq"] = {k: sorted(v) for k, v in sorted(awq_record.items())}
    qc = ctformat.quantization_config({n: targets[n] for n in quantized}, memfit)
    walk.write(out, qc, {"tie_word_embeddings": False} if untie else None)
    return {"quantized": len(quantized), "skipped": walk.skipped, "seconds": time.time() - t0,
            "fallbacks": memfit["group_size_fallbacks"]}
