// fp32, bf16 and int8 Linears on the panel layout for small and large row counts (memfit.runtime.dense.PanelLinear).
#include <immintrin.h>

#include "common.h"

namespace memfit {

// ---- fp32 Linear on a panel layout: W [N, K] is stored as [N / 16][K][16] (16 outputs innermost) ----
// For every k, one 16-wide load of W feeds an FMA into each row's accumulator, so W is streamed exactly once
// per call whatever the row count (rows are taken 8 at a time per group of panels while those panels sit in
// L1/L2), and no packing of x is needed.

at::Tensor pack_panels(const at::Tensor& w) {
  const auto t = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && (t == at::kFloat || t == at::kChar || t == at::kBFloat16),
              "weight must be a CPU float32, int8 or bfloat16 tensor");
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 16 == 0, "weight must be [N, K] with N a multiple of 16");
  const int64_t N = w.size(0), K = w.size(1);
  if (t == at::kBFloat16) {  // [N / 16][K / 2][16][2]: k pairs of 16 outputs, as vdpbf16ps reads them
    TORCH_CHECK(K % 2 == 0, "a bf16 weight needs an even K");
    return w.reshape({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / 16, K / 2, 32});
  }
  return w.reshape({N / 16, 16, K}).transpose(1, 2).contiguous();
}

// 16 weights of a panel row as floats: fp32 as they are, int8 widened (the row's scale is applied at the end)
inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline v16 load16(const int8_t* p) { return i8_to_f32(p); }

// The kernels' epilogue: y (rows m, panels j) gets acc times the int8 scale (per output), plus bias, then
// either act(gate) * up (ACT kSilu, kGeluTanh: the panels come in (gate, up) pairs of the same 16 outputs, 16
// per pair) or plus the residual (y's layout), rounded as the unfused ops.
template <int MR, int NP, int ACT>
inline void panel_store(v16 (&acc)[MR][NP], float* y, int64_t ldy, const float* bias, const float* scale,
                        const float* res) {
  if (scale)
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NP; ++j) acc[m][j] *= *reinterpret_cast<const v16u*>(scale + j * 16);
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j)
      if (bias) acc[m][j] += *reinterpret_cast<const v16u*>(bias + j * 16);
  for (int m = 0; m < MR; ++m) {
    if constexpr (ACT != kNoAct) {
      for (int j = 0; j + 1 < NP; j += 2)
        *reinterpret_cast<v16u*>(y + m * ldy + j * 8) = act_mul<ACT>(acc[m][j], acc[m][j + 1]);
    } else if (res) {
      for (int j = 0; j < NP; ++j)
        *reinterpret_cast<v16u*>(y + m * ldy + j * 16) = acc[m][j] + *reinterpret_cast<const v16u*>(res + m * ldy + j * 16);
    } else {
      for (int j = 0; j < NP; ++j) *reinterpret_cast<v16u*>(y + m * ldy + j * 16) = acc[m][j];
    }
  }
}

// The next panel group's weights, prefetched into L2 while a later row chunk computes on the current group from
// cache: `lines` 64-byte lines per k step, bytes [0, end) of p. Without it the first chunk of every group waited on
// memory and the others on arithmetic, one after the other (lm_head 262144 x 640 bf16 at 16 rows, 2 threads: 47%
// of the bf16 peak, 13.5 GB/s, neither limit).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0, end = 0;
  inline void step(int64_t it) const {
    for (int64_t l = 0; l < lines; ++l) {
      const int64_t o = (it * lines + l) * 64;
      if (o < end) __builtin_prefetch(p + o, 0, 2);
    }
  }
};

