"""memfit.runtime.kernels: fused CPU kernels vs the torch ops they replace, input checks, fallback. The KV-cache
kernels run on the static slot layout and on paged layouts (blocks in shuffled order, spare blocks between)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memfit.errors import UserError
from memfit.runtime import kernels


@pytest.fixture(scope="module")
def ops():
    return kernels.load("on")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


LAYOUTS = [None, 4, 16]  # static slots; paged in blocks of 4 and 16 positions


def _paged(caches: list[torch.Tensor], bs: int | None, fill: float | None = None):
    """Logical caches [B, KV, S, D] laid out as the kernels read them: (physical caches, block table). Static (bs
    None): as they are, table[s, 0] = s. Paged: blocks of ``bs`` positions at shuffled physical ids, with spare
    blocks of noise (or ``fill``) that no table entry names."""
    B, KV, S, _ = caches[0].shape
    if bs is None:
        return caches, torch.arange(B)[:, None]
    nb = -(-S // bs)
    table = torch.randperm(B * nb + 3)[:B * nb].view(B, nb)
    out = []
    for c in caches:
        D = c.shape[-1]
        phys = torch.randn(B * nb + 3, KV, bs, D) if fill is None else torch.full((B * nb + 3, KV, bs, D), fill)
        c = F.pad(c, (0, 0, 0, nb * bs - S))
        phys[table.reshape(-1)] = c.view(B, KV, nb, bs, D).transpose(1, 2).reshape(B * nb, KV, bs, D)
        out.append(phys)
    return out, table


def _logical(phys: torch.Tensor, table: torch.Tensor, S: int) -> torch.Tensor:
    """The physical cache read back as [B, KV, S, D] through the block table."""
    g = phys[table]  # [B, nb, KV, bs, D]
    return g.transpose(1, 2).reshape(g.shape[0], g.shape[2], -1, g.shape[4])[:, :, :S]


def test_rms_norm_matches_torch(ops):
    torch.manual_seed(0)
    for shape in [(1, 512), (3, 7, 64), (33, 100)]:
        x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (shape[-1],), w, 1e-6),
                                   atol=1e-5, rtol=1e-5)
    xt = torch.randn(64, 5).t()  # non-contiguous input
    w = torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(xt, w, 1e-5), F.rms_norm(xt, (64,), w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", LAYOUTS)
def test_rope_store_matches_torch(ops, bs):
    torch.manual_seed(1)
    T, H, KV, D, B, S = 5, 4, 2, 16, 3, 20
    heads = torch.randn(T, H + 2 * KV, D)
    cos, sin = torch.randn(T, 1, D), torch.randn(T, 1, D)
    slots, pos = torch.tensor([2, 0, 0, 1, 2]), torch.tensor([0, 3, 4, 19, 7])
    (kc, vc), table = _paged([torch.zeros(B, KV, S, D), torch.zeros(B, KV, S, D)], bs, fill=0.0)
    qk = heads[:, :H + KV]
    want = qk * cos + _rotate_half(qk) * sin
    v = heads[:, H + KV:].clone()
    ops.rope_store(heads, cos, sin, H + KV, H, H + KV, kc, vc, table, slots, pos)
    torch.testing.assert_close(heads[:, :H + KV], want, atol=1e-6, rtol=1e-6)
    kl, vl = _logical(kc, table, S), _logical(vc, table, S)
    torch.testing.assert_close(kl[slots, :, pos], want[:, H:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vl[slots, :, pos], v, atol=0, rtol=0)
    assert kc.abs().sum(-1).count_nonzero() == T * KV  # nothing else written


def test_rope_store_with_qk_norms_norms_each_head_first(ops):
    # qwen3 / Gemma 3: an RMSNorm per query and key head (their own weights and eps) before RoPE; v untouched
    torch.manual_seed(7)
    T, H, KV, D, B, S = 6, 4, 2, 32, 2, 16
    heads = torch.randn(T, H + 2 * KV, D) * 3
    cos, sin = torch.randn(T, 1, D), torch.randn(T, 1, D)
    slots, pos = torch.tensor([0, 1, 1, 0, 1, 0]), torch.tensor([0, 3, 4, 15, 7, 2])
    qw, kw = torch.randn(D), torch.randn(D)
    q = F.rms_norm(heads[:, :H], (D,), qw, 1e-6)
    k = F.rms_norm(heads[:, H:H + KV], (D,), kw, 1e-2)
    qk = torch.cat((q, k), dim=1)
    want = qk * cos + _rotate_half(qk) * sin
    v = heads[:, H + KV:].clone()
    kc, vc = torch.zeros(B, KV, S, D), torch.zeros(B, KV, S, D)
    table = torch.arange(B)[:, None]
    ops.rope_store(heads, cos, sin, H + KV, H, H + KV, kc, vc, table, slots, pos, qw, 1e-6, kw, 1e-2)
    torch.testing.assert_close(heads[:, :H + KV], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[slots, :, pos], want[:, H:], atol=1e-5, rtol=1e-5)
    assert torch.equal(vc[slots, :, pos], v) and torch.equal(heads[:, H + KV:], v)
    with pytest.raises(RuntimeError, match="q_norm"):
        ops.rope_store(heads, cos, sin, H + KV, H, H + KV, kc, vc, table, slots, pos, torch.randn(D + 1), 1e-6)


@pytest.mark.parametrize("bs", LAYOUTS)
@pytest.mark.parametrize("H,KV,D", [(4, 4, 32), (8, 4, 32), (8, 2, 64), (6, 1, 32), (4, 2, 24)])
def test_decode_attention_matches_sdpa(ops, H, KV, D, bs):
    # D = 24: the scalar path (head dims that are not a multiple of 16); lengths 1, 40 and 17 leave tails
    torch.manual_seed(2)
    B, S = 4, 40
    kc, vc = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    (kp, vp), table = _paged([kc, vc], bs)
    q = torch.randn(3, H + 2, D)[:, :H]  # a strided view, as the fused qkv output gives it
    slots, lens = torch.tensor([3, 0, 2]), torch.tensor([1, 40, 17])
    out = ops.decode_attention(q, kp, vp, table, slots, lens, 0.3)
    for i in range(3):
        s, n = int(slots[i]), int(lens[i])
        ref = F.scaled_dot_product_attention(q[i][None, :, None], kc[s:s + 1, :, :n], vc[s:s + 1, :, :n],
                                             scale=0.3, enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", LAYOUTS)
@pytest.mark.parametrize("window,D", [(0, 64), (600, 64), (0, 24)])
def test_decode_attention_merges_a_long_sequence_split_into_items(ops, window, D, bs):
    # items of at least 256 rows: the 700-position sequence is read as 3 ranges (without a window) whose partial
    # softmaxes are merged, at 2 threads and at 1
    kc, vc, kp, vp, table, q = _decode_case(7, 3, 720, D, bs)
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([700, 1, 300])
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (2, 1):
            torch.set_num_threads(t)
            outs.append(ops.decode_attention(q, kp, vp, table, slots, lens, 0.2, window))
    finally:
        torch.set_num_threads(threads)
    for i in range(3):
        ref = _decode_ref(q[i], kc, vc, int(slots[i]), int(lens[i]), window, 0.2)
        for out in outs:
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 100])
def test_decode_attention_splits_a_short_sequence_alone_between_the_threads(ops, window):
    # fewer rows than 256 a thread: a sequence of 150 is split in the threads' shares (80 and 70 rows; its window of
    # 100 in ranges of 64 aligned to multiples of 64: 14, 64, 22), not read by one thread while the other waits;
    # at 40 rows it stays one item
    kc, vc, kp, vp, table, q = _decode_case(8, 1, 160, 64, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for n in (150, 40):
            out = ops.decode_attention(q, kp, vp, table, torch.tensor([0]), torch.tensor([n]), 0.2, window)
            torch.testing.assert_close(out[0], _decode_ref(q[0], kc, vc, 0, n, window, 0.2), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


def _window_mask(q_pos: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """HF's sliding-window rule: the query at position i sees keys i - window < j <= i (window 0: causal only)."""
    j, i = torch.arange(n_keys)[None, :], q_pos[:, None]
    return (j <= i) & ((j > i - window) if window else True)


