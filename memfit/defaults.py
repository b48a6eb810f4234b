"""Defaults that more than one stage uses, each stated once (flags, recipes and benchmarks read them here)."""

from __future__ import annotations

from pathlib import Path

from memfit.errors import UserError

# The shipped default model (models/), used when a command is given none.
DEFAULT_MODEL = "models/shakespeare-llama"

# Context per sequence when the user sets none: the model's max_position_embeddings, capped here because
# the KV cache grows with it (a 128k-context model would otherwise reserve its whole window per slot).
MAX_SEQ_LEN_CAP = 2048
FALLBACK_MAX_POSITIONS = 2048  # a config without max_position_embeddings

# Calibration for the methods that need it (GPTQ, AWQ, Wanda, SparseGPT, SVD-LLM): sequences x tokens.
CALIB_SAMPLES = 128
CALIB_SEQLEN = 512

# Input columns that share one quantization scale.
GROUP_SIZE = 128
# ... in a 4-bit vocabulary table (--quantize-embeddings int4). Gemma 3 270M's tied table, RTN asymmetric, mean
# per-token KL to fp32 on 1024 held-out tokens: groups of 128 0.283, 32 0.150, 16 0.099 (int8 rows: 0.010).
TABLE_GROUP_SIZE = 32


def default_model() -> str:
    """The shipped model: relative to the working directory where it is there, else to this checkout."""
    repo = Path(__file__).resolve().parent.parent / DEFAULT_MODEL
    return str(repo) if repo.is_dir() and not Path(DEFAULT_MODEL).is_dir() else DEFAULT_MODEL


def max_positions(config: dict | object) -> int:
    """The model's context window from its config (a dict or a transformers config object)."""
    v = config.get("max_position_embeddings") if isinstance(config, dict) else \
        getattr(config, "max_position_embeddings", None)
    return int(v or FALLBACK_MAX_POSITIONS)


def max_seq_len(config: dict | object, requested: int | None, flag: str = "--max-seq-len") -> int:
    """Context per sequence: ``requested``, or min(the model's window, MAX_SEQ_LEN_CAP); refuses values below
    2 or past the model's window, naming ``flag``."""
    window = max_positions(config)
    if requested is None:
        return min(window, MAX_SEQ_LEN_CAP)
    if requested < 2:
        raise UserError(f"{flag} must be >= 2, got {requested}")
    if requested > window:
        raise UserError(f"{flag} {requested} exceeds the model's max_position_embeddings {window}")
    return requested