// W = int8_t: y = (x @ Wq^T) * scale (per output) + bias.
template <int MR, int NP, int ACT = kNoAct, typename W = float, bool PF = false>
inline void panel_kernel(const float* x, int64_t K, const W* P, float* y, int64_t ldy, const float* bias,
                         const float* scale, const float* res, const Ahead& ahead) {
  v16 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = v16{};
  if constexpr (std::is_same_v<W, uint16_t>) {
    // bf16 panels of k pairs ([K / 2][16][2] per panel): the even k of 16 outputs are the low halves of 16
    // 32-bit lanes, the odd k the high halves; each becomes fp32 by a shift or a mask (exact), so x stays fp32
    for (int64_t k = 0; k < K; k += 2) {
      if constexpr (PF) ahead.step(k / 2);
      v16 lo[NP], hi[NP];
      for (int j = 0; j < NP; ++j) {
        const W* pk = P + (j * K + k) * 16;
        const vu16 u = *reinterpret_cast<const vu16*>(pk);
        lo[j] = bits_f32(u << 16);
        hi[j] = bits_f32(u & 0xFFFF0000u);
        __builtin_prefetch(pk + 512);  // 1 KiB ahead
      }
      for (int m = 0; m < MR; ++m) {
        const float x0 = x[m * K + k], x1 = x[m * K + k + 1];
        for (int j = 0; j < NP; ++j) {
          acc[m][j] += x0 * lo[j];
          acc[m][j] += x1 * hi[j];
        }
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (PF) ahead.step(k);
      v16 w[NP];
      for (int j = 0; j < NP; ++j) {
        const W* pk = P + (j * K + k) * 16;
        w[j] = load16(pk);
        __builtin_prefetch(pk + 1024 / sizeof(W));  // 1 KiB ahead
      }
      for (int m = 0; m < MR; ++m) {
        const float xv = x[m * K + k];
        for (int j = 0; j < NP; ++j) acc[m][j] += xv * w[j];
      }
    }
  }
  panel_store<MR, NP, ACT>(acc, y, ldy, bias, scale, res);
}

#ifdef __AVX512BF16__
// bf16 panels at many rows: x rounded to bf16 too (xb: [rows][K / 2] pairs) and each k pair of 16 outputs
// one vdpbf16ps (products exact, sums in fp32): half the instructions of the fp32 FMA loop above
template <int MR, int NP, int ACT, bool PF = false>
inline void panel_kernel_dp(const uint32_t* xb, int64_t K, const uint16_t* P, float* y, int64_t ldy,
                            const float* bias, const float* scale, const float* res, const Ahead& ahead) {
  const int64_t K2 = K / 2;
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    if constexpr (PF) ahead.step(kp);
    __m512bh w[NP];
    for (int j = 0; j < NP; ++j) {
      const uint16_t* pk = P + (j * K2 + kp) * 32;
      w[j] = (__m512bh)_mm512_load_si512(pk);
      __builtin_prefetch(pk + 512);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[m * K2 + kp]));
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
    }
  }
  v16 out[MR][NP];
  std::memcpy(out, acc, sizeof(out));
  panel_store<MR, NP, ACT>(out, y, ldy, bias, scale, res);
}

// NP int8 panels ([K][16] each) as bf16 k pairs ([K / 2][16][2] each), exactly: |q| <= 127 has 7 significant
// bits, so its fp32 value's low half is zero. Each 32-bit lane holds the even k in its low half, the odd k high.
template <int NP>
inline void int8_panels_as_bf16(const int8_t* P, int64_t K, uint16_t* tile) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < NP; ++j)
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      const int8_t* src = P + (j * K + 2 * kp) * 16;
      const __m512i e = _mm512_castps_si512(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)))));
      const __m512i o = _mm512_castps_si512(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16)))));
      _mm512_store_si512(tile + (j * (K / 2) + kp) * 32, _mm512_or_si512(_mm512_srli_epi32(e, 16),
                                                                           _mm512_and_si512(o, high)));
    }
}
#endif

// Rows per kernel call for NP panels of weight type W: the MR x NP accumulators, the NP panels' weights (two
// vectors each for bf16: even and odd k) and a broadcast x must fit the vector registers. AVX-512 has 32, each a
// v16. AVX2 has 16 ymm, two per v16: fp32 and int8 6 x 1 (the classic 6 x 16 FMA tile) or 2 x 2, bf16 4 x 1.
template <int NP, typename W>
constexpr int64_t max_rows() {
#ifdef __AVX512F__
  return 8;
#else
  if constexpr (std::is_same_v<W, uint16_t>) return NP == 1 ? 4 : 1;
  else return NP == 1 ? 6 : (NP == 2 ? 2 : 1);
#endif
}

