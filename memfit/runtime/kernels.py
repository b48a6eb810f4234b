"""Fused CPU kernels for SlotModel (``csrc``: per-layer glue, fp32 and 4-bit Linears; also compress's
per-group clipping search, ``quant_search.cpp``), built on first use.

Why our own: after the Linears, a decode step's time went to many small ATen ops, each a dispatch and a pass
over memory. Per layer of the serving benchmark's 33.7M Llama at batch 16 (2 threads, medians of 100 calls):

- decode attention over the slot cache, cold cache as in a step: SDPA 491 us, ours 206 us (SDPA's CPU
  flash kernel splits the few query rows into blocks and re-reads each KV row per query head; ours reads
  each key and value row once for the query heads that share it);
- RMSNorm: 21 us (``F.rms_norm`` runs as pow/mean/add/rsqrt/mul on CPU), ours 3.5 us; at batch 1 18 vs 2 us;
- RoPE on q and k plus the two KV cache writes: 80 us (cat, 4 elementwise ops, 2 index_put), ours 24 us.

It also holds the fp32 Linear kernel on a panel layout (memfit.runtime.dense.PanelLinear: measurements there) and a
4-bit Linear on torch's own CPU int4 pack (memfit.runtime.fuse): on the 40 Linear shapes of that model as a compress
4-bit output (group 128, streamed from memory, fp32 in and out), aten's kernel vs ours: M = 1 2.07 vs 1.30 ms,
M = 4 2.99 vs 2.06, M = 16 10.2 vs 8.1, M = 64 33.6 vs 23.2, M = 256 126 vs 85. At 1-4 rows the scale and
zero are applied once per group (codes times x summed unscaled): 0.84x / 0.94x of dequantizing each weight
at 1 / 4 rows.

Outputs equal the torch ops to fp32 rounding (max |diff| ~1e-6). A SiLU*up kernel was dropped: GCC left its
``exp`` scalar, 3-5x slower than torch's vectorized one at 16 rows or more.

Built with ``torch.utils.cpp_extension.load`` (the system C++ compiler and ninja, ``-O3 -march=native``:
the machine that runs it compiles it) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), under a name hashed from the sources, their folder and the torch version, so
checkouts and versions never rebuild over each other's build: ~40-60 s once each, then a load. ``make install``
builds them ahead of time (``python -m memfit.runtime.kernels``), so the first request never pays for it.

Builds are serialized by an OS file lock (released when its process dies, however it dies), under which a lock
file torch's own build left behind (a build killed mid-way) is removed: two servers starting together both
end with the kernels, and an interrupted build is redone by the next start instead of leaving every later one
waiting or running without them. A failed build is an error naming the compiler's message (``auto`` and
``on`` alike: a server never starts silently several times slower); ``--cpu-kernels off`` runs torch ops.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import ModuleType

from memfit.errors import UserError

MODES = ("auto", "on", "off")
CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "layer_ops.cpp", CSRC / "attention.cpp", CSRC / "linear.cpp", CSRC / "int4.cpp",
           CSRC / "stack.cpp", CSRC / "quant_search.cpp", CSRC / "cpu_peak.cpp")


def extension_name() -> str:
    """The kernels' extension name: hashed from the sources, their folder and the torch version."""
    import hashlib

    import torch

    h = hashlib.sha256(f"{CSRC.resolve()}|{torch.__version__}".encode())
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return f"memfit_ops_{h.hexdigest()[:12]}"


def build_locked(name: str, sources: list[str], **kwargs) -> ModuleType:
    """``torch.utils.cpp_extension.load`` under an exclusive ``flock`` on the build directory, after removing
    the lock file of a torch build that was killed (torch's ``FileBaton`` is a plain file that nobody removes
    then, so every later build would wait on it forever)."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory, load

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "memfit.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the OS releases it when this process exits or is killed
        (build_dir / "lock").unlink(missing_ok=True)  # only a dead build can own it while we hold ours
        return load(name, sources, build_directory=str(build_dir), **kwargs)


@functools.cache
def _build() -> ModuleType | Exception:
    """Build (or load the cached build) once per process; a failure is remembered, not retried per model."""
    try:
        return build_locked(extension_name(), [str(f) for f in SOURCES],
                            extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                            verbose=False)
    except Exception as e:  # compiler, ninja or headers missing, or a failed build
        return e


@functools.cache
def int4_block() -> int | None:
    """The row-block size of torch's CPU int4 pack that ``int4_linear`` reads (64 on AVX-512 builds, 32 on AVX2),
    probed by packing a known matrix; None where the layout is neither (aten's kernel is used then)."""
    import torch

    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if pack is None:
        return None
    n, k = 128, 16
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        got = pack(codes, 8).contiguous().view(torch.uint8).flatten()
    except RuntimeError:
        return None
    for b in (64, 32):
        blocks = codes.view(n // b, b, k).transpose(1, 2)  # [n / b, k, b]
        want = blocks[..., :b // 2] | (blocks[..., b // 2:] << 4)
        if torch.equal(want.flatten().to(torch.uint8), got):
            return b
    return None


def _reason(e: Exception) -> str:
    """The lines of a failed build that say why (the compiler's errors), not ninja's whole log."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "not found" in ln.lower()]
    return "\n".join((errors or lines or [type(e).__name__])[:8])


def load(mode: str) -> ModuleType | None:
    """The compiled kernels for ``mode`` (auto | on: build or load them, a failure is a UserError; off: None,
    torch ops are used)."""
    if mode not in MODES:
        raise UserError(f"--cpu-kernels must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return None
    built = _build()
    if not isinstance(built, Exception):
        return built
    raise UserError(f"--cpu-kernels {mode}: building memfit's CPU kernels (memfit/runtime/csrc) failed; install a "
                    f"C++ compiler (g++) and ninja, or pass --cpu-kernels off to run on torch ops (several times "
                    f"slower):\n{_reason(built)}") from built


def built() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (for callers with a torch fallback that gives the
    same result, slower: compress's clipping search)."""
    b = _build()
    return None if isinstance(b, Exception) else b


def main(argv: list[str] | None = None) -> int:
    """``python -m memfit.runtime.kernels``: build the kernels now (``make install`` does), exit 2 if that fails."""
    import time

    t0 = time.perf_counter()
    try:
        ops = load("on")
    except UserError as e:
        print(f"memfit.runtime.kernels: error: {e}", file=sys.stderr)
        return 2
    print(f"memfit CPU kernels ready ({extension_name()}, {time.perf_counter() - t0:.1f} s): {ops.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
