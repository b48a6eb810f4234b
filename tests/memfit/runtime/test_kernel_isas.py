"""memfit.runtime.kernels' sources compile for the vector width this host does not build: csrc/vec16.h's v16 is a
zmm register with AVX-512 and two ymm ones without, and the kernels pick tile sizes by it (#ifdef __AVX512F__).
The build only compiles its own (-march=native), so an AVX-512 host never sees the AVX2 branches and the other way
round."""

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
    # AVX2 only, or AVX-512 with BF16, VNNI and AMX: whichever this host is not
    march = "haswell" if "avx512f" in flags else "sapphirerapids"
    branched = [s for s in kernels.SOURCES if "__AVX512" in s.read_text()]  # the files with ISA branches
    assert branched
    inc = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    procs = [subprocess.Popen([gxx, "-std=c++20", "-fopenmp", f"-march={march}", "-fsyntax-only", *inc,
                               "-DTORCH_EXTENSION_NAME=memfit_syntax_check", str(src)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for src in branched]
    errors = [f"{src.name}:\n{out}" for src, p in zip(branched, procs, strict=True)
              if (out := p.communicate()[0]) is not None and p.returncode != 0]
    assert not errors, f"-march={march}:\n" + "\n".join(errors)[-4000:]
