"""Tensor-parallel serving: ``torchrun --nproc-per-node N -m serve --tp N``.

transformers shards the model (``tp_plan="auto"``: q/k/v/gate/up column-wise, o/down row-wise with an
all-reduce, lm_head gathered), so every rank holds 1/N of each layer and of the KV cache. Rank 0 runs
the HTTP server and the unchanged engine; its SlotModel is wrapped by :class:`Driver`, which broadcasts
each step's batch (token ids + segments, as int64 tensors) before running it, and ranks 1..N-1 run the
same step in :func:`worker_loop`. The collectives inside the forward then pair up rank by rank.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from memfit.errors import UserError
from memfit.runtime.slot_model import Segment, SlotModel

log = logging.getLogger("serve.tp")
_STOP = -1


def init(tp: int) -> int:
    """Join the torchrun group (gloo on CPU, NCCL on GPU); returns this process's rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp:
        raise UserError(f"--tp {tp} needs {tp} processes: run `torchrun --nproc-per-node {tp} -m serve --tp {tp} "
                        f"...` (WORLD_SIZE is {world})")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _send(input_ids: torch.Tensor | None, segments: list[Segment] | None) -> None:
    dev = _device()
    if input_ids is None:
        dist.broadcast(torch.tensor([_STOP, 0], device=dev), src=0)
        return
    seg = [x for s in segments for x in (s.slot, s.start, s.length, int(s.want_logits))]
    dist.broadcast(torch.tensor([input_ids.numel(), len(segments)], device=dev), src=0)
    dist.broadcast(torch.tensor(input_ids.tolist() + seg, dtype=torch.long, device=dev), src=0)


def _receive() -> tuple[torch.Tensor, list[Segment]] | None:
    dev = _device()
    head = torch.empty(2, dtype=torch.long, device=dev)
    dist.broadcast(head, src=0)
    n, m = (int(x) for x in head.tolist())
    if n == _STOP:
        return None
    body = torch.empty(n + 4 * m, dtype=torch.long, device=dev)
    dist.broadcast(body, src=0)
    body = body.cpu()
    segs = [Segment(*(int(v) for v in body[n + 4 * i:n + 4 * i + 3]), bool(body[n + 4 * i + 3]))
            for i in range(m)]
    return body[:n].clone(), segs


class Driver:
    """Rank 0's SlotModel: the same interface, each forward broadcast to the workers first."""

    def __init__(self, sm: SlotModel):
        self.sm = sm
        self.closed = False

    def __getattr__(self, name: str):
        return getattr(self.sm, name)

    def forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        _send(input_ids, segments)
        return self.sm.forward(input_ids, segments)

    def close(self) -> None:
        """Tell the workers to exit (rank 0 is shutting down)."""
        if not self.closed:
            self.closed = True
            _send(None, None)


def finish() -> None:
    """Leave the process group before the interpreter exits: a gloo group left to interpreter teardown aborted
    rank 0 now and then ("terminate called without an active exception", SIGABRT, after a clean shutdown)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def worker_loop(sm: SlotModel) -> None:
    """Ranks 1..N-1: run every step rank 0 broadcasts, until it says stop."""
    steps = 0
    while True:
        msg = _receive()
        if msg is None:
            log.info("rank %d: stop after %d steps", dist.get_rank(), steps)
            return
        try:
            sm.forward(*msg)
        except ValueError as e:  # rank 0 raised the same (bad positions are checked before any collective)
            log.warning("rank %d: step failed like on rank 0: %s", dist.get_rank(), e)
        steps += 1
