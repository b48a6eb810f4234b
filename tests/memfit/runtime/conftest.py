"""The runtime's tests share serve's set-up: the kernels built once per session, one intra-op thread."""

from tests.serve.conftest import _cpu_kernels_built, _single_thread  # noqa: F401 - autouse fixtures


def check_steps(sm, seqs: dict, refs: dict, steps: list[list[tuple[int, int, int, bool]]]) -> None:
    """Run ``steps`` on SlotModel ``sm``: each step a list of (slot, start, length, want_logits) over the token ids
    ``seqs[slot]``; every wanted row must match the HF logits ``refs[slot][start + length - 1]`` (1e-4)."""
    import torch

    from memfit.runtime.slot_model import Segment

    for step in steps:
        ids = torch.cat([seqs[s][st:st + n] for s, st, n, _ in step])
        out = sm.forward(ids, [Segment(s, st, n, w) for s, st, n, w in step])
        wanted = [(s, st + n - 1) for s, st, n, w in step if w]
        assert len(out) == len(wanted)
        for row, (s, pos) in zip(out, wanted, strict=True):
            torch.testing.assert_close(row, refs[s][pos], atol=1e-4, rtol=1e-4)
