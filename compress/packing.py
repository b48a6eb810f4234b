"""Bit packing in the compressed-tensors `pack-quantized` layout (dense, little-endian within int32 words).

Element i of a row sits at bit position i*bits of the row's bit stream; 32 elements fill exactly `bits`
int32 words. For 4 bits this is 8 nibbles per int32, i.e. two 4-bit values per byte. Codes here are
unsigned (0 .. 2**bits-1), which equals compressed-tensors' signed value + 2**(bits-1).
"""

from __future__ import annotations

import math

import torch

_ROW_CHUNK = 256


def packed_cols(cols: int, bits: int) -> int:
    return math.ceil(cols * bits / 32)


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    rows, cols = v.shape
    pad = (-cols) % 32
    if 32 % bits == 0:  # no value straddles two words: shift and sum
        per = 32 // bits
        v = torch.nn.functional.pad(v.to(torch.int64), (0, pad)).view(rows, -1, per)
        words = (v << (torch.arange(per) * bits)).sum(-1)[:, : packed_cols(cols, bits)]
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    v = torch.nn.functional.pad(v.to(torch.int64), (0, pad)).view(rows, -1, 32)
    groups = v.shape[1]
    bit = (v.unsqueeze(-1) >> torch.arange(bits)) & 1  # (rows, G, 32 elements, bits)
    bit = bit.reshape(rows, groups, bits, 32)  # regrouped as (words, 32 bit positions)
    words = (bit << torch.arange(32)).sum(-1).view(rows, groups * bits)[:, : packed_cols(cols, bits)]
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack unsigned integer codes (2-D) along `dim` into int32 words."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if codes.ndim != 2:
        raise ValueError("pack_int32 expects a 2-D tensor")
    if int(codes.min()) < 0 or int(codes.max()) >= 2**bits:
        raise ValueError(f"codes out of range for {bits} bits")
    if dim == 0:
        return pack_int32(codes.t(), bits, 1).t().contiguous()
    out = [_pack_rows(codes[i : i + _ROW_CHUNK], bits) for i in range(0, codes.shape[0], _ROW_CHUNK)]
    return torch.cat(out).contiguous()


def _unpack_rows(w: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    rows, nwords = w.shape
    if 32 % bits == 0:
        per = 32 // bits
        vals = (w.to(torch.int64).unsqueeze(-1) >> (torch.arange(per) * bits)) & (2**bits - 1)
        return vals.reshape(rows, nwords * per)[:, :cols].to(torch.uint8)
    need = math.ceil(nwords / bits) * bits
    w = torch.nn.functional.pad(w.to(torch.int64) & 0xFFFFFFFF, (0, need - nwords)).view(rows, -1, bits)
    groups = w.shape[1]
    bit = (w.unsqueeze(-1) >> torch.arange(32)) & 1  # (rows, G, bits words, 32)
    bit = bit.reshape(rows, groups, 32, bits)
    vals = (bit << torch.arange(bits)).sum(-1).reshape(rows, groups * 32)[:, :cols]
    return vals.to(torch.uint8)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: `cols` is the unpacked size along `dim`. Returns uint8 codes."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    if dim == 0:
        return unpack_int32(packed.t(), bits, cols, 1).t().contiguous()
    if packed.shape[1] != packed_cols(cols, bits):
        raise ValueError(f"packed width {packed.shape[1]} does not match {cols} columns of {bits} bits")
    out = [_unpack_rows(packed[i : i + _ROW_CHUNK], bits, cols) for i in range(0, packed.shape[0], _ROW_CHUNK)]
    return torch.cat(out).contiguous()
