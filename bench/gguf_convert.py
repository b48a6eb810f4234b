"""Run llama.cpp's convert_hf_to_gguf.py on models it does not take as they are (used by bench/peers.py).

Runs in the llamacpp peer's venv (transformers 4.57, as convert_hf_to_gguf.py pins), not in .venv:

    python bench/gguf_convert.py CONVERT_HF_TO_GGUF_PY MODEL_DIR [convert args...]

Two fixes, each applied only where the plain script fails:
- a tokenizer_config.json written by transformers 5 (tokenizer_class TokenizersBackend, extra_special_tokens
  as a list) is unreadable by 4.57: convert a temporary dir of links with a 4.x tokenizer_config.json instead;
- convert_hf_to_gguf.py knows BPE pre-tokenizers by a hash of their output and refuses unknown ones: one that
  is plain GPT-2 ByteLevel (with its regex) is llama.cpp's "gpt-2" (shakespeare-llama: llama-server's
  /tokenize gives the same ids as the HF tokenizer).
"""

from __future__ import annotations

import json
import runpy
import sys
import tempfile
from pathlib import Path


def hf4_dir(model_dir: Path, tmp: Path) -> Path:
    """model_dir, or a dir of links to it with a tokenizer_config.json that transformers 4.57 reads."""
    cfg_file = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    if cfg.get("tokenizer_class") != "TokenizersBackend":
        return model_dir
    stage = tmp / model_dir.name  # the dir's name becomes the GGUF's general.name
    stage.mkdir()
    for f in model_dir.iterdir():
        if f.name != cfg_file.name:
            (stage / f.name).symlink_to(f.resolve())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(cfg.get("extra_special_tokens"), list):
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    (stage / cfg_file.name).write_text(json.dumps(cfg, indent=2))
    return stage


def main() -> None:
    convert, model_dir, rest = Path(sys.argv[1]), Path(sys.argv[2]).resolve(), sys.argv[3:]
    sys.path[:0] = [str(convert.parent), str(convert.parent / "gguf-py")]
    from conversion import base  # llama.cpp's, beside convert_hf_to_gguf.py

    orig = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self: base.TextModel, tokenizer: object) -> str:
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            tok = Path(self.dir_model) / "tokenizer.json"
            pre = (json.loads(tok.read_text()).get("pre_tokenizer") or {}) if tok.exists() else {}
            if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
                raise
            print("gguf_convert: unknown BPE pre-tokenizer is GPT-2 ByteLevel: using llama.cpp's 'gpt-2'")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = [str(convert), str(hf4_dir(model_dir, Path(tmp))), *rest]
        runpy.run_path(str(convert), run_name="__main__")


if __name__ == "__main__":
    main()
