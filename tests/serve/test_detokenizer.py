"""IncrementalDetokenizer against the whole decode: byte-level BPE (the shipped tokenizer) with multi-byte
characters split across tokens, special tokens, stop strings across token boundaries, and the cost per token."""

from __future__ import annotations

import os
import random

import pytest

from serve.detokenizer import IncrementalDetokenizer, fast_decode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "shakespeare-llama"))


def _decoders(tok):
    return {"fast": fast_decode(tok), "wrapper": lambda ids: tok.decode(ids, skip_special_tokens=True)}


def _run(decode, ids, stop=(), flush=False) -> tuple[list[str], bool]:
    d = IncrementalDetokenizer(decode, stop)
    deltas, stopped = [], False
    for i, t in enumerate(ids):
        text, stopped = d.add(t, final=not flush and i == len(ids) - 1)
        deltas.append(text)
        if stopped:
            break
    if flush and not stopped:
        deltas.append(d.flush())
    return deltas, stopped


@pytest.mark.parametrize("which", ["fast", "wrapper"])
def test_random_ids_equal_whole_decode(tok, which):
    decode = _decoders(tok)[which]
    rng = random.Random(0)
    for trial in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 80))]  # byte tokens, specials, words
        deltas, _ = _run(decode, ids, flush=trial % 2 == 1)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids


def test_multibyte_text_streams_whole_characters_only(tok):
    decode = fast_decode(tok)
    rng = random.Random(1)
    alphabet = list("abc xyz,.\n") + ["é", "ü", "ß", "日本", "語", "😀", "🎭", "Ω", "∑"]
    split_chars = 0
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        deltas, _ = _run(decode, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
        assert not any("\ufffd" in d for d in deltas)  # an incomplete character is held, never sent
        split_chars += sum(1 for t in ids if "\ufffd" in tok.decode([t]))
    assert split_chars > 0, "no character was split across tokens: the test would not test the hold-back"


def test_incomplete_character_at_the_end_is_released_as_replacement(tok):
    ids = tok("a😀", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids) + 1) if tok.decode(ids[:i]).endswith("\ufffd"))
    deltas, _ = _run(fast_decode(tok), ids[:cut], flush=True)
    assert "".join(deltas) == tok.decode(ids[:cut]) and deltas[-1].endswith("\ufffd")
    assert "\ufffd" not in "".join(deltas[:-1])


def _expected_visible(text: str, stops: list[str]) -> str:
    """What may be out after ``text`` was decoded (the old engine's rule): no trailing U+FFFD, and no suffix that
    is a proper prefix of a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = max((k for x in stops for k in range(1, min(len(x) - 1, end) + 1) if text[end - k:end] == x[:k]),
               default=0)
    return text[:end - hold]


def test_stop_strings_across_tokens_hold_back_and_cut(tok):
    decode = fast_decode(tok)
    text = "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun é!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([t]) for t in ids]
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(ids))]
    checked = 0
    for a in range(1, len(text) - 4):
        for ln in (2, 3, 5, 8):
            stop = text[a:a + ln]
            if a + ln > len(text) or a in starts or text.find(stop) != a:
                continue  # a stop string starting inside a token and found there first
            checked += 1
            d = IncrementalDetokenizer(decode, ["never-there", stop])
            out, stopped = "", False
            for i, t in enumerate(ids):
                delta, stopped = d.add(t)
                out += delta
                if stopped:
                    break
                assert out == _expected_visible(tok.decode(ids[:i + 1]), ["never-there", stop])
            assert stopped and out == text[:a], stop
    assert checked > 50


def test_stop_prefix_released_when_the_text_goes_elsewhere(tok):
    ids = tok("and Romeo, and Juliet", add_special_tokens=False)["input_ids"]
    deltas, stopped = _run(fast_decode(tok), ids, stop=["and Juliet!"])
    assert not stopped and "".join(deltas) == "and Romeo, and Juliet"


def test_decode_work_per_token_is_bounded(tok):
    """Each token decodes a window of a few tokens, however long the output (the whole-output decode was O(n))."""
    calls: list[int] = []
    rust = fast_decode(tok)

    def counting(ids):
        calls.append(len(ids))
        return rust(ids)

    text = ("Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day, é 日本. " * 20)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 400
    deltas, _ = _run(counting, ids, stop=["never"])
    assert "".join(deltas) == text
    # a window spans the tokens of one split character (up to 4) plus one before, never the output so far
    assert max(calls) <= 9 and sum(calls) <= 5 * len(ids) and len(calls) <= 2 * len(ids)


def test_context_dependent_decoder_keeps_spaces():
    """A SentencePiece-style decoder drops the "▁" of the text's first word only: each window is decoded after
    some context, so words after the first keep their space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁and": 4, "▁more": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t)
    ids = [1, 2, 3, 4, 5, 2, 3]
    whole = tok.decode(ids, skip_special_tokens=True)
    assert whole == "Hello world! and more world!"
    for decode in _decoders(tok).values():
        assert "".join(_run(decode, ids)[0]) == whole
