"""memfit.runtime.kernels' build: a build killed mid-way is redone by the next start, builds started together
both end with the extension, and the CLI that `make install` runs exits 2 naming the reason when it cannot build.

On a tiny extension of one function (the mechanism is the same for memfit's kernels; theirs take ~1 min)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = """#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""
BUILD = """import sys, torch
from memfit.runtime.kernels import build_locked
m = build_locked(sys.argv[1], [sys.argv[2]], verbose=False)
assert m.twice(torch.ones(2)).tolist() == [2.0, 2.0]
print("built")
"""


def _env(ext_dir: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "MAX_JOBS": "1"}


def _start(tmp_path: Path, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD, name, str(tmp_path / "twice.cpp")],
                            env=_env(tmp_path / "ext"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_killed_build_is_redone_and_concurrent_builds_both_finish(tmp_path):
    (tmp_path / "twice.cpp").write_text(SRC)
    first = _start(tmp_path, "memfit_test_twice")
    deadline = time.time() + 60
    baton = None
    while time.time() < deadline and first.poll() is None:  # kill it once torch's own build lock is taken
        found = list((tmp_path / "ext").rglob("memfit_test_twice/lock"))
        if found:
            baton = found[0]
            break
        time.sleep(0.05)
    assert baton is not None, "the build never started"
    first.kill()
    first.wait()
    assert baton.exists()  # torch's lock file is left behind: without memfit's flock every later build would hang
    a, b = _start(tmp_path, "memfit_test_twice"), _start(tmp_path, "memfit_test_twice")
    for p in (a, b):
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0 and "built" in out, out


def test_the_install_build_exits_2_with_the_reason_when_the_compiler_is_missing(tmp_path):
    env = {**_env(tmp_path / "ext"), "CXX": str(tmp_path / "no-such-compiler")}
    r = subprocess.run([sys.executable, "-m", "memfit.runtime.kernels"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "building memfit's CPU kernels" in r.stderr and "--cpu-kernels off" in r.stderr
