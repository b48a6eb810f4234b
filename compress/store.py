"""Safe reading and writing of model dirs: safetensors only, errors that name the bad file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from training.errors import UserError
from training.model import check_checkpoint_dir

INDEX = "model.safetensors.index.json"
COPY_GLOBS = ("tokenizer*", "special_tokens_map.json", "generation_config.json", "*.jinja", "vocab.*",
              "merges.txt", "added_tokens.json")


def read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path / 'config.json'}: unreadable config ({e})") from None


class WeightSource:
    """Lazy tensor access across the shards of a model dir; opening validates every shard header."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_checkpoint_dir(str(self.path), allow_pickle=False)
        index = self.path / INDEX
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index}: corrupt shard index ({e})") from None
        else:
            files = weight_files(self.path)
        self.key_file: dict[str, str] = {}
        self.handles: dict[str, Any] = {}
        for f in files:
            fp = self.path / f
            if not fp.is_file():
                raise UserError(f"{fp}: shard listed in {INDEX} is missing")
            try:
                h = safe_open(str(fp), framework="pt", device="cpu")
                keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise UserError(f"{fp}: corrupt safetensors file ({e})") from None
            self.handles[f] = h
            for k in keys:
                self.key_file[k] = f

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def keys(self) -> list[str]:
        return list(self.key_file)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.key_file:
            raise UserError(f"{self.path}: tensor {key} is missing from {', '.join(self.handles)}")
        f = self.key_file[key]
        try:
            return self.handles[f].get_tensor(key)
        except Exception as e:
            raise UserError(f"{self.path / f}: corrupt data for tensor {key} ({e})") from None

    def file_bytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in self.handles)


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template and generation config travel with the weights."""
    for pattern in COPY_GLOBS:
        for f in src.glob(pattern):
            if f.is_file():
                shutil.copy2(f, dst / f.name)


def weight_files(path: Path) -> list[str]:
    """Model weight files: *.safetensors except training state (optimizer) files."""
    return sorted(p.name for p in Path(path).glob("*.safetensors") if not p.name.startswith("training_state"))


def dir_bytes(path: Path, pattern: str | None = None) -> int:
    """Bytes of the model weight files (or of every file matching pattern)."""
    path = Path(path)
    files = [path / f for f in weight_files(path)] if pattern is None else list(path.glob(pattern))
    return sum(f.stat().st_size for f in files if f.is_file())
