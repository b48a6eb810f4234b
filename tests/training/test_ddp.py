"""Two CPU processes (torchrun, gloo) give the same losses as one process at the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import TINY_MODEL, read_metrics


def _args(corpus, out, **extra):
    values = {"model_config": json.dumps(TINY_MODEL), "vocab_size": 320, "data": str(corpus), "block_size": 32,
              "max_steps": 4, "eval_every": 2, "save_every": 2, "log_every": 1, "lr": 3e-3, "output_dir": str(out),
              "val_files": "[doc0.txt]"}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, corpus):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    one = tmp_path / "one"
    # global batch 8 both ways: 1 process x 4 x accum 2  vs  2 processes x 4 x accum 1
    subprocess.run([sys.executable, "-m", "training", *_args(corpus, one, batch_size=4, grad_accum=2)],
                   check=True, env=env, capture_output=True)
    two = tmp_path / "two"
    # the 1-process run trained the tokenizer; share it so both runs see the same token ids
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
           "-m", "training", *_args(corpus, two, batch_size=4, grad_accum=1, tokenizer_path=str(one / "tokenizer"))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-4, (ra, rb)
        assert ra["tokens"] == rb["tokens"]
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) < 1e-4
