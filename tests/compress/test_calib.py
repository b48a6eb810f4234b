"""Calibration and evaluation windows start with BOS where the tokenizer adds one (compress.calib.bos_id)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import processors

from compress.calib import bos_id, calibration_tokens
from compress.evaluate import windows
from tests.compress.conftest import fake_text, make_tokenizer


def _tokenizers():
    plain = make_tokenizer(fake_text(2000, seed=1))
    with_bos = make_tokenizer(fake_text(2000, seed=1))
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.bos_token_id)])
    return plain, with_bos


def test_bos_id_only_when_the_tokenizer_adds_it() -> None:
    plain, with_bos = _tokenizers()
    assert plain.bos_token_id is not None and bos_id(plain) is None
    assert bos_id(with_bos) == with_bos.bos_token_id


def test_calibration_windows_start_with_bos(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_text(fake_text(3000, seed=2))
    plain, with_bos = _tokenizers()
    a = calibration_tokens(plain, [f], 6, 32, seed=0)
    b = calibration_tokens(with_bos, [f], 6, 32, seed=0)
    assert a.shape == b.shape == (6, 32)
    bos = with_bos.bos_token_id
    assert (b[:, 0] == bos).all() and (b[:, 1:] != bos).all() and (a != bos).all()
    text = with_bos(f.read_text(), add_special_tokens=False)["input_ids"]
    row = b[0, 1:].tolist()  # 31 consecutive text tokens
    assert any(text[i : i + 31] == row for i in range(len(text) - 30))


def test_eval_windows_with_bos() -> None:
    t = torch.arange(10, 30)  # 20 tokens
    plain = windows(t, 8)
    assert [w.shape for w in plain] == [(2, 8), (1, 4)]
    with_bos = windows(t, 8, bos=1)
    assert [w.shape for w in with_bos] == [(2, 8), (1, 7)]
    assert (with_bos[0][:, 0] == 1).all() and with_bos[0][1, 1:].tolist() == list(range(17, 24))
    assert torch.cat([w[:, 1:].flatten() for w in with_bos]).tolist() == t.tolist()
