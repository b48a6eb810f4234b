"""memfit.heap: glibc's mmap threshold and trim, measured in a subprocess (the settings are process-wide)."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLIBC = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="glibc's mallopt")


_FREED_RSS = """
import sys, torch
from memfit.heap import map_large_allocations, release_free_memory


def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024


applied = map_large_allocations() if sys.argv[1] == "fixed" else None
big = torch.ones(6 * 2**20); del big  # 24 MiB: mmapped, then freed: lifts the dynamic threshold to 24 MiB
mid = torch.ones(4 * 2**20)  # 16 MiB, touched
keep = torch.ones(1024)  # allocated after it, so the heap top cannot simply shrink
before = rss(); del mid
freed = before - rss()
release_free_memory()
print(applied, freed / 2**20, (before - rss()) / 2**20)
"""


@GLIBC
@pytest.mark.parametrize("mode, returned", [("fixed", True), ("dynamic", False)])
def test_large_cpu_allocations_leave_rss_when_freed(mode, returned):
    """With the fixed mmap threshold a freed 16 MiB tensor leaves RSS at once; glibc's default (the control)
    keeps it on the heap once a larger block was freed (the case the training loop hits after step 1) until
    release_free_memory() trims the heap (what serve does after loading)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", _FREED_RSS, mode], capture_output=True, text=True, env=env,
                         cwd=ROOT, check=True).stdout.split()
    assert out[0] == ("True" if mode == "fixed" else "None")
    assert (float(out[1]) >= 15) is returned, out
    assert float(out[2]) >= 15, out  # a trim hands back what the heap kept
