"""HQQ (Half-Quadratic Quantization; calibration-free, so --calib is only read for peer.json) on CPU: each
decoder-layer Linear becomes HQQLinear(linear, BaseQuantizeConfig(nbits=B, group_size=G, axis=1),
compute_dtype=float16, device="cpu"): asymmetric per-group scale and zero (zero rounded at 4 bits, as its config
does), fitted by its proximal solver (lp_norm 0.7, 20 iterations, fp32 on CPU); scale/zero kept in float16, its
default compute_dtype. HQQLinear.dequantize() gives the weights written out. HQQ groups axis=1 as
W.reshape(-1, G): when in_features is not a multiple of G (it only needs numel % G == 0), groups run across rows.
packed_bytes: native, HQQLinear's own tensors (bit-packed W_q + scale + zero)."""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script. Not this dir on sys.path (hqq.py/llmcompressor.py would shadow those packages, which transformers
# probes for), but bench/, last, for quant_peer_runners._common.
sys.path.pop(0)
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
from quant_peer_runners._common import Timer, args, decoder_linears, load_calib, load_model, originals, version, write

COMPUTE_DTYPE = torch.float16


def main() -> None:
    a = args(__doc__ or "")
    model = load_model(a.model)
    n, seqlen = load_calib(a.calib).shape
    orig = originals(model)
    cfg = BaseQuantizeConfig(nbits=a.bits, group_size=a.group_size, axis=1)
    deq, packed = {}, 0
    with Timer() as t, torch.inference_mode():
        for name, linear in decoder_linears(model).items():
            q = HQQLinear(linear, cfg, del_orig=True, compute_dtype=COMPUTE_DTYPE, device="cpu")
            model.set_submodule(name, q)
            deq[name] = q.dequantize().reshape(orig[name].shape).float()
            packed += q.W_q.nbytes + q.meta["scale"].nbytes + q.meta["zero"].nbytes
    wq = cfg["weight_quant_params"]
    meta = {"peer": "hqq", "version": version("hqq"), "bits": a.bits, "group_size": a.group_size,
            "method": {"algorithm": "HQQ (calibration-free)", "sym": False, "axis": wq["axis"],
                       "optimize": wq["optimize"], "round_zero": wq["round_zero"],
                       "compute_dtype": str(COMPUTE_DTYPE), "packing": q.meta["packing"],
                       "solver": "optimize_weights_proximal (lp_norm 0.7, beta 10, kappa 1.01, 20 iters)"},
            "quant_seconds": t.seconds, "quant_peak_rss_bytes": t.peak_rss, "packed_bytes": packed,
            "packed_bytes_how": "native: HQQLinear W_q (bit-packed) + meta scale + zero (float16)",
            "calib_samples": n, "calib_seqlen": seqlen, "calib_used": False}
    write(a.model, a.out, orig, deq, meta, check_group=a.group_size)


if __name__ == "__main__":
    main()