// ldy: y's row stride (N, or N / 2 with an ACT). xb: x as bf16 pairs where bf16 panels run on vdpbf16ps, else
// null. The rows go in chunks of at most max_rows (8 with AVX-512), all the same size (10 rows: 5 + 5, not 8 + 2);
// every chunk after the first prefetches its share of `next`, the thread's next panel group (null: none). (gate,
// up) pairs pass none: a build that prefetched there too ran gate_up (4096 x 640 bf16) 10-14% slower at 8-32 rows.
template <int NP, int ACT = kNoAct, typename W = float>
void panel_rows(const float* x, const uint32_t* xb, int64_t M, int64_t K, const W* P, float* y, int64_t ldy,
                int64_t p, const float* bias, const float* scale, const float* res, const W* next = nullptr) {
  const W* pp = P + p * K * 16;
  const float* bp = bias ? bias + p * 16 : nullptr;
  const float* sp = scale ? scale + p * 16 : nullptr;
  constexpr int64_t R = max_rows<NP, W>();
  const int64_t chunks = (M + R - 1) / R, mr = (M + chunks - 1) / chunks;
  const int64_t steps = std::is_same_v<W, uint16_t> ? K / 2 : K;  // k steps of the kernels' loops
  const int64_t share = chunks > 1 && next ? (NP * K * 16 * static_cast<int64_t>(sizeof(W)) + chunks - 2) / (chunks - 1)
                                           : 0;
  for (int64_t c = 0, m0 = 0; m0 < M; ++c, m0 += mr) {
    Ahead ahead;
    if (c > 0 && share > 0)
      ahead = {reinterpret_cast<const char*>(next) + (c - 1) * share, (share / 64 + steps - 1) / steps, share};
    const float* xr = x + m0 * K;
    float* yr = y + m0 * ldy + p * (ACT != kNoAct ? 8 : 16);
    const float* rr = res ? res + m0 * ldy + p * 16 : nullptr;  // the residual has y's layout (not with an ACT)
    const int64_t rows = std::min(mr, M - m0);
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<W, uint16_t>) {
      if (xb) {
        const uint32_t* xbr = xb + m0 * (K / 2);
        auto run = [&](auto pf) {
          constexpr bool F = decltype(pf)::value;
          switch (rows) {
            case 1: return panel_kernel_dp<1, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 2: return panel_kernel_dp<2, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 3: return panel_kernel_dp<3, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 4: return panel_kernel_dp<4, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 5: return panel_kernel_dp<5, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 6: return panel_kernel_dp<6, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            case 7: return panel_kernel_dp<7, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
            default: return panel_kernel_dp<8, NP, ACT, F>(xbr, K, pp, yr, ldy, bp, sp, rr, ahead);
          }
        };
        if (ACT == kNoAct && ahead.p) run(std::integral_constant<bool, ACT == kNoAct>{});
        else run(std::false_type{});
        continue;
      }
    }
#endif
    auto run = [&](auto pf) {
      constexpr bool F = decltype(pf)::value;
      switch (rows) {
        case 1: return panel_kernel<1, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 2: return panel_kernel<2, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 3: return panel_kernel<3, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 4: return panel_kernel<4, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 5: return panel_kernel<5, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 6: return panel_kernel<6, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        case 7: return panel_kernel<7, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
        default: return panel_kernel<8, NP, ACT, W, F>(xr, K, pp, yr, ldy, bp, sp, rr, ahead);
      }
    };
    if (ACT == kNoAct && ahead.p) run(std::integral_constant<bool, ACT == kNoAct>{});  // pairs never prefetch
    else run(std::false_type{});
  }
}

