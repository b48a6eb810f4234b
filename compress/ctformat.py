"""The compressed-tensors `pack-quantized` on-disk layout, so plain transformers can load our output.

Per quantized Linear `name`: `name.weight_packed` int32 (out, ceil(in*bits/32)), `name.weight_scale`
fp16 (out, in/group), `name.weight_shape` int64 [out, in] and, when asymmetric,
`name.weight_zero_point` int32 (zero points packed along dim 0, zero-padded to (out, in/group)
rows: the shape transformers allocates). config.json gets a
`quantization_config` with quant_method "compressed-tensors", format "pack-quantized" and one
config group per (bits, group size, symmetry), targeting exact module names; memfit's own record
(method, skipped modules, per-layer group-size fallbacks, format version) sits under "memfit".
"""

from __future__ import annotations

import re
from typing import Any

import torch

from compress.packing import pack_int32, packed_cols, unpack_int32
from compress.quant import QuantArgs, Quantized
from memfit.errors import UserError

FORMAT_VERSION = 1


def tensors_for(name: str, q: Quantized) -> dict[str, torch.Tensor]:
    out, cols = q.codes.shape
    t = {
        f"{name}.weight_packed": pack_int32(q.codes, q.bits),
        f"{name}.weight_scale": q.scale.to(torch.float16).contiguous(),
        f"{name}.weight_shape": torch.tensor([out, cols], dtype=torch.int64),
    }
    if not q.sym:
        zp = pack_int32(q.zero, q.bits, dim=0)  # (ceil(out*bits/32), n_groups)
        # transformers 5 + compressed-tensors 0.20 allocate weight_zero_point as (out, n_groups) int32 and
        # unpack its leading words, so the packed words are zero-padded to that shape to load unmodified
        t[f"{name}.weight_zero_point"] = torch.cat([zp, zp.new_zeros(out - zp.shape[0], zp.shape[1])])
    return t


def stored_bytes(out: int, cols: int, args: QuantArgs) -> int:
    """Bytes tensors_for writes for an (out, cols) weight quantized with args: packed int32 codes, fp16 scales,
    the int64 shape pair and (asymmetric) the zero-padded int32 zero points. A size budget adds these up."""
    groups = cols // args.group_size
    n = out * packed_cols(cols, args.bits) * 4 + out * groups * 2 + 2 * 8
    return n if args.sym else n + out * groups * 4


def read_quantized(get, name: str, args: QuantArgs) -> Quantized:
    """Inverse of tensors_for; get(key) returns a tensor."""
    shape = [int(v) for v in get(f"{name}.weight_shape").tolist()]
    if len(shape) != 2:
        raise UserError(f"{name}.weight_shape: expected 2 dims, got {shape}")
    out, cols = shape
    codes = unpack_int32(get(f"{name}.weight_packed"), args.bits, cols)
    if codes.shape[0] != out:
        raise UserError(f"{name}.weight_packed: {codes.shape[0]} rows, weight_shape says {out}")
    scale = get(f"{name}.weight_scale").float()
    if tuple(scale.shape) != (out, cols // args.group_size):
        raise UserError(f"{name}.weight_scale: shape {tuple(scale.shape)} does not fit group size {args.group_size}")
    if args.sym:
        zero = torch.full_like(scale, 2 ** (args.bits - 1)).to(torch.uint8)
    else:
        zp = get(f"{name}.weight_zero_point")[: packed_cols(out, args.bits)]
        zero = unpack_int32(zp, args.bits, out, dim=0)
    return Quantized(codes, scale, zero, args.bits, args.group_size, args.sym)


def quantization_config(per_module: dict[str, QuantArgs], memfit: dict[str, Any]) -> dict[str, Any]:
    groups: dict[QuantArgs, list[str]] = {}
    for name, a in sorted(per_module.items()):
        groups.setdefault(a, []).append(name)
    config_groups = {}
    for i, (a, names) in enumerate(sorted(groups.items(), key=lambda kv: -len(kv[1]))):
        config_groups[f"group_{i}"] = {
            "targets": [f"re:^{re.escape(n)}$" for n in names],
            "weights": {"num_bits": a.bits, "type": "int", "symmetric": a.sym, "strategy": "group",
                        "group_size": a.group_size, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(memfit.get("skipped", [])),
        "kv_cache_scheme": None,
        "memfit": {"format_version": FORMAT_VERSION, **memfit},
    }


def parse_config(qc: dict[str, Any], module_names: list[str]) -> dict[str, QuantArgs]:
    """Module name -> QuantArgs for every module a config group targets (names or `re:` patterns)."""
    if qc.get("format") not in (None, "pack-quantized"):
        raise UserError(f"compressed-tensors format {qc.get('format')!r} is not supported (only pack-quantized)")
    ignore = set(qc.get("ignore") or [])
    result: dict[str, QuantArgs] = {}
    for gname, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if group.get("format", "pack-quantized") != "pack-quantized" or w.get("type", "int") != "int":
            raise UserError(f"config group {gname}: only int pack-quantized weights are supported")
        if w.get("strategy") != "group" or group.get("input_activations"):
            raise UserError(f"config group {gname}: only weight-only group quantization is supported")
        args = QuantArgs(int(w["num_bits"]), int(w["group_size"]), bool(w.get("symmetric", True)))
        for target in group.get("targets", []):
            for n in module_names:
                if n in ignore:
                    continue
                hit = re.match(target[3:], n) if target.startswith("re:") else n == target or target == "Linear"
                if hit:
                    result[n] = args
    return result
