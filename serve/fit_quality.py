"""The reference ``serve fit`` measures quality against: the unquantized model's next-token log-probabilities.

Windows of held-out text (the Shakespeare plays compress keeps out of calibration, or ``--quality-text``) are
run once through the checkpoint in fp32 with transformers' own forward; the tokens and the log-probabilities
(fp16, renormalized when read) go to one safetensors file that every verification run (serve.fit_probe) reads
to measure the mean per-token KL divergence KL(reference || served) and top-1 agreement through serve's engine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from compress.calib import calibration_tokens, default_eval_files, expand
from memfit.errors import UserError
from memfit.hf import load_pretrained, load_tokenizer
from memfit.modeldir import atomic_file


def quality_files(paths: list[str] | None) -> list[Path]:
    if paths:
        return expand(paths, "--quality-text")
    files = [f for f in default_eval_files() if f.is_file()]
    if not files:
        raise UserError("--min-quality needs held-out text: pass --quality-text FILES (the default, the held-out "
                        "Shakespeare plays, is missing: make data)")
    return files


def make_reference(model_dir: str, files: list[Path], rows: int, length: int, path: Path) -> Path:
    """Write ``path`` (tokens [rows, length] and their log-probabilities [rows, length, vocab]) unless a file
    for the same model, text and shape is there already."""
    if path.is_file():
        return path
    tok = load_tokenizer(model_dir, flag="MODEL")
    tokens = calibration_tokens(tok, files, rows, length, seed=1)
    model = load_pretrained(model_dir, dtype=torch.float32, flag="MODEL").eval()
    with torch.inference_mode():
        logp = torch.cat([torch.log_softmax(model(tokens[i:i + 1]).logits.float(), -1).half()
                          for i in range(rows)])
    del model
    atomic_file(path, lambda tmp: save_file({"tokens": tokens.contiguous(), "logp": logp.contiguous()}, str(tmp)))
    return path
