"""Every bad input: a clear message, exit code 2, and nothing lost."""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from training import checkpoint as ckpt
from training.cli import main
from training.loop import train

from .conftest import TINY_MODEL


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def base_args(tmp_path, corpus, **extra):
    values = {"model_config": json.dumps(TINY_MODEL), "vocab_size": 320, "data": str(corpus), "block_size": 16,
              "batch_size": 2, "max_steps": 2, "eval_every": 1, "save_every": 1, "output_dir": str(tmp_path / "run")}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def test_missing_and_empty_data(tmp_path, corpus, capsys):
    code, err = run(capsys, *base_args(tmp_path, corpus, data=str(tmp_path / "nowhere")))
    assert code == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    code, err = run(capsys, *base_args(tmp_path, corpus, data=str(tmp_path / "empty")))
    assert code == 2 and "no non-empty documents" in err


def test_documents_shorter_than_a_block_train(tmp_path, capsys):
    d = tmp_path / "short"
    d.mkdir()
    for i in range(3):
        (d / f"s{i}.txt").write_text("the king")
    code, _ = run(capsys, *base_args(tmp_path, d, block_size=64, val_fraction=0.3))
    assert code == 0


def test_model_dir_without_weights_and_pickle_refused(tmp_path, corpus, capsys):
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    code, err = run(capsys, *base_args(tmp_path, corpus, model_path=str(empty), model_config="null"))
    assert code == 2 and "holds no weights" in err

    # a pickle-only checkpoint: refused by default (pickle can run code), loaded with --allow-pickle
    torch.manual_seed(0)
    src = tmp_path / "ok"
    train_args = base_args(tmp_path, corpus, output_dir=str(src))
    assert main(train_args) == 0
    pkl = tmp_path / "pickle"
    shutil.copytree(src / "last", pkl)
    sd = AutoModelForCausalLM.from_pretrained(pkl).state_dict()
    (pkl / "model.safetensors").unlink()
    torch.save(sd, pkl / "pytorch_model.bin")
    args = base_args(tmp_path, corpus, model_path=str(pkl), model_config="null", output_dir=str(tmp_path / "ft"))
    code, err = run(capsys, *args)
    assert code == 2 and "pickle" in err and "--allow-pickle" in err
    assert not (tmp_path / "ft" / "last").exists()
    assert main([*args, "--allow-pickle"]) == 0  # the user vouches for the file


def test_output_dir_with_previous_run(tmp_path, corpus, capsys):
    args = base_args(tmp_path, corpus)
    assert main(args) == 0
    code, err = run(capsys, *args)
    assert code == 2 and "previous run" in err and "--resume" in err and "--overwrite" in err
    assert (tmp_path / "run" / "last" / "model.safetensors").is_file()  # untouched
    assert main([*args, "--overwrite"]) == 0
    code, err = run(capsys, *base_args(tmp_path, corpus, output_dir=str(tmp_path / "fresh")), "--resume")
    assert code == 2 and "no complete checkpoint" in err


def test_qlora_on_cpu_is_a_clear_error(tmp_path, corpus, capsys):
    args = base_args(tmp_path, corpus, output_dir=str(tmp_path / "src"))
    assert main(args) == 0
    args = base_args(tmp_path, corpus, model_path=str(tmp_path / "src" / "last"), model_config="null",
                     qlora="true", output_dir=str(tmp_path / "q"))
    code, err = run(capsys, *args)
    assert code == 2 and "needs CUDA" in err


def test_kill_during_save_leaves_previous_checkpoint_loadable(make_cfg, monkeypatch):
    cfg = make_cfg(max_steps=6, save_every=3)
    real = ckpt.write_training_state

    def dying(d, state, optimizer):
        if state["step"] == 6:  # the second save dies half-way through writing
            (d / ckpt.STATE_TENSORS).write_bytes(b"\x00" * 10)
            raise KeyboardInterrupt("killed during save")
        real(d, state, optimizer)

    monkeypatch.setattr(ckpt, "write_training_state", dying)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    last = ckpt.find_checkpoint(__import__("pathlib").Path(cfg.output_dir) / "last")
    state, _ = ckpt.read_training_state(last)
    assert state["step"] == 3
    AutoModelForCausalLM.from_pretrained(last)  # loads
    leftovers = [p for p in os.listdir(cfg.output_dir) if ".tmp-" in p]
    assert leftovers == []
    monkeypatch.setattr(ckpt, "write_training_state", real)
    assert train(cfg, resume=True)["step"] == 6


def test_interrupted_swap_still_finds_previous_checkpoint(make_cfg):
    cfg = make_cfg(max_steps=3, save_every=3)
    train(cfg)
    from pathlib import Path

    out = Path(cfg.output_dir)
    os.replace(out / "last", out / ".last.old")  # killed between the two renames
    assert ckpt.find_checkpoint(out / "last") == out / ".last.old"
