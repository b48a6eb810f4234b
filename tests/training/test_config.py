import pytest

from memfit.errors import UserError
from training.cli import main
from training.config import load_config


def test_yaml_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_config: {hidden_size: 64}\ndata: [a.txt]\nlr: 1e-3\n")
    cfg = load_config(str(recipe), ["lr=2e-3", "lora=true", "data=b.txt", "max_steps=7"])
    assert cfg.lr == 2e-3 and cfg.lora is True and cfg.data == ["b.txt"] and cfg.max_steps == 7


def test_unknown_key_in_yaml_names_it(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_config: {}\ndata: [a]\nlearning_rate: 0.1\n")
    with pytest.raises(UserError, match="unknown config key 'learning_rate'"):
        load_config(str(recipe))


def test_unknown_override_and_bad_values():
    with pytest.raises(UserError, match="unknown config key 'bogus'"):
        load_config(None, ["model_config={}", "data=[a]", "bogus=1"])
    with pytest.raises(UserError, match="precision"):
        load_config(None, ["model_config={}", "data=[a]", "precision=fp8"])
    with pytest.raises(UserError, match="batch_size must be >= 1"):
        load_config(None, ["model_config={}", "data=[a]", "batch_size=0"])
    with pytest.raises(UserError, match="max_steps must be int"):
        load_config(None, ["model_config={}", "data=[a]", "max_steps=lots"])
    with pytest.raises(UserError, match="exactly one of model_path"):
        load_config(None, ["data=[a]"])


def test_cli_exit_code_2_on_unknown_key(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_config: {}\ndata: [a]\nwarmup: 3\n")
    assert main(["--config", str(recipe)]) == 2
    assert "unknown config key 'warmup'" in capsys.readouterr().err
