"""bitsandbytes NF4 (calibration-free; runs in .venv, which has bitsandbytes): the model is loaded again with
transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
bnb_4bit_compute_dtype=float32, llm_int8_skip_modules=["lm_head"]) on CPU, which turns every Linear but lm_head
into a Linear4bit; each decoder-layer one is dequantized with bitsandbytes.functional.dequantize_4bit. NF4 is
4-bit only, and its block size is bnb's own (BitsAndBytesConfig has no knob: 64 consecutive weights, absmax
scaling, fp32 absmax): --group-size is recorded as requested_group_size and group_size is the block size used.
quant_seconds: the quantizing from_pretrained (reading the file included). packed_bytes: native, the
Params4bit data (2 weights a byte) + its quant_state's absmax + NF4 code table."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

# Run as a script. Not this dir on sys.path (hqq.py/llmcompressor.py would shadow those packages, which transformers
# probes for), but bench/, last, for quant_peer_runners._common.
sys.path.pop(0)
sys.path.append(str(Path(__file__).resolve().parents[1]))

import bitsandbytes.functional as F
import torch
from quant_peer_runners._common import Timer, args, decoder_linears, load_calib, load_model, originals, version, write
from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def main() -> None:
    a = args(__doc__ or "")
    if a.bits != 4:
        raise SystemExit(f"bnb NF4 is 4-bit only (asked for {a.bits} bits)")
    n, seqlen = load_calib(a.calib).shape
    orig = originals(load_model(a.model))
    gc.collect()
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                             bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=["lm_head"])
    with Timer() as t:
        model = AutoModelForCausalLM.from_pretrained(a.model, quantization_config=cfg, dtype=torch.float32,
                                                     device_map="cpu", use_safetensors=True, trust_remote_code=False)
    deq, packed, blocksizes = {}, 0, set()
    for name, m in decoder_linears(model).items():
        qs = m.weight.quant_state
        deq[name] = F.dequantize_4bit(m.weight.data, qs).reshape(orig[name].shape).float()
        packed += m.weight.data.nbytes + qs.absmax.nbytes + qs.code.nbytes
        blocksizes.add(qs.blocksize)
    (blocksize,) = blocksizes
    meta = {"peer": "bnb", "version": version("bitsandbytes"), "bits": 4, "group_size": blocksize,
            "requested_group_size": a.group_size,
            "method": {"algorithm": "NF4 round-to-nearest (calibration-free)", "sym": "absmax (NF4 code table)",
                       "quant_type": "nf4", "double_quant": False, "blocksize": blocksize,
                       "via": "transformers BitsAndBytesConfig(load_in_4bit) on CPU; dequantize_4bit"},
            "quant_seconds": t.seconds, "quant_peak_rss_bytes": t.peak_rss, "packed_bytes": packed,
            "packed_bytes_how": "native: Params4bit uint8 data + quant_state absmax (fp32) + code",
            "calib_samples": n, "calib_seqlen": seqlen, "calib_used": False}
    write(a.model, a.out, orig, deq, meta, check_group=blocksize)


if __name__ == "__main__":
    main()
