"""NF4 (4-bit) and LLM.int8 (8-bit) through bitsandbytes, saved with transformers' own bnb serialization.

bitsandbytes quantizes at load time (whole model, not layer by layer); the output dir is a normal
transformers checkpoint with a `bitsandbytes` quantization_config, loadable by from_pretrained.
Decode speed on CPU against our int4 kernel: bench/results/quantize.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import BitsAndBytesConfig

from memfit.errors import UserError
from memfit.hf import load_pretrained, nf4_config
from memfit.modeldir import atomic_dir, copy_side_files


def quantize(model_dir: str, out: Path, method: str, bits: int, skip: list[str], trust_remote_code: bool = False,
             device: str = "cpu") -> dict[str, Any]:
    if method == "nf4" and bits != 4:
        raise UserError(f"--method nf4 is a 4-bit format, got --bits {bits} (use --method int8 for 8 bits)")
    if method == "int8" and bits != 8:
        raise UserError(f"--method int8 is an 8-bit format, got --bits {bits} (use --method nf4 for 4 bits)")
    if bits == 4:
        cfg = nf4_config(torch.float32, skip)
    else:
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip or None)
    model = load_pretrained(model_dir, trust_remote_code=trust_remote_code, quantization_config=cfg,
                            device_map={"": device})

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_side_files(Path(model_dir), tmp)
        cfg_path = tmp / "config.json"
        data = json.loads(cfg_path.read_text())
        data["quantization_config"]["memfit"] = {"format_version": 1, "method": method, "bits": bits,
                                                 "skipped": skip}
        cfg_path.write_text(json.dumps(data, indent=2) + "\n")

    atomic_dir(out, write)
    return {"quantized": sum(1 for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")),
            "skipped": skip, "fallbacks": {}}
