"""Lazy, validated tensor access across a model dir's safetensors shards; errors name the bad file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from memfit.errors import UserError
from memfit.modeldir import INDEX, check_model_dir, weight_files


class WeightSource:
    """Lazy tensor access across the shards of a model dir; opening validates every shard header."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_model_dir(self.path)
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