def _decode_case(seed: int, B: int, S: int, D: int, bs: int | None):
    """Logical caches [B, 2 KV heads, S, D], their paged layout (_paged) and B decode queries of 4 heads."""
    torch.manual_seed(seed)
    kc, vc = torch.randn(B, 2, S, D), torch.randn(B, 2, S, D)
    (kp, vp), table = _paged([kc, vc], bs)
    return kc, vc, kp, vp, table, torch.randn(B, 4, D)


def _decode_ref(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: int, n: int, window: int,
                scale: float) -> torch.Tensor:
    """SDPA of one decode query q [H, D] at position n - 1 over slot's logical caches [B, KV, S, D] (window 0: all)."""
    mask = _window_mask(torch.tensor([n - 1]), n, window)
    return F.scaled_dot_product_attention(q[None, :, None], kc[slot:slot + 1, :, :n], vc[slot:slot + 1, :, :n],
                                          attn_mask=mask, scale=scale, enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("bs", LAYOUTS)
@pytest.mark.parametrize("window", [3, 16, 39])
@pytest.mark.parametrize("D", [32, 24])
def test_decode_attention_within_a_window_matches_masked_sdpa(ops, window, D, bs):
    kc, vc, kp, vp, table, q = _decode_case(6, 4, 50, D, bs)
    slots, lens = torch.tensor([3, 0, 2, 1]), torch.tensor([1, 50, 17, window])
    out = ops.decode_attention(q, kp, vp, table, slots, lens, 0.3, window)
    for i in range(4):
        torch.testing.assert_close(out[i], _decode_ref(q[i], kc, vc, int(slots[i]), int(lens[i]), window, 0.3),
                                   atol=1e-5, rtol=1e-5)
    assert torch.equal(ops.decode_attention(q, kp, vp, table, slots, lens, 0.3, 0),
                       ops.decode_attention(q, kp, vp, table, slots, lens, 0.3))


@pytest.mark.parametrize("bs", LAYOUTS)
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("H,KV,D", [(8, 4, 64), (4, 4, 16), (6, 2, 32), (4, 1, 128)])
def test_prefill_attention_matches_sdpa(ops, H, KV, D, window, bs):
    # four chunks in one call: a first chunk (start 0), a later one over a cached prefix, one of 1 row, and a long
    # one whose later row blocks' windows start past the first 32-key blocks; row counts that are not multiples
    # of the kernel's 8-row blocks; keys ending short of a 32-key block
    torch.manual_seed(3)
    B, S = 4, 80
    kc, vc = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    (kp, vp), table = _paged([kc, vc], bs)
    chunks = [(0, 13, 2, 0), (13, 21, 0, 37), (34, 1, 1, 70), (35, 75, 3, 0)]  # (offset, length, slot, start)
    T = 110
    q = torch.randn(T, H + 2 * KV, D)[:, :H]  # a strided view, as the fused qkv output gives it
    out = torch.full((T + 1, H, D), 7.0)[:T]
    ops.prefill_attention(q, kp, vp, table, out, [x for c in chunks for x in c], D ** -0.5, window)
    for a, n, slot, start in chunks:
        end = start + n
        mask = _window_mask(torch.arange(start, end), end, window)
        ref = F.scaled_dot_product_attention(q[a:a + n].transpose(0, 1)[None], kc[slot:slot + 1, :, :end],
                                             vc[slot:slot + 1, :, :end], attn_mask=mask, scale=D ** -0.5,
                                             enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[a:a + n], ref, atol=1e-5, rtol=1e-5)
    assert ops.prefill_attention_fits(64, 1024) and not ops.prefill_attention_fits(64, 1025)
    assert not ops.prefill_attention_fits(24, 10) and not ops.prefill_attention_fits(96, 10)  # aten's flash then
    with pytest.raises(RuntimeError, match="out of range"):
        ops.prefill_attention(q, kp, vp, table, out, [T - 5, 10, 0, 0], 1.0)  # rows past T
    k24 = torch.zeros(1, 1, 8, 24)
    with pytest.raises(RuntimeError, match="not supported"):
        ops.prefill_attention(torch.zeros(5, 1, 24), k24, k24, torch.zeros(1, 1, dtype=torch.long),
                              torch.zeros(5, 1, 24), [0, 5, 0, 0], 1.0)


def test_kernels_refuse_bad_input(ops):
    kc = torch.zeros(2, 1, 8, 4)
    q = torch.zeros(1, 1, 4)
    table = torch.arange(2)[:, None]
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(q, kc, kc, table, torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(q, kc, kc, table, torch.tensor([0]), torch.tensor([9]), 1.0)
    paged = torch.zeros(3, 1, 4, 4)  # 3 blocks of 4 positions; a table naming block 3 is refused
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        ops.decode_attention(q, paged, paged, torch.tensor([[0, 3]]), torch.tensor([0]), torch.tensor([6]), 1.0)
    ops.decode_attention(q, paged, paged, torch.tensor([[0, 3]]), torch.tensor([0]), torch.tensor([4]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4), 1e-6)
    heads = torch.zeros(1, 3, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rope_store(heads, torch.ones(1, 4), torch.zeros(1, 4), 2, 1, 2, kc, kc, table, torch.tensor([0]),
                       torch.tensor([8]))
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        ops.rope_store(heads, torch.ones(1, 4), torch.zeros(1, 4), 2, 1, 2, paged, paged, torch.tensor([[0, 3]]),
                       torch.tensor([0]), torch.tensor([5]))


def test_modes_and_a_failed_build_is_an_error_not_a_slow_fallback(monkeypatch):
    assert kernels.load("off") is None
    with pytest.raises(UserError, match="--cpu-kernels"):
        kernels.load("fast")
    monkeypatch.setattr(kernels, "_build", lambda: RuntimeError("ninja: build stopped\ng++: error: not found"))
    for mode in ("auto", "on"):
        with pytest.raises(UserError, match=f"(?s)--cpu-kernels {mode}: building .* failed.*--cpu-kernels off"
                                            f".*g\\+\\+: error: not found"):
            kernels.load(mode)


@pytest.mark.parametrize("n,k", [(16, 8), (48, 100), (1536, 512)])
def test_linear_panels_matches_f_linear(ops, n, k):
    torch.manual_seed(3)
    w, b = torch.randn(n, k), torch.randn(n)
    packed = ops.pack_panels(w)
    assert packed.shape == (n // 16, k, 16)
    for rows in (0, 1, 2, 3, 5, 8, 9, 16, 17, 64):  # every row-tile size and the panel-group tails
        x = torch.randn(2, rows, k)
        torch.testing.assert_close(ops.linear_panels(x, packed, b), F.linear(x, w, b), atol=2e-5 * k, rtol=1e-4)
        torch.testing.assert_close(ops.linear_panels(x, packed), F.linear(x, w), atol=2e-5 * k, rtol=1e-4)
    with pytest.raises(RuntimeError, match="last size"):
        ops.linear_panels(torch.randn(1, k + 1), packed)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_panels(torch.randn(20, k))


def test_linear_panels_residual_is_the_separate_add_to_the_bit(ops):
    # the decoder layers' residual adds in the GEMM's store: bit-equal to residual + y, for every row tile
    torch.manual_seed(4)
    w, b = torch.randn(48, 100), torch.randn(48)
    packed = ops.pack_panels(w)
    for rows in (1, 2, 3, 5, 8, 9, 17):
        x, r = torch.randn(rows, 100), torch.randn(rows, 48)
        assert torch.equal(ops.linear_panels(x, packed, b, residual=r), r + ops.linear_panels(x, packed, b))
        q = torch.randint(-127, 128, (48, 100), dtype=torch.int8)
        s = torch.rand(48) / 100
        qp = ops.pack_panels(q)
        assert torch.equal(ops.linear_panels(x, qp, scale=s, residual=r), r + ops.linear_panels(x, qp, scale=s))
    with pytest.raises(RuntimeError, match="residual must have"):
        ops.linear_panels(torch.randn(3, 100), packed, residual=torch.randn(3, 47))
    with pytest.raises(RuntimeError, match="residual must have"):
        ops.linear_panels(torch.randn(3, 100), ops.pack_panels(torch.randn(64, 100)), None, True,
                          residual=torch.randn(3, 32))


def test_int4_linear_refuses_bad_shapes(ops):
    packed = torch.zeros(64, 64, dtype=torch.uint8)
    sz = torch.zeros(1, 64, 2, dtype=torch.bfloat16)
    assert ops.int4_linear(torch.zeros(2, 128), packed, sz, 128, 64).shape == (2, 64)
    with pytest.raises(RuntimeError, match="last size"):
        ops.int4_linear(torch.zeros(2, 64), packed, sz, 128, 64)
    with pytest.raises(RuntimeError, match="mismatch"):
        ops.int4_linear(torch.zeros(2, 128), packed, sz, 64, 64)
    with pytest.raises(RuntimeError, match="block"):
        ops.int4_linear(torch.zeros(2, 128), packed, sz, 128, 16)


def _act(name: str, g: torch.Tensor) -> torch.Tensor:
    return F.silu(g) if name == "silu" else F.gelu(g, approximate="tanh")


def test_int4_linear_act_mul_equals_the_activation_of_the_plain_call(ops):
    from compress.quant import QuantArgs
    from compress.rtn import rtn
    from memfit.runtime.qlinear import quant_linear

    block = kernels.int4_block()
    if block is None:
        pytest.skip("torch has no CPU int4 pack here")
    torch.manual_seed(5)
    n, k = 2 * block, 256  # [gate; up], each half one block of outputs
    ql = quant_linear(rtn(torch.randn(2 * n, k), QuantArgs(4, 128, False)), None)
    for rows in (1, 3, 4, 5, 16):
        x = torch.randn(rows, k)
        gu = ops.int4_linear(x, ql.packed, ql.scale_zeros, 128, block)
        for act, name in ((True, "silu"), (1, "silu"), (2, "gelu_tanh")):  # True: what callers passed before
            want = _act(name, gu[:, :n]) * gu[:, n:]
            torch.testing.assert_close(ops.int4_linear(x, ql.packed, ql.scale_zeros, 128, block, act), want,
                                       atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="unknown activation"):
        ops.int4_linear(x, ql.packed, ql.scale_zeros, 128, block, 3)
    with pytest.raises(RuntimeError, match="act_mul"):  # halves that are not whole blocks
        odd = quant_linear(rtn(torch.randn(3 * block, k), QuantArgs(4, 128, False)), None)
        ops.int4_linear(x, odd.packed, odd.scale_zeros, 128, block, True)


@pytest.mark.parametrize("act,name", [(1, "silu"), (2, "gelu_tanh")])
def test_linear_panels_act_mul_matches_torch(ops, act, name):
    torch.manual_seed(4)
    n, k = 48, 40
    g, u, bg, bu = torch.randn(n, k) * 0.3, torch.randn(n, k) * 0.3, torch.randn(n), torch.randn(n)
    pairs = torch.stack([g.view(-1, 16, k), u.view(-1, 16, k)], 1).reshape(2 * n, k)  # (gate, up) panel pairs
    b = torch.stack([bg.view(-1, 16), bu.view(-1, 16)], 1).reshape(-1)
    packed = ops.pack_panels(pairs)
    for rows in (1, 2, 3, 8, 12, 13, 16, 25):  # the 4-pair (<= 2 rows) and 8-row passes and their tails
        x = torch.randn(rows, k) * 3
        want = _act(name, F.linear(x, g, bg)) * F.linear(x, u, bu)
        torch.testing.assert_close(ops.linear_panels(x, packed, b, act), want, atol=1e-4, rtol=1e-4)
    # the epilogue's exp over the whole float range: gate = x itself, up = 1
    ident = torch.cat([torch.eye(16), torch.zeros(16, 16)])
    x = torch.cat([torch.linspace(-120, 120, 3996), torch.tensor([0.0, -87.4, 88.4, 1e-30])]).view(-1, 16)
    got = ops.linear_panels(x, ops.pack_panels(ident), torch.cat([torch.zeros(16), torch.ones(16)]), act)
    torch.testing.assert_close(got, _act(name, x), atol=1e-6, rtol=2e-6)
    if name == "gelu_tanh":
        # against the exact tanh form in fp64: torch's own fp32 gelu loses ~2e-5 relative to 1 + tanh(u)'s
        # cancellation at negative x, the epilogue's x * sigmoid(2 u) form stays within ~6e-7
        xd = x.double()
        exact = 0.5 * xd * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (xd + 0.044715 * xd ** 3)))
        big = exact.abs() > 1e-3
        assert ((got.double() - exact).abs()[big] / exact.abs()[big]).max() < 2e-6
    with pytest.raises(RuntimeError, match="pairs"):
        ops.linear_panels(torch.randn(1, 8), ops.pack_panels(torch.randn(16, 8)), None, act)


def test_linear_panels_int8_weights(ops):
    torch.manual_seed(5)
    codes = torch.randint(-127, 128, (32, 24), dtype=torch.int8)
    scale, b = torch.rand(32) * 0.01, torch.randn(32)
    packed = ops.pack_panels(codes)
    x = torch.randn(3, 24)
    want = F.linear(x, codes.float() * scale[:, None], b)
    torch.testing.assert_close(ops.linear_panels(x, packed, b, False, scale), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="needs a scale"):
        ops.linear_panels(x, packed)


@pytest.mark.parametrize("k", [24, 640, 25])
def test_linear_panels_int8_weights_in_bf16_mode(ops, k):
    """bf16_dot: from 8 rows, where the CPU has AVX512-BF16, int8 panels run on vdpbf16ps as exact bf16 codes with
    x rounded to bf16 (the scale in the store); below 8 rows, without the CPU, or with an odd K: the fp32 path."""
    torch.manual_seed(7)
    n = 48
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale, b = torch.rand(n) * 0.01, torch.randn(n)
    w = codes.float() * scale[:, None]
    packed = ops.pack_panels(codes)
    pairs = ops.pack_panels(torch.cat([codes[:16], codes[16:32]]))  # one (gate, up) panel pair
    ps = torch.cat([scale[:16], scale[16:32]])
    for rows in (1, 7, 8, 9, 33, 64):
        x = torch.randn(rows, k)
        xr = x.bfloat16().float() if ops.has_avx512_bf16() and rows >= 8 and k % 2 == 0 else x
        r = torch.randn(rows, n)
        got = ops.linear_panels(x, packed, b, 0, scale, r, bf16_dot=True)
        torch.testing.assert_close(got, F.linear(xr, w, b) + r, atol=1e-5 * k, rtol=1e-4)
        torch.testing.assert_close(ops.linear_panels(x, packed, b, 0, scale), F.linear(x, w, b), atol=1e-5 * k,
                                   rtol=1e-5)
        want = F.silu(F.linear(xr, w[:16])) * F.linear(xr, w[16:32])
        torch.testing.assert_close(ops.linear_panels(x, pairs, None, 1, ps, bf16_dot=True), want, atol=1e-4 * k,
                                   rtol=1e-3)


@pytest.mark.parametrize("n,k", [(16, 8), (48, 100), (1536, 512)])
def test_linear_panels_bf16_weights(ops, n, k):
    """bf16 panels equal F.linear on the bf16-rounded weight: with fp32 x below 8 rows, and with x rounded to
    bf16 too from 8 rows where the CPU has AVX512-BF16 (vdpbf16ps)."""
    torch.manual_seed(6)
    w, b = torch.randn(n, k), torch.randn(n)
    wb = w.bfloat16()
    packed = ops.pack_panels(wb)
    assert packed.shape == (n // 16, k // 2, 32) and packed.dtype == torch.bfloat16
    dp = ops.has_avx512_bf16()
    for rows in (0, 1, 2, 3, 5, 7, 8, 9, 12, 13, 16, 17, 28, 64):  # the 8-, 12- and 16-row passes and their tails
        x = torch.randn(rows, k)
        xr = x.bfloat16().float() if dp and rows >= 8 else x
        r = torch.randn(rows, n)
        torch.testing.assert_close(ops.linear_panels(x, packed, b), F.linear(xr, wb.float(), b), atol=1e-5 * k,
                                   rtol=1e-4)
        torch.testing.assert_close(ops.linear_panels(x, packed, b, residual=r), F.linear(xr, wb.float(), b) + r,
                                   atol=1e-5 * k, rtol=1e-4)
    pairs = ops.pack_panels(torch.cat([wb[:16], wb[16:32]]) if n >= 32 else torch.cat([wb, wb]))
    g, u = (wb[:16], wb[16:32]) if n >= 32 else (wb, wb)
    for rows in (12, 20, 33):
        x = torch.randn(rows, k)
        xr = x.bfloat16().float() if dp else x
        torch.testing.assert_close(ops.linear_panels(x, pairs, None, True),
                                   F.silu(F.linear(xr, g.float())) * F.linear(xr, u.float()), atol=1e-4 * k,
                                   rtol=1e-3)
    with pytest.raises(RuntimeError, match="even K"):
        ops.pack_panels(torch.randn(16, 7).bfloat16())


def test_peak_gflops_loop_runs(ops):
    assert ops.peak_gflops(False, 1000) > 0
    if ops.has_avx512_bf16():
        assert ops.peak_gflops(True, 1000) > 0
    else:
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            ops.peak_gflops(True, 10)


@pytest.mark.parametrize("bs", LAYOUTS)
@pytest.mark.parametrize("D", [32, 24])
def test_int8_kv_kernels_equal_attention_over_the_dequantized_cache(ops, bs, D):
    # rope_store quantizes each (token, KV head) row as quantize_rows does; decode and prefill attention over the
    # int8 cache equal fp32 attention over its dequantized values (D 24: the scalar decode path; prefill takes
    # D 32 only)
    from memfit.runtime.attention import quantize_rows

    torch.manual_seed(9)
    H, KV, B, S = 4, 2, 3, 40
    kl, vl = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    (kq, ks), (vq, vs) = quantize_rows(kl), quantize_rows(vl)
    kd, vd = kq.float() * ks[..., None], vq.float() * vs[..., None]  # what the cache holds
    (kp, vp, ksp, vsp), table = _paged([kq.float(), vq.float(), ks[..., None], vs[..., None]], bs, fill=0.0)
    kp, vp, ksp, vsp = kp.to(torch.int8), vp.to(torch.int8), ksp[..., 0].contiguous(), vsp[..., 0].contiguous()
    q = torch.randn(3, H, D)
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([1, 40, 23])
    out = ops.decode_attention(q, kp, vp, table, slots, lens, 0.3, k_scale=ksp, v_scale=vsp)
    qd = q
    if D % 32 == 0:  # the x86 decode kernel dots int8 keys with the query rounded to 15 bits per (row, head)
        step = q.abs().amax(-1, keepdim=True) / 16383
        qd = torch.round(q / step) * step
    for i in range(3):
        s, n = int(slots[i]), int(lens[i])
        ref = F.scaled_dot_product_attention(qd[i][None, :, None], kd[s:s + 1, :, :n], vd[s:s + 1, :, :n], scale=0.3,
                                             enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
    if D % 16 == 0:
        chunks, T = [(0, 9, 1, 14), (9, 30, 2, 0)], 39
        qp = torch.randn(T, H, D)
        outp = torch.zeros(T, H, D)
        ops.prefill_attention(qp, kp, vp, table, outp, [x for c in chunks for x in c], 0.3, k_scale=ksp, v_scale=vsp)
        for a, n, slot, start in chunks:
            end = start + n
            mask = _window_mask(torch.arange(start, end), end, 0)
            ref = F.scaled_dot_product_attention(qp[a:a + n].transpose(0, 1)[None], kd[slot:slot + 1, :, :end],
                                                 vd[slot:slot + 1, :, :end], attn_mask=mask, scale=0.3,
                                                 enable_gqa=True)[0].transpose(0, 1)
            torch.testing.assert_close(outp[a:a + n], ref, atol=1e-5, rtol=1e-5)
    # the write: rows quantized into the int8 pages and their scales
    heads = torch.randn(2, H + 2 * KV, D)
    k_new, v_new = heads[:, H:H + KV].clone(), heads[:, H + KV:].clone()
    ops.rope_store(heads, torch.ones(2, 1, D), torch.zeros(2, 1, D), H + KV, H, H + KV, kp, vp, table,
                   torch.tensor([0, 2]), torch.tensor([5, 39]), k_scale=ksp, v_scale=vsp)
    (k8, kscale), (v8, vscale) = quantize_rows(k_new), quantize_rows(v_new)
    for t, (s, p) in enumerate([(0, 5), (2, 39)]):
        blk, off = int(table[s, p // (bs or S)]), p % (bs or S)
        assert torch.equal(kp[blk, :, off], k8[t]) and torch.equal(vp[blk, :, off], v8[t])
        assert torch.equal(ksp[blk, :, off], kscale[t]) and torch.equal(vsp[blk, :, off], vscale[t])
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        ops.decode_attention(q, kp, vp, table, slots, lens, 0.3)


@pytest.mark.parametrize("bits,sym", [(2, False), (3, False), (4, False), (8, False), (3, True), (4, True)])
def test_mse_qparams_matches_the_torch_search(ops, bits: int, sym: bool) -> None:
    """compress's clipping search: the kernel's (scale, zero) per group equal the torch loop's, or (a near-tie the
    polynomial power ranks the other way) have the same error to 1e-5; edge groups: all zero, constant, one-signed."""
    from compress.quant import MSE_GRID, MSE_MAXSHRINK, MSE_NORM, QuantArgs, mse_search, quantize_codes

    g = torch.Generator().manual_seed(bits)
    w = torch.randn(300, 128, generator=g) * torch.rand(300, 1, generator=g).pow(4) * 0.1
    w[:, ::37] *= 8  # outliers: clipping pays
    w[0], w[1], w[2], w[3] = 0.0, 0.25, -w[3].abs(), w[4].abs()
    args = QuantArgs(bits, 128, sym, mse=True)
    s, z = ops.mse_qparams(w, bits, sym, int(MSE_MAXSHRINK * MSE_GRID), MSE_GRID, MSE_NORM)
    s_ref, z_ref = mse_search(w, args)

    def err(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        q = quantize_codes(w, s[:, None], z[:, None], args.maxq)
        return ((q - z[:, None]) * s[:, None] - w).abs().pow(MSE_NORM).sum(-1)

    same = (s == s_ref) & (z == z_ref)
    assert same.float().mean() > 0.98
    assert torch.allclose(err(s, z), err(s_ref, z_ref), rtol=1e-5, atol=1e-30)
    assert torch.equal(s[:2], s_ref[:2]) and torch.equal(z[:2], z_ref[:2])  # zero / constant groups exactly


def test_mse_qparams_checks_its_input(ops) -> None:
    with pytest.raises(RuntimeError, match="wg must be"):
        ops.mse_qparams(torch.zeros(4), 4, False, 80, 100.0, 2.4)
    with pytest.raises(RuntimeError, match="bad bits"):
        ops.mse_qparams(torch.zeros(4, 8), 9, False, 80, 100.0, 2.4)
