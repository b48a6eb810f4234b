"""The method registry: every compression method once, with its kind, whether it needs calibration and its
per-layer function.

The CLI (choices, defaults, what it loads), the recipe and the drivers read it; nothing else says which
method calibrates. A calibrated method gets a `calib.Calibration` (text files, a tokenizer, layer inputs);
an uncalibrated one gets none of those, so `rtn`, `magnitude` and `svd` run without calibration text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from compress import awq, gptq, lowrank, rtn, sparsegpt, wanda
from compress.calib import Calibration, calibration_files
from compress.layerjob import LayerJob
from memfit.defaults import CALIB_SAMPLES, CALIB_SEQLEN
from memfit.errors import UserError

Kind = Literal["quantize", "prune", "lowrank"]
LayerFn = Callable[[LayerJob], dict[str, Any]]


@dataclass(frozen=True)
class Method:
    """One compression method."""

    name: str
    """What --method, a recipe and the output's config.json call it."""
    kind: Kind
    """quantize (codes + scales), prune (zeros, sparse-bitmask) or lowrank (two Linears)."""
    calibrated: bool
    """Needs calibration text: layer inputs captured once, each layer fed the previous compressed outputs."""
    layer: LayerFn | None
    """Compresses one decoder layer's target Linears (walk.LayerWalk calls it); None: a whole-model method
    (bitsandbytes), not run layer by layer and not available in recipes."""
    summary: str
    """One line for --help."""
    listed: bool = True
    """Offered by --method and recipes; False for a variant the pipeline picks itself (sparse-gptq)."""
    after_prune: str | None = None
    """The method that replaces this one in a recipe step after a prune step (one that keeps the zeros)."""
    clip_search: bool = False
    """quantize: the per-group clipping search (compress/quant.py, --mse-clip) is on unless --no-mse-clip. On for
    gptq only, as measured on Gemma 3 270M at 4 bits (bench/results/quantize_peers.md): GPTQ's KL to fp32 falls
    0.115 -> 0.104 (its error feedback absorbs the clipped outliers) while RTN's rises 0.454 -> 0.484; awq
    searches its own clipping against the layer output."""

    def calibration(self, files: list[str] | None, samples: int = CALIB_SAMPLES, seqlen: int = CALIB_SEQLEN,
                    seed: int = 0) -> Calibration | None:
        """The calibration this method runs with: None when it needs none (no files looked up), else --calib
        FILES or the default corpus (a UserError naming the method when neither exists)."""
        if not self.calibrated:
            return None
        return Calibration(tuple(calibration_files(f"method {self.name}", files)), samples, seqlen, seed)


_ALL = (
    Method("rtn", "quantize", False, rtn.quantize_layer, "round to nearest, per group"),
    Method("gptq", "quantize", True, gptq.quantize_layer, "second-order error feedback (Frantar et al.)",
           after_prune="sparse-gptq", clip_search=True),
    Method("awq", "quantize", True, awq.quantize_layer, "activation-aware scales and clipping, then RTN"),
    Method("sparse-gptq", "quantize", True, sparsegpt.quantize_layer, "GPTQ that keeps the pruning mask",
           listed=False),
    Method("nf4", "quantize", False, None, "bitsandbytes NF4 (4 bits)"),
    Method("int8", "quantize", False, None, "bitsandbytes LLM.int8 (8 bits)"),
    Method("magnitude", "prune", False, wanda.magnitude_layer, "smallest |W|"),
    Method("wanda", "prune", True, wanda.wanda_layer, "smallest |W| * ||X||, per row"),
    Method("sparsegpt", "prune", True, sparsegpt.prune_layer, "OBS weight updates (Frantar & Alistarh)"),
    Method("svd", "lowrank", False, lowrank.factorize_layer, "truncated SVD of W"),
    Method("svd-llm", "lowrank", True, lowrank.factorize_layer, "SVD of W whitened by the inputs"),
    Method("asvd", "lowrank", True, lowrank.factorize_layer, "SVD of W scaled by mean |x| per input"),
)
METHODS: dict[str, Method] = {m.name: m for m in _ALL}

# Best measured quantize method per width on models/shakespeare-llama (bench/results/quantize.md).
DEFAULT_QUANTIZE = {2: "gptq", 3: "gptq", 4: "gptq", 8: "rtn"}
DEFAULT = {"prune": "sparsegpt", "lowrank": "svd-llm"}


def names(kind: Kind, layerwise: bool = False) -> tuple[str, ...]:
    """The listed methods of a kind (layerwise: only those the layer walk runs, as recipes need)."""
    return tuple(m.name for m in METHODS.values() if m.kind == kind and m.listed
                 and (m.layer is not None or not layerwise))


def default(kind: Kind, bits: int = 4) -> str:
    """The method used when none is named (quantize: per width)."""
    return DEFAULT_QUANTIZE[bits] if kind == "quantize" else DEFAULT[kind]


def get(name: str, kind: Kind, flag: str = "--method") -> Method:
    """The registered method `name` of `kind`; a UserError naming `flag` otherwise."""
    m = METHODS.get(name)
    if m is None or m.kind != kind:
        raise UserError(f"{flag}: {name!r} is not a {kind} method (one of {', '.join(names(kind))})")
    return m
