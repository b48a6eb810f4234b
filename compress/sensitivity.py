"""How much each module costs when quantized alone: the loss a size budget (budget.py) minimises.

For each candidate module and width, the fp32 model's next-token distribution is compared with the same model
whose ONE module has its weight replaced by the RTN dequantization at that width (restored afterwards): the mean
per-token KL(fp32 || quantized) over a small calibration subset (`--sensitivity-tokens`: the first sequences of
the usual calibration draw with the same seed, so evaluation text stays out of it). Decoder-layer Linears are
measured at 2, 3 and 4 bits; their 8-bit KL is estimated from the 4-bit one by the quantization-noise law (the
noise power, and so to first order the KL, scales as 4^-bits: KL8 = KL4 / 256); an untied lm_head is measured at
4 and 8 bits; fp16 costs 0.

Cost: one forward per (module, width, sequence). The decoder layers before the perturbed module's layer replay
their recorded fp32 outputs, so only the layers from it onward (and the lm_head) run. Logits are computed one
sequence at a time and the KL in token chunks, so a 262k vocabulary needs about two sequences' logits, not all.
A measurement can be saved as JSON (`--sensitivity FILE`) and is reused when its key matches (the config's hash,
group size, symmetry, tokens, sequence length, seed), so a second budget costs no measurement.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm
from transformers.pytorch_utils import Conv1D

from compress.quant import QuantArgs
from compress.rtn import rtn
from compress.skeleton import decoder_layers
from memfit.errors import UserError
from memfit.hf import load_pretrained

LINEAR_MEASURED = (2, 3, 4)  # decoder-layer Linears; 8 bits from the noise law
TABLE_MEASURED = (4, 8)  # an untied lm_head (and any other Linear outside the decoder layers)
KL_CHUNK = 128  # tokens per log-softmax in the KL sum
FORMAT = 1

Sensitivity = dict[str, dict[int, float]]  # module name -> bits -> mean per-token KL


def with_estimates(kl: Sensitivity) -> Sensitivity:
    """Adds the 8-bit estimate KL4 / 256 where only 2, 3 and 4 bits were measured."""
    return {n: {**v, 8: v[8] if 8 in v else v[4] / 256.0} for n, v in kl.items()}


def cache_key(model_dir: str, group_size: int, sym: bool, tokens: int, seqlen: int, seed: int) -> dict[str, Any]:
    cfg = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()
    return {"format": FORMAT, "config_sha256": cfg, "group_size": group_size, "symmetric": sym, "tokens": tokens,
            "seqlen": seqlen, "seed": seed}


def load_cached(path: Path, key: dict[str, Any], names: list[str]) -> Sensitivity | None:
    """The saved measurement if `path` holds one for this key and every module; None (with a note) otherwise."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        kl = {n: {int(b): float(v) for b, v in per.items()} for n, per in data["kl"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--sensitivity: cannot read {path} ({e})") from None
    differs = [k for k in key if data.get("key", {}).get(k) != key[k]]
    if differs or any(n not in kl for n in names):
        why = f"{', '.join(differs)} differ" if differs else "modules are missing"
        print(f"note: --sensitivity {path}: {why}; measuring again", file=sys.stderr)
        return None
    print(f"sensitivity: reusing {path}", file=sys.stderr)
    return kl


def save(path: Path, key: dict[str, Any], kl: Sensitivity) -> None:
    """Written to a temp file and renamed: never a half-written JSON."""
    tmp = path.with_name(path.name + ".tmp")
    data = {"key": key, "kl": {n: {str(b): v for b, v in sorted(per.items())} for n, per in kl.items()}}
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


class _Replay(nn.Module):
    """Stands in for a decoder layer before the perturbed one: returns that layer's recorded fp32 output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _kl_sum(ref_lp: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over tokens of KL(ref || logits), in chunks of KL_CHUNK tokens (ref_lp: log-probs, [T, V])."""
    total = 0.0
    for c in range(0, ref_lp.shape[0], KL_CHUNK):
        lq = torch.log_softmax(logits[c : c + KL_CHUNK].float(), -1)
        total += float(nn.functional.kl_div(lq, ref_lp[c : c + KL_CHUNK], reduction="sum", log_target=True))
    return total


@torch.no_grad()
def measure(model_dir: str, plan: dict[str, list[QuantArgs]], tokens: torch.Tensor, trust_remote_code: bool = False,
            progress: bool = True) -> Sensitivity:
    """Mean per-token KL(fp32 || model with module n RTN-quantized by args) for every n and args in plan.

    tokens: (sequences, seqlen). Returns module name -> bits -> KL."""
    model = load_pretrained(model_dir, trust_remote_code=trust_remote_code).eval()
    layers_name, layers = decoder_layers(model, model.config)
    real = list(layers)

    def layer_of(name: str) -> int:  # modules outside the decoder layers run after all of them
        if not name.startswith(layers_name + "."):
            return len(real)
        return int(name[len(layers_name) + 1 :].split(".")[0])

    order = sorted(plan, key=lambda n: (layer_of(n), n))
    sums: dict[str, dict[int, float]] = {n: {a.bits: 0.0 for a in plan[n]} for n in plan}
    bar = tqdm(total=tokens.shape[0] * sum(len(v) for v in plan.values()), desc="sensitivity", unit="fwd",
               disable=not progress)
    for seq in tokens:
        ids = seq[None]
        outputs: list[Any] = []
        hooks = [layer.register_forward_hook(lambda _m, _a, out, rec=outputs: rec.append(out)) for layer in real]
        try:
            ref_lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
        finally:
            for h in hooks:
                h.remove()
        try:
            for name in order:
                i = layer_of(name)
                for j in range(len(real)):
                    layers[j] = _Replay(outputs[j]) if j < i else real[j]
                mod = model.get_submodule(name)
                w = mod.weight.data
                conv = isinstance(mod, Conv1D)  # gpt2: [in, out], quantized as the Linear it is (groups along in)
                try:
                    for a in plan[name]:
                        mod.weight.data = rtn(w.t(), a).dequantize().t() if conv else rtn(w, a).dequantize()
                        sums[name][a.bits] += _kl_sum(ref_lp, model(input_ids=ids, use_cache=False).logits[0])
                        bar.update()
                finally:
                    mod.weight.data = w
        finally:
            for j, layer in enumerate(real):
                layers[j] = layer
        del ref_lp, outputs
    bar.close()
    return {n: {b: s / tokens.numel() for b, s in per.items()} for n, per in sums.items()}
