import json

import pytest
import torch

from memfit.errors import UserError
from training.data import pack, read_documents, split_documents, tokenize_document
from training.tokenizer import train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["the king speaks to the queen and the queen replies"] * 50, vocab_size=300)


def test_short_documents_are_packed_not_dropped(tmp_path, tok):
    (tmp_path / "a.txt").write_text("the king")
    (tmp_path / "b.txt").write_text("the queen")
    docs = read_documents([str(tmp_path)])
    x, y = pack(docs, tok, block_size=64)
    assert x.shape == (1, 64)  # both documents in one padded block
    n_tokens = sum(len(tokenize_document(d, tok)[0]) for d in docs)
    # every token after the first is a target exactly once; padding is masked out
    assert int((y != -100).sum()) == n_tokens - 1 - 1  # minus first token and the (untrained) 2nd bos
    assert x[0, 0].item() == tok.bos_token_id


def test_blocks_cover_the_stream_exactly(tmp_path, tok):
    (tmp_path / "a.txt").write_text("the king speaks " * 40)
    docs = read_documents([str(tmp_path / "a.txt")])
    ids, _ = tokenize_document(docs[0], tok)
    x, y = pack(docs, tok, block_size=16)
    assert x.shape[0] == -(-(len(ids) - 1) // 16)
    assert x.flatten()[: len(ids) - 1].tolist() == ids[:-1]
    assert y.flatten()[: len(ids) - 1].tolist()[:-1] == ids[1:-1]  # last target is eos


def test_prompt_completion_masks_the_prompt(tmp_path, tok):
    f = tmp_path / "pc.jsonl"
    f.write_text(json.dumps({"prompt": "the king speaks", "completion": " the queen replies"}) + "\n")
    doc = read_documents([str(f)])[0]
    ids, flags = tokenize_document(doc, tok)
    n_prompt = len(tok("the king speaks", add_special_tokens=False)["input_ids"])
    assert flags[: 1 + n_prompt] == [False] * (1 + n_prompt)  # bos + prompt
    assert all(flags[1 + n_prompt :])
    x, y = pack([doc], tok, block_size=64)
    trained = [t for t in y[0].tolist() if t != -100]
    assert trained == ids[1 + n_prompt :]


def test_messages_train_only_assistant_turns(tmp_path, tok):
    f = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "the king"}, {"role": "assistant", "content": "the queen"},
            {"role": "user", "content": "speaks"}, {"role": "assistant", "content": "replies"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n")
    doc = read_documents([str(f)])[0]
    ids, flags = tokenize_document(doc, tok)
    trained_text = tok.decode([i for i, fl in zip(ids, flags, strict=True) if fl])
    assert "the queen" in trained_text and "replies" in trained_text
    assert "the king" not in trained_text and "speaks" not in trained_text
    assert "<|end|>" in trained_text  # the model learns to end its turn


def test_split_is_by_whole_document_and_deterministic(tmp_path):
    for i in range(40):
        (tmp_path / f"d{i}.txt").write_text(f"doc {i}")
    docs = read_documents([str(tmp_path)])
    a = split_documents(docs, [], 0.2)
    b = split_documents(list(reversed(docs)), [], 0.2)
    assert {d.doc_id for d in a[1]} == {d.doc_id for d in b[1]}
    assert 0 < len(a[1]) < 40
    train, val = split_documents(docs, ["d3.txt"], 0.0)
    assert [d.doc_id for d in val] == ["d3.txt"] and len(train) == 39


def test_bad_data_inputs(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_documents([str(tmp_path / "nope.txt")])
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(UserError, match="no non-empty documents"):
        read_documents([str(tmp_path / "empty.txt")])
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not valid JSON"):
        read_documents([str(tmp_path / "bad.jsonl")])
    (tmp_path / "odd.jsonl").write_text('{"title": "x"}\n')
    with pytest.raises(UserError, match="expected a text"):
        read_documents([str(tmp_path / "odd.jsonl")])


def test_bos_per_block_starts_every_block_with_bos_and_keeps_every_target(tmp_path, tok):
    (tmp_path / "a.txt").write_text("the king speaks " * 40)
    docs = read_documents([str(tmp_path / "a.txt")])
    ids, _ = tokenize_document(docs[0], tok)
    x, y = pack(docs, tok, block_size=16, bos_per_block=True)
    assert x.shape[1] == 16 and (x[:, 0] == tok.bos_token_id).all() and (y[:, 0] == -100).all()
    # the rest is the plain packing at block_size - 1: every token after the first a target exactly once
    x15, y15 = pack(docs, tok, block_size=15)
    assert torch.equal(x[:, 1:], x15) and torch.equal(y[:, 1:], y15)
    assert int((y != -100).sum()) == len(ids) - 1
