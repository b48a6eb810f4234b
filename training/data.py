"""Documents in, packed token blocks out.

A document is one text file or one JSONL row. Rows hold `text`, `prompt`/`completion` (loss on the
completion only) or `messages` (rendered by the tokenizer's chat template, loss on assistant turns).
Documents are split into train/validation *whole* (by file name or by a hash of the document id, so
the split is the same on every machine and every run), then concatenated and cut into blocks.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UserError

IGNORE = -100


@dataclass
class Document:
    doc_id: str
    """Stable id: file name, or `file:line` for JSONL rows."""
    source: str
    """Basename of the file it came from (what val_files matches)."""
    row: dict[str, Any]
    """{"text": ...} or {"prompt", "completion"} or {"messages": [...]}."""


def expand_paths(specs: list[str]) -> list[Path]:
    """Files, dirs (every .txt/.jsonl inside, sorted) and globs -> sorted unique files."""
    files: list[Path] = []
    for spec in specs:
        p = Path(spec).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix in (".txt", ".jsonl") and q.is_file())
            if not found:
                raise UserError(f"data: directory {spec} holds no .txt or .jsonl files")
            files.extend(found)
        else:
            matched = sorted(Path(m) for m in glob.glob(str(p)) if Path(m).is_file())
            if not matched:
                raise UserError(f"data: {spec} does not exist")
            files.extend(matched)
    return sorted(set(files))


def read_documents(specs: list[str]) -> list[Document]:
    docs: list[Document] = []
    for path in expand_paths(specs):
        if path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path))
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                docs.append(Document(path.name, path.name, {"text": text}))
    if not docs:
        raise UserError(f"data: no non-empty documents in {', '.join(specs)}")
    return docs


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"data: {path}:{lineno} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"data: {path}:{lineno} must be a JSON object")
        if "messages" in row:
            msgs = row["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
                raise UserError(f"data: {path}:{lineno}: messages must be a list of {{role, content}}")
            row = {"messages": msgs}
        elif "prompt" in row or "completion" in row:
            if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
                raise UserError(f"data: {path}:{lineno}: prompt and completion must both be strings")
            row = {"prompt": row["prompt"], "completion": row["completion"]}
        elif isinstance(row.get("text"), str):
            row = {"text": row["text"]}
        else:
            raise UserError(f"data: {path}:{lineno}: expected a text, prompt/completion or messages field")
        docs.append(Document(f"{path.name}:{lineno}", path.name, row))
    return docs


def split_documents(
    docs: list[Document], val_files: list[str], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Deterministic split by whole document: by file name if val_files is set, else by hash."""
    if val_files:
        missing = set(val_files) - {d.source for d in docs}
        if missing:
            raise UserError(f"val_files: not found in data: {', '.join(sorted(missing))}")
        val = [d for d in docs if d.source in val_files]
        train = [d for d in docs if d.source not in val_files]
    else:
        def bucket(d: Document) -> float:
            return int(hashlib.sha256(d.doc_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

        val = [d for d in docs if bucket(d) < val_fraction]
        train = [d for d in docs if bucket(d) >= val_fraction]
        if val_fraction > 0 and not val and len(train) > 1:
            # Tiny corpora: hold out the one document closest to the threshold rather than none.
            first = min(train, key=bucket)
            val, train = [first], [d for d in train if d is not first]
    if not train:
        raise UserError("data: every document landed in validation; add data or shrink val_files")
    return train, val


def tokenize_document(doc: Document, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids and a per-token 'is a training target' flag."""
    row = doc.row
    if "text" in row:
        segments = [(row["text"], True)]
    elif "prompt" in row:
        segments = [(row["prompt"], False), (row["completion"], True)]
    else:
        segments = _chat_segments(row["messages"], tokenizer, doc.doc_id)
    ids: list[int] = []
    flags: list[bool] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    templated = "messages" in row  # chat templates place their own bos/eos
    if bos is not None and not templated:
        ids.append(bos)
        flags.append(False)
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        flags.extend([trained] * len(piece))
    if eos is not None and not templated:
        ids.append(eos)
        flags.append(True)  # learning to stop is part of the completion
    return ids, flags


def _chat_segments(messages: list[dict], tokenizer, doc_id: str) -> list[tuple[str, bool]]:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"data: {doc_id} has messages but the tokenizer has no chat template")

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    segments: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix, upto = render(messages[:i], True), render(messages[: i + 1], False)
        if not (prefix.startswith(done) and upto.startswith(prefix)):
            # Template is not prefix-stable: train on the whole conversation rather than guess.
            return [(render(messages, False), True)]
        segments += [(prefix[len(done):], False), (upto[len(prefix):], True)]
        done = upto
    full = render(messages, False)
    if full.startswith(done) and len(full) > len(done):
        segments.append((full[len(done):], False))
    return [(s, t) for s, t in segments if s]


def pack(docs: list[Document], tokenizer, block_size: int,
         bos_per_block: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents and cut into (inputs, targets) blocks of block_size.

    Every token after the first is a target exactly once. A tail shorter than a block (or a corpus
    shorter than one block) becomes a padded block whose padding is masked out, never dropped or a crash.
    With bos_per_block each block is the tokenizer's bos (no target) then block_size - 1 stream tokens.
    """
    if bos_per_block:
        if tokenizer.bos_token_id is None:
            raise UserError("bos_per_block: the tokenizer has no bos token")
        if block_size < 2:
            raise UserError("bos_per_block: needs block_size >= 2")
        inputs, targets = pack(docs, tokenizer, block_size - 1)
        n = len(inputs)
        inputs = torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), inputs], 1)
        targets = torch.cat([torch.full((n, 1), IGNORE, dtype=torch.long), targets], 1)
        return inputs, targets
    stream: list[int] = []
    flags: list[bool] = []
    for doc in docs:
        ids, fl = tokenize_document(doc, tokenizer)
        stream.extend(ids)
        flags.extend(fl)
    if len(stream) < 2:
        raise UserError("data: the documents tokenize to fewer than 2 tokens")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    n_blocks = max(1, -(-(len(stream) - 1) // block_size))
    total = n_blocks * block_size + 1
    ids_t = torch.full((total,), pad, dtype=torch.long)
    ids_t[: len(stream)] = torch.tensor(stream)
    target_ok = torch.zeros(total, dtype=torch.bool)
    target_ok[: len(flags)] = torch.tensor(flags)
    idx = torch.arange(n_blocks)[:, None] * block_size + torch.arange(block_size + 1)[None, :]
    blocks, ok = ids_t[idx], target_ok[idx]
    inputs = blocks[:, :-1].contiguous()
    targets = torch.where(ok[:, 1:], blocks[:, 1:], torch.full_like(blocks[:, 1:], IGNORE))
    return inputs, targets.contiguous()
