"""Byte sizes as users write them (`2GiB`, `512MiB`, `1.5GiB`, a plain byte count) for every memory flag and key:
serve's `--kv-cache-memory`, train's `activation_budget`. Decimal units (`2GB`) are refused rather than guessed
at (2 x 10^9 or 2 x 2^30?), as are zero, negatives and non-numbers."""

from __future__ import annotations

import re

from memfit.errors import UserError

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int, flag: str) -> int:
    """`"2GiB"`, `"512MiB"`, `"1.5GiB"`, `"4096"` or an int -> bytes; a UserError naming `flag` otherwise."""
    n = 0
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    elif isinstance(text, str) and (m := _SIZE.fullmatch(text)) and m[2].lower() in _UNITS:
        n = int(float(m[1]) * _UNITS[m[2].lower()])
    if n <= 0:
        raise UserError(f"{flag}: {text!r} is not a size: give a positive byte count or KiB/MiB/GiB/TiB "
                        f"(e.g. 2GiB, 512MiB)")
    return n


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
