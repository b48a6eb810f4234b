"""llm-compressor GPTQ oneshot (W4A16 preset at 4 bits / group 128, else the same scheme with num_bits/group_size
changed): int, symmetric, per-group scales, GPTQ defaults (block_size 128, dampening_frac 0.01, actorder static).
After oneshot each targeted module's .weight holds GPTQ's quantize-dequantized values (update_batch_qparams);
those are written out. packed_bytes: the quantized Linears' tensors in llm-compressor's own compressed save
(compressed-tensors pack-quantized: weight_packed int32 + weight_scale + weight_shape)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# Run as a script. Not this dir on sys.path (hqq.py/llmcompressor.py would shadow those packages, which transformers
# probes for), but bench/, last, for quant_peer_runners._common.
sys.path.pop(0)
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from quant_peer_runners._common import Timer, decoder_linears, start, version, write
from safetensors import safe_open

TARGETS = [r"re:.*layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$"]


def main() -> None:
    a, model, ids, orig = start(__doc__ or "")
    n, seqlen = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    if (a.bits, a.group_size, a.asym) == (4, 128, False):
        gptq = GPTQModifier(targets=TARGETS, scheme="W4A16", ignore=["lm_head"])
        scheme = "W4A16 preset"
    else:
        weights = QuantizationArgs(num_bits=a.bits, type="int", symmetric=not a.asym, strategy="group",
                                   group_size=a.group_size)
        gptq = GPTQModifier(config_groups={"group_0": QuantizationScheme(targets=TARGETS, weights=weights)},
                            ignore=["lm_head"])
        scheme = (f"custom config_groups: int{a.bits} {'asymmetric' if a.asym else 'symmetric'} group "
                  f"{a.group_size} (W4A16 with num_bits/symmetric changed)")
    with Timer() as t:
        oneshot(model=model, dataset=ds, recipe=gptq, num_calibration_samples=n, max_seq_length=seqlen,
                shuffle_calibration_samples=False, pipeline="sequential")
    deq = {name: m.weight.detach().clone() for name, m in decoder_linears(model).items()}
    quantized = set(deq)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        packed = 0
        for f in Path(tmp).glob("*.safetensors"):
            with safe_open(str(f), "pt") as sf:
                packed += sum(sf.get_tensor(k).nbytes for k in sf.keys()
                              if k.rsplit(".", 1)[0] in quantized)
    meta = {"peer": "llmcompressor", "version": version("llmcompressor"), "bits": a.bits,
            "group_size": a.group_size,
            "method": {"algorithm": "GPTQ", "scheme": scheme, "sym": not a.asym, "block_size": gptq.block_size,
                       "dampening_frac": gptq.dampening_frac, "actorder": str(gptq.actorder),
                       "pipeline": "sequential", "compressed_tensors": version("compressed-tensors")},
            "quant_seconds": t.seconds, "quant_peak_rss_bytes": t.peak_rss, "packed_bytes": packed,
            "packed_bytes_how": "native: llm-compressor save_pretrained(save_compressed=True), quantized Linears' "
                                "tensors (pack-quantized)",
            "calib_samples": n, "calib_seqlen": seqlen}
    write(a.model, a.out, orig, deq, meta, check_group=a.group_size)


if __name__ == "__main__":
    main()
