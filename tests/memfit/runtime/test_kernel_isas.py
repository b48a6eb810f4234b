"""memfit.runtime.kernels' sources compile for the vector width this host does not build: csrc/vec16.h's v16 is a
zmm register with AVX-512 and two ymm ones without, and the kernels pick tile sizes by it (#ifdef __AVX512F__).
The build only compiles its own (-march=native), so an AVX-512 host never sees the AVX2 branches and the other way
round; nor does a host with AVX512-VNNI see the AVX-512 branches without it (int4_decode.h's vpdpwssd rows)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from memfit.runtime import kernels


def test_kernel_sources_compile_for_the_other_vector_width():
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").is_file() else []
    # AVX2 only, or AVX-512 with BF16, VNNI and AMX: whichever this host is not; on AVX-512 hosts also AVX-512
    # without VNNI, VBMI and BF16 (Skylake-X) for the files that branch on those
    texts = {s: s.read_text() for s in kernels.SOURCES}
    branched = [s for s, t in texts.items() if "__AVX512" in t]  # the files with ISA branches
    assert branched
    if "avx512f" in flags:
        builds = [("haswell", s) for s in branched]
        builds += [("skylake-avx512", s) for s, t in texts.items() if "__AVX512VNNI__" in t or "int4_decode.h" in t]
    else:
        builds = [("sapphirerapids", s) for s in branched]
    inc = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    procs = [subprocess.Popen([gxx, "-std=c++20", "-fopenmp", f"-march={march}", "-fsyntax-only", *inc,
                               "-DTORCH_EXTENSION_NAME=memfit_syntax_check", str(src)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for march, src in builds]
    errors = [f"-march={march} {src.name}:\n{out}" for (march, src), p in zip(builds, procs, strict=True)
              if (out := p.communicate()[0]) is not None and p.returncode != 0]
    assert not errors, "\n".join(errors)[-4000:]
