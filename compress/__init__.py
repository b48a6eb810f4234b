"""memfit compress: quantization, pruning and low-rank factorization (see the compress issues)."""
