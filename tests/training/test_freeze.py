"""trainable / freeze / stages: what trains, what the optimizer holds, stage switches and resume mid-stage."""

import pytest
import torch
from safetensors.torch import load_file

from memfit.errors import UserError
from training.cli import main
from training.config import TrainConfig
from training.freeze import stage_at
from training.loop import train

from .conftest import read_metrics


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(f"{run_dir}/last/model.safetensors")


def test_freeze_keeps_weights_and_optimizer_state_out(make_cfg, tmp_path):
    base = make_cfg(max_steps=1, output_dir=str(tmp_path / "base"))
    train(base)
    init = _weights(base.output_dir)
    cfg = make_cfg(model_config=None, model_path=f"{base.output_dir}/last", freeze=[r"embed_tokens", r"layers\.0\."],
                   max_steps=3, output_dir=str(tmp_path / "frozen"))
    result = train(cfg, memory_report=True)
    after = _weights(cfg.output_dir)
    frozen = [n for n in init if "embed_tokens" in n or ".layers.0." in n]
    assert frozen and all(torch.equal(init[n], after[n]) for n in frozen)
    assert any(not torch.equal(init[n], after[n]) for n in init if n not in frozen)
    rep = result["memory_report"]
    n_frozen = sum(init[n].numel() * 4 for n in frozen)
    # AdamW: two moments per trainable parameter only
    assert rep["gradients"] == rep["parameters"] - n_frozen
    assert rep["optimizer_state"] == pytest.approx(2 * rep["gradients"], rel=0.01)


def test_trainable_narrows_and_unknown_pattern_is_an_error(make_cfg, corpus, tmp_path, capsys):
    cfg = make_cfg(trainable=[r"layers\.1\.mlp"], max_steps=1)
    result = train(cfg, memory_report=True)
    assert result["memory_report"]["gradients"] == 3 * 64 * 128 * 4  # gate, up, down of layer 1 only
    args = ["model_config={hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2}", f"data={corpus}", "vocab_size=320", "block_size=16", "max_steps=1",
            f"output_dir={tmp_path / 'bad'}", "trainable=[no_such_module]"]
    assert main(args) == 2
    assert "trainable: 'no_such_module' matches no parameter" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "last").exists()


def test_stage_schedule_and_validation():
    stages = [{"steps": 2, "trainable": ["lm_head"]}, {"steps": 3, "freeze": ["embed"]}, {"trainable": ["mlp"]}]
    cfg = TrainConfig(model_config={}, data=["a"], max_steps=10, stages=stages).validate()
    assert [stage_at(cfg, s).index for s in range(10)] == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert stage_at(cfg, 5).start == 5 and stage_at(cfg, 5).trainable == ("mlp",)
    for bad, match in (([{"steps": 2, "trainble": ["x"]}], "unknown key"), ([{"trainable": ["x"]}, {}], "omit"),
                       ([{"steps": 0}], "steps must be an int >= 1"), ([{"steps": 10}, {}], ">= max_steps")):
        with pytest.raises(UserError, match=match):
            TrainConfig(model_config={}, data=["a"], max_steps=10, stages=bad).validate()


def test_stages_switch_at_the_right_step_and_resume_mid_stage_exactly(make_cfg, tmp_path):
    stages = [{"steps": 2, "trainable": [r"layers\.1\."]}, {"steps": 2, "trainable": [r"layers\.0\."]},
              {"freeze": ["embed_tokens"]}]
    full = make_cfg(stages=stages, max_steps=6, save_every=1, output_dir=str(tmp_path / "full"))
    seen: dict[int, dict[str, torch.Tensor]] = {}
    train(full, on_step=lambda step, row: seen.setdefault(step, _weights(full.output_dir)))
    changed = {s: {n for n in seen[s] if not torch.equal(seen[s][n], seen[s - 1][n])} for s in range(2, 7)}
    assert changed[2] and all(".layers.1." in n for n in changed[2])  # stage 0: steps 1-2
    assert changed[3] and all(".layers.0." in n for n in changed[3])  # stage 1: steps 3-4
    assert any(".layers.1." in n for n in changed[5]) and not any("embed" in n for n in changed[5])
    expected = {r["step"]: r["loss"] for r in read_metrics(full.output_dir)}

    for at in (2, 3):  # right at the stage 0 -> 1 boundary, and mid stage 1
        crashed = make_cfg(stages=stages, max_steps=6, save_every=1, output_dir=str(tmp_path / f"crash{at}"))

        def crash(step, row, at=at):
            if step == at:
                raise RuntimeError("simulated crash")

        with pytest.raises(RuntimeError):
            train(crashed, on_step=crash)
        train(crashed, resume=True)
        resumed = {r["step"]: r["loss"] for r in read_metrics(crashed.output_dir)}
        for step in range(1, 7):
            assert resumed[step] == pytest.approx(expected[step], abs=1e-6), (at, step)
