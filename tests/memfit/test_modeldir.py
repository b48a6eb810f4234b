"""memfit.modeldir / memfit.defaults / memfit.cli: the one model-dir check, atomic writes, shared defaults and
the umbrella command's dispatch and exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from memfit import defaults
from memfit.cli import main as memfit_main
from memfit.errors import UserError
from memfit.modeldir import atomic_dir, check_model_dir, check_output_dir, read_config

ROOT = Path(__file__).resolve().parents[2]


def _dir(tmp_path: Path, *files: str, config: str = "{}") -> Path:
    d = tmp_path / "m"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    for f in files:
        (d / f).write_bytes(b"x")
    return d


@pytest.mark.parametrize("files,config,message", [
    ((), "{}", "holds no weights"),
    (("model.safetensors",), None, "has no config.json"),
    (("pytorch_model.bin",), "{}", "only pickle weights"),
    (("training_state.safetensors",), "{}", "holds no weights"),  # optimizer state is not a model
])
def test_check_model_dir_refuses_with_the_flag_named(tmp_path, files, config, message) -> None:
    d = _dir(tmp_path, *files, config=config)
    with pytest.raises(UserError, match=f"^--model: .*{message}"):
        check_model_dir(d, "--model")


def test_check_model_dir_accepts_safetensors_and_pickle_only_when_asked(tmp_path) -> None:
    with pytest.raises(UserError, match="is not a directory"):
        check_model_dir(tmp_path / "missing")
    d = _dir(tmp_path, "pytorch_model.bin")
    assert check_model_dir(d, allow_pickle=True) == d
    (d / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert check_model_dir(d) == d


def test_read_config_and_output_checks(tmp_path) -> None:
    d = _dir(tmp_path, "model.safetensors", config="{not json")
    with pytest.raises(UserError, match="MODEL: .*config.json is unreadable"):
        read_config(d)
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert read_config(d) == {"max_position_embeddings": 512}
    with pytest.raises(UserError, match="--output must differ from MODEL"):
        check_output_dir(d, d, overwrite=True)
    with pytest.raises(UserError, match="already exists"):
        check_output_dir(d, tmp_path, overwrite=False)
    assert check_output_dir(d, tmp_path / "new", overwrite=False) == tmp_path / "new"


def test_atomic_dir_keeps_the_old_dir_when_the_write_fails(tmp_path) -> None:
    dest = tmp_path / "out"
    atomic_dir(dest, lambda t: (t.mkdir(), (t / "a").write_text("1")))
    assert (dest / "a").read_text() == "1"

    def crash(t: Path) -> None:
        t.mkdir()
        (t / "a").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_dir(dest, crash)
    assert (dest / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    atomic_dir(dest, lambda t: (t.mkdir(), (t / "b").write_text("2")))
    assert sorted(p.name for p in dest.iterdir()) == ["b"]


def test_max_seq_len_default_cap_and_refusals() -> None:
    assert defaults.max_seq_len({"max_position_embeddings": 512}, None) == 512
    assert defaults.max_seq_len({"max_position_embeddings": 131072}, None) == defaults.MAX_SEQ_LEN_CAP
    assert defaults.max_seq_len({}, None) == min(defaults.FALLBACK_MAX_POSITIONS, defaults.MAX_SEQ_LEN_CAP)
    assert defaults.max_seq_len({"max_position_embeddings": 512}, 100) == 100
    with pytest.raises(UserError, match="--max-seq-len 600 exceeds the model's max_position_embeddings 512"):
        defaults.max_seq_len({"max_position_embeddings": 512}, 600)
    with pytest.raises(UserError, match="--ctx must be >= 2"):
        defaults.max_seq_len({}, 1, flag="--ctx")


def test_each_shared_rule_is_stated_once() -> None:
    """The model-dir check, the context default, the NF4 setting and the calibration / group defaults live in
    the core only: no stage re-states them (what the issue counted as five, four, three and five copies)."""
    stage_files = [p for pkg in ("training", "compress", "serve") for p in (ROOT / pkg).rglob("*.py")]
    rules = {
        r"\"config\.json\"\)\.is_file\(\)": "export.py",  # training.export looks for a run's checkpoint, not a model
        # training.export writes the model card's "context N", not a rule
        r"get\(\s*[\"']max_position_embeddings[\"']|getattr\([^)]*max_position_embeddings": "export.py",
        r"bnb_4bit_quant_type|quant_type=\"nf4\"": None,
        r"(calib|group).*\b(128|512)\b": None,  # calibration samples x tokens, group size: memfit.defaults
    }
    for pattern, allowed in rules.items():
        hits = [f"{p.relative_to(ROOT)}:{i}" for p in stage_files if p.name != allowed
                for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
        assert not hits, f"{pattern} re-stated outside memfit/: {hits}"


def test_umbrella_command_dispatches_with_the_stages_exit_codes(tmp_path, capsys) -> None:
    assert memfit_main(["--help"]) == 0 and "plan" in capsys.readouterr().out
    assert memfit_main([]) == 2
    assert memfit_main(["deploy"]) == 2 and "unknown command 'deploy'" in capsys.readouterr().err
    assert memfit_main(["fit"]) == 2 and "--for serve or --for train" in capsys.readouterr().err
    assert memfit_main(["plan", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert memfit_main(["compress", "quantize", str(tmp_path), "-o", str(tmp_path / "o")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert memfit_main(["serve", "--help"]) == 0 and "--max-batch" in capsys.readouterr().out
    assert memfit_main(["eval", "--help"]) == 0 and "--baseline" in capsys.readouterr().out
