"""AutoRound (SignRound: signed-gradient tuning of rounding offsets and min/max scales, block by block) on CPU:
AutoRound(model, tokenizer, scheme="W4A16", bits=B, group_size=G, sym=True, dataset=<our token rows>, nsamples=n,
seqlen=L, iters=N or its default 200, device_map="cpu").quantize(). Calibration: AutoRound's calib() accepts
pre-tokenized data (any iterable of dicts with input_ids); each of our rows goes in as one {"input_ids" [1, L],
"attention_mask"} batch, so it tunes on exactly our n x L tokens (nothing downloaded, nothing re-tokenized).
SignRound writes each layer's quantize-dequantized weight into its .weight (WrapperLinear.unwrapper); those are
written out. In-features not a multiple of G: AutoRound pads the last group (reshape_pad_tensor_by_group_size).
packed_bytes: the quantized Linears' tensors in its own "auto_round" format (qweight, qzeros, scales)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# Run as a script. Not this dir on sys.path (hqq.py/llmcompressor.py would shadow those packages, which transformers
# probes for), but bench/, last, for quant_peer_runners._common.
sys.path.pop(0)
sys.path.append(str(Path(__file__).resolve().parents[1]))

from auto_round import AutoRound
from quant_peer_runners._common import Timer, decoder_linears, start, version, write
from safetensors import safe_open
from transformers import AutoTokenizer

DEFAULT_ITERS = 200  # SignRoundConfig(iters=200) in auto-round 0.16.1


def main() -> None:
    a, model, ids, orig = start(__doc__ or "")
    n, seqlen = ids.shape
    rows = [{"input_ids": r[None], "attention_mask": r[None].new_ones(r[None].shape)} for r in ids]
    iters = DEFAULT_ITERS if a.iters is None else a.iters
    batch = min(8, n)
    with Timer() as t:
        ar = AutoRound(model, tokenizer=AutoTokenizer.from_pretrained(a.model), scheme="W4A16", bits=a.bits,
                       group_size=a.group_size, sym=True, dataset=rows, nsamples=n, seqlen=seqlen, iters=iters,
                       batch_size=batch, device_map="cpu", enable_torch_compile=False, seed=42)
        ar.quantize()
    deq = {name: m.weight.detach().clone() for name, m in decoder_linears(ar.model).items()}
    quantized, packed, how = set(deq), None, ""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ar.save_quantized(tmp, format="auto_round")
            packed = 0
            for f in Path(tmp).glob("*.safetensors"):
                with safe_open(str(f), "pt") as sf:
                    packed += sum(sf.get_tensor(k).nbytes for k in sf.keys() if k.rsplit(".", 1)[0] in quantized)
            how = "native: save_quantized(format='auto_round'), quantized Linears' qweight/qzeros/scales"
    except Exception as e:  # noqa: BLE001 - fall back to the computed size, and say why
        groups = sum(-(-w.shape[1] // a.group_size) * w.shape[0] for w in orig.values())
        packed = sum(w.numel() for w in orig.values()) * a.bits // 8 + groups * 2 + groups * a.bits // 8
        how = f"computed: bits/8 per weight + fp16 scale + {a.bits}-bit zero per group (native save failed: {e})"
    meta = {"peer": "autoround", "version": version("auto-round"), "bits": a.bits, "group_size": a.group_size,
            "method": {"algorithm": "SignRound (AutoRound)", "scheme": "W4A16" if a.bits == 4 else
                       f"W4A16 with bits={a.bits}", "sym": True, "iters": iters,
                       "iters_source": "default" if a.iters is None else "--iters", "batch_size": batch,
                       "lr": "auto (its heuristic from iters/bits)", "seed": 42, "device": "cpu"},
            "quant_seconds": t.seconds, "quant_peak_rss_bytes": t.peak_rss, "packed_bytes": packed,
            "packed_bytes_how": how, "calib_samples": n, "calib_seqlen": seqlen}
    write(a.model, a.out, orig, deq, meta, check_group=a.group_size)


if __name__ == "__main__":
    main()