#ifdef __AVX512BF16__
// int8 panels at many rows (xb: x as bf16 pairs) on vdpbf16ps: panels p .. p + NP - 1 widened to a bf16 tile once,
// then the bf16 kernel over every row of x, the scale applied in its store. Half the instructions of widening
// each k's 16 weights to fp32 for every chunk of 8 rows (the int8 prefill ran at the fp32 FMA rate before).
template <int NP, int ACT>
void int8_panels_dp(const float* xp, const uint32_t* xb, int64_t M, int64_t K, const int8_t* pp, int64_t p, float* yp,
                    int64_t ldy, const float* bp, const float* sp, const float* rp, uint16_t* tile) {
  int8_panels_as_bf16<NP>(pp + p * K * 16, K, tile);
  const int64_t col = p * (ACT != kNoAct ? 8 : 16);  // panel_rows' own offsets are 0 (its p): the tile is panel 0
  panel_rows<NP, ACT, uint16_t>(xp, xb, M, K, tile, yp + col, ldy, 0, bp ? bp + p * 16 : nullptr, sp + p * 16,
                                rp ? rp + col : nullptr);
}

// a thread's tile for int8_panels_dp: two bf16 panels, 64-byte aligned
struct Int8Tile {
  std::vector<uint16_t> buf;
  uint16_t* p;
  explicit Int8Tile(int64_t K) : buf(2 * K * 16 + 32) {
    p = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  }
};
#endif

// y = act(gate) * up over (gate, up) panel pairs: whole pairs per thread and per kernel call
template <int ACT, typename W>
void run_panel_pairs(const float* xp, const uint32_t* xb, int64_t M, int64_t K, const W* pp, float* yp,
                     int64_t NPAN, const float* bp, const float* sp) {
  const int64_t N = NPAN * 16;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<W, int8_t>) {
    if (xb) {
      at::parallel_for(0, NPAN / 2, 2, [&](int64_t q0, int64_t q1) {
        Int8Tile tile(K);
        for (int64_t q = q0; q < q1; ++q)
          int8_panels_dp<2, ACT>(xp, xb, M, K, pp, 2 * q, yp, N / 2, bp, sp, nullptr, tile.p);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, NPAN / 2, 2, [&](int64_t q0, int64_t q1) {
    int64_t q = q0;
    if (M <= 2 && max_rows<4, W>() >= M)  // two pairs a call where their accumulators fit (AVX2: none)
      for (; q + 2 <= q1; q += 2) panel_rows<4, ACT, W>(xp, xb, M, K, pp, yp, N / 2, 2 * q, bp, sp, nullptr);
    for (; q < q1; ++q) panel_rows<2, ACT, W>(xp, xb, M, K, pp, yp, N / 2, 2 * q, bp, sp, nullptr);
  });
}

template <typename W>
void run_panels(const float* xp, const uint32_t* xb, int64_t M, int64_t K, const W* pp, float* yp, int64_t NPAN,
                const float* bp, const float* sp, int64_t act, const float* rp) {
  const int64_t N = NPAN * 16;
  if (act == kSilu) return run_panel_pairs<kSilu, W>(xp, xb, M, K, pp, yp, NPAN, bp, sp);
  if (act == kGeluTanh) return run_panel_pairs<kGeluTanh, W>(xp, xb, M, K, pp, yp, NPAN, bp, sp);
  // panels per kernel call: enough independent accumulators to hide the FMA latency at few rows, within the
  // vector registers (max_rows)
#ifdef __AVX512F__
  const int64_t np = M <= 2 ? 4 : (M <= 4 ? 3 : 2);
#else
  const int64_t np = std::is_same_v<W, uint16_t> ? (M == 1 ? 2 : 1) : (M == 1 ? 4 : (M == 2 ? 2 : 1));
#endif
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<W, int8_t>) {
    if (xb) {
      at::parallel_for(0, NPAN, 4, [&](int64_t p0, int64_t p1) {
        Int8Tile tile(K);
        int64_t p = p0;
        for (; p + 2 <= p1; p += 2) int8_panels_dp<2, kNoAct>(xp, xb, M, K, pp, p, yp, N, bp, sp, rp, tile.p);
        for (; p < p1; ++p) int8_panels_dp<1, kNoAct>(xp, xb, M, K, pp, p, yp, N, bp, sp, rp, tile.p);
      });
      return;
    }
  }
#endif
  at::parallel_for(0, NPAN, 4, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    for (; p + np <= p1; p += np) {
      const W* next = p + np < p1 ? pp + (p + np) * K * 16 : nullptr;
      if (np == 4) panel_rows<4, kNoAct, W>(xp, xb, M, K, pp, yp, N, p, bp, sp, rp, next);
      else if (np == 3) panel_rows<3, kNoAct, W>(xp, xb, M, K, pp, yp, N, p, bp, sp, rp, next);
      else if (np == 2) panel_rows<2, kNoAct, W>(xp, xb, M, K, pp, yp, N, p, bp, sp, rp, next);
      else panel_rows<1, kNoAct, W>(xp, xb, M, K, pp, yp, N, p, bp, sp, rp, next);
    }
    for (; p < p1; ++p) panel_rows<1, kNoAct, W>(xp, xb, M, K, pp, yp, N, p, bp, sp, rp);
  });
}


