"""memfit.hf: a loaded tokenizer keeps no Python copy of the tables its Rust tokenizer was built from."""

from transformers import AutoTokenizer
from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

from memfit.hf import drop_build_tables, load_tokenizer


def _tiny_gemma(tmp_path):
    chars = ["▁", "a", "b", "c", "h", "i"]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, **{c: 5 + i for i, c in enumerate(chars)}}
    merges = [("a", "b"), ("ab", "c"), ("h", "i")]
    for m in merges:
        vocab.setdefault("".join(m), len(vocab))
    tok = GemmaTokenizer(vocab=vocab, merges=merges)
    tok.save_pretrained(tmp_path)
    return tok


def test_load_tokenizer_drops_the_build_tables_and_still_encodes_decodes_and_saves(tmp_path):
    ref = _tiny_gemma(tmp_path / "src")
    assert isinstance(ref.__dict__.get("_vocab"), dict) and isinstance(ref.__dict__.get("_merges"), list)
    tok = load_tokenizer(str(tmp_path / "src"))
    assert type(tok) is type(ref) and "_vocab" not in tok.__dict__ and "_merges" not in tok.__dict__
    text = "abc hi cab"
    ids = ref(text)["input_ids"]
    assert tok(text)["input_ids"] == ids and tok.decode(ids) == ref.decode(ids)
    assert tok.get_vocab() == ref.get_vocab()
    tok.save_pretrained(tmp_path / "out")
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == ids
    assert drop_build_tables(tok) == 0  # nothing left to drop
