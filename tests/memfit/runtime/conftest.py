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


def tiny_gemma3(layer_types: list[str], window: int, head_dim: int = 32, **cfg):
    """A random Gemma 3 text model of ``layer_types`` (sliding / full), two RoPE bases, norm weights that matter
    (HF initializes Gemma's (1 + w) norms at 0); ``cfg``: the other Gemma3TextConfig fields."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**cfg, num_hidden_layers=len(layer_types), head_dim=head_dim, sliding_window=window,
                              layer_types=layer_types, query_pre_attn_scalar=head_dim, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0, 0.3)
    return model


def int4_rounds_decode_x() -> bool:
    """Whether this build's int4_linear rounds 1-4 rows of x to int16 per group before vpdpwssd (AVX512-VNNI + VBMI
    builds, 64-row blocks: csrc/int4_decode.h)."""
    from memfit.runtime import kernels

    return kernels.load("on").int4_decode_int16() and kernels.int4_block() == 64