// y = x @ W^T (+ bias) for x [..., K] and W packed by pack_panels; with an act (Act: kSilu, kGeluTanh), W's panels
// are (gate, up) pairs and y = act(gate) * up has half the columns (the MLP's activation fused into its gate/up
// projection).
// An int8 W needs ``scale`` (one per output): W = Wq * scale. With ``residual`` (y's shape), y = residual +
// (x @ W^T + bias) in the store, bit-equal to the separate add: the decoder layers' two residual adds, which
// in a 256-row prefill step each re-read two [rows, hidden] tensors long out of L2 (py-spy: ~4% of the step).
at::Tensor linear_panels(const at::Tensor& x_in, const at::Tensor& P, const c10::optional<at::Tensor>& bias,
                         int64_t act, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& residual, bool bf16_dot) {
  check_f32_cpu(x_in, "x");
  TORCH_CHECK(act == kNoAct || act == kSilu || act == kGeluTanh, "unknown activation ", act);
  const bool pairs = act != kNoAct;
  const bool int8 = P.scalar_type() == at::kChar, bf16 = P.scalar_type() == at::kBFloat16;
  TORCH_CHECK(P.device().is_cpu() && (int8 || bf16 || P.scalar_type() == at::kFloat),
              "packed weight must be fp32, int8 or bf16");
  TORCH_CHECK(P.dim() == 3 && P.size(2) == (bf16 ? 32 : 16) && P.is_contiguous(),
              "packed weight must come from pack_panels");
  const int64_t K = P.size(1) * (bf16 ? 2 : 1), NPAN = P.size(0), N = NPAN * 16;
  TORCH_CHECK(x_in.size(-1) == K, "x's last size ", x_in.size(-1), " != the weight's ", K);
  auto x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    check_f32_cpu(b, "bias");
    TORCH_CHECK(b.numel() == N, "bias must have one entry per output");
  }
  TORCH_CHECK(!pairs || NPAN % 2 == 0, "an activation needs (gate, up) panel pairs");
  at::Tensor sc;
  TORCH_CHECK(int8 == (scale.has_value() && scale->defined()), "an int8 weight needs a scale, an fp32 one none");
  if (int8) {
    sc = scale->contiguous();
    check_f32_cpu(sc, "scale");
    TORCH_CHECK(sc.numel() == N, "scale must have one entry per output");
  }
  auto sizes = x.sizes().vec();
  sizes.back() = pairs ? N / 2 : N;
  auto y = at::empty(sizes, x.options());
  at::Tensor r;
  if (residual.has_value() && residual->defined()) {
    r = residual->contiguous();
    check_f32_cpu(r, "residual");
    TORCH_CHECK(!pairs && r.sizes() == y.sizes(), "residual must have the output's shape (not with an activation)");
  }
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* rp = r.defined() ? r.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (int8) {  // on vdpbf16ps only in the engine's bf16 mode (bf16_dot)
    const Bf16Pairs xb(x, M, bf16_dot && K % 2 == 0);
    run_panels<int8_t>(xp, xb.p, M, K, P.data_ptr<int8_t>(), yp, NPAN, bp, sc.data_ptr<float>(), act, rp);
  } else if (bf16) {
    const Bf16Pairs xb(x, M, true);
    const auto* pp = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
    run_panels<uint16_t>(xp, xb.p, M, K, pp, yp, NPAN, bp, nullptr, act, rp);
  } else {
    run_panels<float>(xp, nullptr, M, K, P.data_ptr<float>(), yp, NPAN, bp, nullptr, act, rp);
  }
  return y;
}

}  // namespace memfit
