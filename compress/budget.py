"""`compress quantize --max-size SIZE | --target-bits B`: per-module bit widths that fit a size budget with the
least measured loss (issue 24).

Sizes are exact, not estimated: ctformat.stored_bytes per quantized weight (packed codes, fp16 scales, zero
points, the shape pair) and 2 bytes per element of everything stored in fp16, so the predicted total is the
output's tensor bytes (its safetensors header aside). Choices: every decoder-layer Linear at 2, 3, 4 or 8 bits
(at --group-size with its usual fallback) or fp16; an untied lm_head at 4 or 8 bits or fp16. A tied lm_head
stays tied to the fp16 embedding: quantizing it would store a second table next to it. The input embedding is
never quantized: plain transformers (5.x with compressed-tensors 0.20) cannot load a pack-quantized
nn.Embedding (its weight init reads `embedding.weight`, which the compressed layout removes).

Loss: sensitivity.py's per-module KLs, taken as additive. Allocation is a multiple-choice knapsack solved
greedily on each module's lower convex hull of (bytes, KL): every module starts at its smallest option; the hull
steps of all modules, sorted by KL saved per extra byte, form one upgrade sequence that does not depend on the
budget, and a budget takes the longest prefix of it that fits. So every module's size is non-decreasing in the
budget, and the smallest achievable size (every module at its smallest option) is known before any measurement.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress import calib, ctformat, sensitivity
from compress.evaluate import format_table
from compress.quant import QuantArgs, resolve_group_size
from compress.skeleton import conv1d_as_linear, decoder_layers, hf_config, meta_model
from compress.walk import skipped
from memfit.errors import UserError
from memfit.hf import load_tokenizer
from memfit.modeldir import read_config

FP16 = 16  # a module kept in fp16
LINEAR_BITS = (2, 3, 4, 8)
TABLE_BITS = (4, 8)
SENSITIVITY_TOKENS = 512  # one 512-token sequence: 378 forwards, 10 min for Gemma 3 270M on 2 cores
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "--max-size") -> int:
    """Bytes from '123456', '500MB', '80MiB', '1.5GiB' (decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{flag}: cannot read {text!r} as a size (a positive number of bytes, or with a unit: "
                        "500MB, 80MiB, 1.5GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Choice:
    bits: int  # FP16: kept in fp16
    nbytes: int  # what the weight costs in the output file
    kl: float = 0.0  # measured (or estimated) loss of this choice alone


@dataclass
class Candidate:
    """A module the budget chooses a width for."""

    name: str
    shape: tuple[int, int]  # (out, in)
    args: dict[int, QuantArgs]  # bits -> its QuantArgs (group size resolved)
    table: bool  # outside the decoder layers (lm_head)

    def choices(self, kl: dict[int, float] | None = None) -> list[Choice]:
        out, cols = self.shape
        return [*(Choice(b, ctformat.stored_bytes(out, cols, a), (kl or {}).get(b, 0.0)) for b, a in self.args.items()),
                Choice(FP16, out * cols * 2)]


@dataclass
class Model:
    candidates: list[Candidate]
    fixed_bytes: int  # everything stored in fp16 whatever the budget (norms, biases, embeddings, skipped Linears)
    params: int  # every stored parameter once (a tied table once): --target-bits' denominator
    tied_head: str | None  # the Linear tied to the input embedding (lm_head): it stays so, in fp16

    def smallest(self) -> int:
        return self.fixed_bytes + sum(min(c.nbytes for c in m.choices()) for m in self.candidates)


def candidates(model_dir: str, skip: list[str], group_size: int, sym: bool, fallback: bool,
               trust_remote_code: bool = False) -> Model:
    """The modules a budget chooses for and the fixed bytes, from the config alone (a meta model)."""
    if read_config(Path(model_dir)).get("quantization_config"):
        raise UserError(f"{model_dir} is already compressed: start from a dense model")
    config = hf_config(model_dir, trust_remote_code)
    model = meta_model(config, trust_remote_code)
    layers_name, layers = decoder_layers(model, config)
    conv1d_as_linear(model, config)
    emb = getattr(model.get_input_embeddings(), "weight", None)
    tied = next((n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight is emb), None)
    cands: list[Candidate] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or skipped(name, skip) or name == tied:
            continue
        table = not name.startswith(layers_name + ".")
        widths = TABLE_BITS if table else LINEAR_BITS
        g, _ = resolve_group_size(name, m.in_features, group_size, fallback)  # noted once more by quantize
        cands.append(Candidate(name, (m.out_features, m.in_features), {b: QuantArgs(b, g, sym) for b in widths},
                               table))
    chosen = {c.name + ".weight" for c in cands}
    params = list(model.named_parameters())  # each parameter once: a tied table is one entry
    fixed = sum(p.numel() * 2 for n, p in params if n not in chosen)
    return Model(cands, fixed, sum(p.numel() for _n, p in params), tied)


def _hull(choices: list[Choice]) -> list[Choice]:
    """The lower convex hull of (bytes, KL) from the smallest choice on: KL strictly falls, and the KL saved
    per extra byte falls from step to step."""
    kept: list[Choice] = []
    for c in sorted(choices, key=lambda c: (c.nbytes, c.kl)):
        if kept and c.kl >= kept[-1].kl:
            continue
        while len(kept) >= 2:
            a, b = kept[-2], kept[-1]
            if (a.kl - b.kl) * (c.nbytes - b.nbytes) > (b.kl - c.kl) * (b.nbytes - a.nbytes):
                break
            kept.pop()
        kept.append(c)
    return kept


@dataclass
class Allocation:
    choice: dict[str, Choice]  # module name -> its choice
    budget: int
    predicted_bytes: int
    kl: float


def allocate(model: Model, kl: sensitivity.Sensitivity, budget: int) -> Allocation:
    """The longest prefix of the budget-independent upgrade sequence that fits `budget` (see the module doc)."""
    hulls = [_hull(c.choices(kl[c.name])) for c in model.candidates]
    at = [0] * len(hulls)
    total = model.fixed_bytes + sum(h[0].nbytes for h in hulls)
    if budget < total:
        raise UserError(f"budget {mib(budget)} is below the smallest achievable size {mib(total)}")
    steps = sorted((-(h[k].kl - h[k + 1].kl) / (h[k + 1].nbytes - h[k].nbytes), i, k)
                   for i, h in enumerate(hulls) for k in range(len(h) - 1))
    for _rate, i, k in steps:
        extra = hulls[i][k + 1].nbytes - hulls[i][k].nbytes
        if total + extra > budget:
            break
        at[i], total = k + 1, total + extra
    choice = {c.name: h[j] for c, h, j in zip(model.candidates, hulls, at, strict=True)}
    return Allocation(choice, budget, total, sum(c.kl for c in choice.values()))


def format_allocation(model: Model, alloc: Allocation) -> str:
    """Linears per width and module kind (q_proj, ..., lm_head), then the predicted size and loss."""
    cols = [f"{b}-bit" for b in LINEAR_BITS] + ["fp16"]
    counts: dict[str, Counter[str]] = {}
    for c in model.candidates:
        b = alloc.choice[c.name].bits
        counts.setdefault(c.name.rsplit(".", 1)[-1], Counter())["fp16" if b == FP16 else f"{b}-bit"] += 1
    rows = [{"module": k, **{col: n.get(col, 0) for col in cols}} for k, n in counts.items()]
    lines = [format_table(rows, ["module", *cols])]
    if model.tied_head:
        lines.append(f"{model.tied_head}: tied to the fp16 input embedding (kept)")
    lines.append(f"predicted size {mib(alloc.predicted_bytes)} ({alloc.predicted_bytes:,} bytes of tensors) for a "
                 f"budget of {mib(alloc.budget)}; predicted KL sum {alloc.kl:.4g}")
    return "\n".join(lines)


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("size budget", "choose each Linear's width (and lm_head's) to fit a file size with "
                             "the least measured loss; --bits then cannot be given, --skip defaults to none")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--max-size", default=None, metavar="SIZE", help="largest output (tensor bytes): 123456, "
                   "500MB, 80MiB, 1.5GiB")
    x.add_argument("--target-bits", type=float, default=None, metavar="B", help="budget of B/8 bytes per "
                   "parameter of the input model, each stored parameter counted once (every Linear weight and "
                   "bias, embedding and norm; a tied lm_head once)")
    g.add_argument("--sensitivity", default=None, metavar="FILE.json", help="save the measured sensitivities "
                   "there, or reuse them when the file matches this model and setup")
    g.add_argument("--sensitivity-tokens", type=int, default=SENSITIVITY_TOKENS, help="calibration tokens for "
                   f"the sensitivity measurement (default {SENSITIVITY_TOKENS}): the first sequences of the "
                   "calibration draw, rounded up to whole --calib-seqlen sequences")


def _tokens(a: argparse.Namespace) -> torch.Tensor:
    files = calib.calibration_files("a size budget (its sensitivity measurement)", a.calib)
    n, seqlen = a.sensitivity_tokens, a.calib_seqlen
    tok = load_tokenizer(a.model, a.trust_remote_code)
    return calib.calibration_tokens(tok, files, a.calib_samples, seqlen, a.seed)[: math.ceil(n / seqlen), :n]


def plan(a: argparse.Namespace, skip: list[str]) -> tuple[dict[str, int], list[str], dict[str, Any]]:
    """For `compress quantize` with a budget: (bits per quantized module, the skip list (fp16 Linears added),
    the record for the output's config). Refuses a budget below the smallest size before any measurement."""
    calib.check_sizes(a.calib_samples, a.calib_seqlen)
    if not 2 <= a.sensitivity_tokens <= a.calib_samples * a.calib_seqlen:
        raise UserError(f"--sensitivity-tokens must be in [2, --calib-samples x --calib-seqlen = "
                        f"{a.calib_samples * a.calib_seqlen}], got {a.sensitivity_tokens}")
    if a.target_bits is not None and not a.target_bits > 0:
        raise UserError(f"--target-bits must be > 0, got {a.target_bits}")
    max_size = parse_size(a.max_size) if a.target_bits is None else 0
    model = candidates(a.model, skip, a.group_size, bool(a.sym), not a.no_group_fallback, a.trust_remote_code)
    if a.target_bits is not None:
        budget, flag = int(model.params * a.target_bits / 8), f"--target-bits {a.target_bits:g}"
    else:
        budget, flag = max_size, f"--max-size {a.max_size}"
    low = model.smallest()
    if budget < low:
        tables = [c.name for c in model.candidates if c.table]
        how = ["every decoder-layer Linear at 2 bits", *([f"{', '.join(tables)} at 4 bits"] if tables else []),
               *([f"{model.tied_head} tied to the fp16 embedding"] if model.tied_head else []), "the rest in fp16"]
        raise UserError(f"{flag} ({mib(budget)}) is below the smallest achievable size, {mib(low)} ({low:,} bytes, "
                        f"{8 * low / model.params:.2f} bits per parameter: {', '.join(how)})")
    kl = _sensitivities(a, model)
    alloc = allocate(model, kl, budget)
    print(format_allocation(model, alloc))
    bits = {n: c.bits for n, c in alloc.choice.items() if c.bits != FP16}
    if not bits:
        raise UserError(f"{flag} fits the model with every Linear in fp16: nothing to quantize")
    record = {"bits": "mixed", "budget": {
        "max_bytes": budget, "predicted_bytes": alloc.predicted_bytes, "predicted_kl": alloc.kl,
        "sensitivity_tokens": a.sensitivity_tokens, "bits": {n: c.bits for n, c in sorted(alloc.choice.items())}}}
    keep = [n for n, c in alloc.choice.items() if c.bits == FP16]
    return bits, [*skip, *keep, *([model.tied_head] if model.tied_head else [])], record


def _sensitivities(a: argparse.Namespace, model: Model) -> sensitivity.Sensitivity:
    names = [c.name for c in model.candidates]
    key = sensitivity.cache_key(a.model, a.group_size, bool(a.sym), a.sensitivity_tokens, a.calib_seqlen, a.seed)
    path = Path(a.sensitivity) if a.sensitivity else None
    kl = sensitivity.load_cached(path, key, names) if path else None
    if kl is None:
        measured = {c.name: [c.args[b] for b in (sensitivity.TABLE_MEASURED if c.table else
                                                 sensitivity.LINEAR_MEASURED)] for c in model.candidates}
        kl = sensitivity.measure(a.model, measured, _tokens(a), a.trust_remote_code)
        if path:
            sensitivity.save(path, key, kl)
            print(f"sensitivity: saved to {path}", file=sys.stderr)
    return sensitivity.with_estimates(kl)
