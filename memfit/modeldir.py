"""The model directory: one check of "is this a model dir?", its config, its files, and atomic writes.

A model dir is what every stage reads and writes: ``config.json``, safetensors weights (sharded or not), the
tokenizer and generation files beside them. Pickle weights (``*.bin``, ``*.pt``) can run code when loaded
and are refused unless the user asks by flag. Outputs are written to a temp dir and renamed into place,
so a crash never leaves a half-written model where a good one was. No torch import here: CLIs validate
their input with it before paying for torch.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memfit.errors import UserError

INDEX = "model.safetensors.index.json"
# what travels with the weights when a stage writes a new model dir: the tokenizer and generation config, and
# the licence and terms a derived model must carry (Gemma's terms, a NOTICE, a use policy)
SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "generation_config.json", "*.jinja", "vocab.*",
              "merges.txt", "added_tokens.json", "LICENSE*", "NOTICE*", "*TERMS*", "USE_POLICY*")
_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth")


def weight_files(path: str | Path) -> list[str]:
    """Model weight files: *.safetensors except training state (optimizer) files."""
    return sorted(p.name for p in Path(path).glob("*.safetensors") if not p.name.startswith("training_state"))


def check_model_dir(path: str | Path, flag: str = "MODEL", allow_pickle: bool = False) -> Path:
    """Refuse a missing dir, one without config.json, one without weights, and pickle-only weights unless
    ``allow_pickle``; the message names ``flag``. Returns the path."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{flag}: {path} is not a directory")
    if not (p / "config.json").is_file():
        raise UserError(f"{flag}: {path} has no config.json")
    if weight_files(p):
        return p
    if any(any(p.glob(g)) for g in _PICKLE_GLOBS):
        if allow_pickle:
            return p
        raise UserError(f"{flag}: {path} holds only pickle weights (.bin/.pt), which can run arbitrary code when "
                        "loaded; convert to safetensors, or pass --allow-pickle if you trust the source")
    raise UserError(f"{flag}: {path} holds no weights (*.safetensors)")


def read_config(path: str | Path, flag: str = "MODEL") -> dict[str, Any]:
    """config.json of a model dir as a dict; an unreadable one is a UserError naming ``flag``."""
    f = Path(path) / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{flag}: {f} is unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{flag}: {f} is not a JSON object")
    return cfg


def check_output_dir(model: str | Path, out: str | Path, overwrite: bool, flag: str = "--output") -> Path:
    """An output dir that is not the input and does not exist unless ``overwrite``."""
    out = Path(out)
    if out.resolve() == Path(model).resolve():
        raise UserError(f"{flag} must differ from MODEL")
    if out.exists() and not overwrite:
        raise UserError(f"{flag} {out} already exists (pass --overwrite to replace it)")
    return out


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Tokenizer, chat template and generation config travel with the weights."""
    for pattern in SIDE_FILES:
        for f in Path(src).glob(pattern):
            if f.is_file():
                shutil.copy2(f, Path(dst) / f.name)


def dir_bytes(path: str | Path, pattern: str | None = None) -> int:
    """Bytes of the model weight files (or of every file matching pattern)."""
    path = Path(path)
    files = [path / f for f in weight_files(path)] if pattern is None else list(path.glob(pattern))
    return sum(f.stat().st_size for f in files if f.is_file())


def atomic_file(dest: str | Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) then rename tmp onto dest: a reader never sees half a file. tmp sits beside dest and keeps
    its suffix (a writer such as matplotlib's savefig picks the format from it)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.stem}.tmp-{os.getpid()}{dest.suffix}")
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)


def atomic_dir(dest: Path, write: Callable[[Path], None]) -> None:
    """Run write(tmp) then swap tmp into dest with renames; dest is never half-written."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    old = dest.parent / f".{dest.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        for f in (p for p in tmp.iterdir() if p.is_file()):  # durable before the rename publishes it
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
