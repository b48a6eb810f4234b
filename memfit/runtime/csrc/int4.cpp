// 4-bit Linears on torch's CPU int4 pack with fp32 activations (memfit.runtime.int4, memfit.runtime.fuse).
#include <immintrin.h>

#include <memory>

#include "common.h"
#include "int4_decode.h"

namespace memfit {

// ---- 4-bit Linear on torch's CPU int4 pack (aten::_convert_weight_to_int4pack_for_cpu, inner k tiles 8) ----
// That pack is [N / B][K][B / 2] bytes for B = 64 (AVX-512 builds of torch; 32 on AVX2): byte j of row k holds
// output n0 + j in its low nibble and n0 + j + B / 2 in its high one (memfit.runtime.kernels probes B once). W[n, k] =
// (q - 8) * scale[g, n] + zero[g, n] with g = k / group_size, scale_zeros [K / group_size, N, 2] in bf16.
// Why not aten's own int4 kernel: it takes bf16 activations (two dtype conversions per call) and at decode sizes
// streamed the packed weight at ~6 GB/s; here each (B-row block, group) is dequantized once into an fp32 tile
// that stays in L1/L2 while every row of x is multiplied with it.
// the low and high nibbles of 16 bytes as two vectors of 16 floats
inline void nibbles_to_float(const uint8_t* p, v16& lo, v16& hi) {
  // GCC's generic vectors left the byte shift and widening scalar (5x slower than aten's kernel)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i l = _mm_and_si128(b, mask), h = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
#ifdef __AVX512F__
  const __m512 fl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(l)), fh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(h));
  std::memcpy(&lo, &fl, 64);
  std::memcpy(&hi, &fh, 64);
#else
  auto widen = [](__m128i b8) { return (f8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8)); };  // 8 bytes
  lo = {widen(l), widen(_mm_srli_si128(l, 8))};
  hi = {widen(h), widen(_mm_srli_si128(h, 8))};
#endif
}

// y[m, c0:c0 + 16 VN] (+)= x[m, :gs] @ tile[:, c0:c0 + 16 VN] (tile [gs][B]) for MR rows, c0 = 16 V0; the
// first group starts from zero
template <int B, int MR, int V0, int VN>
inline void int4_rows(const float* xg, int64_t K, const float* tile, int64_t gs, float* y, int64_t N, bool first) {
  v16 acc[MR][VN];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VN; ++v)
      acc[m][v] = first ? v16{} : *reinterpret_cast<const v16u*>(y + m * N + (V0 + v) * 16);
  for (int64_t kk = 0; kk < gs; ++kk) {
    const float* t = tile + kk * B + V0 * 16;
    v16 w[VN];
    for (int v = 0; v < VN; ++v) w[v] = *reinterpret_cast<const v16*>(t + v * 16);
    for (int m = 0; m < MR; ++m) {
      const float xv = xg[m * K + kk];
      for (int v = 0; v < VN; ++v) acc[m][v] += xv * w[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VN; ++v) *reinterpret_cast<v16u*>(y + m * N + (V0 + v) * 16) = acc[m][v];
}

// int4_rows over the tile's B / 16 output vectors one at a time, from vector V0
template <int B, int MR, int V0 = 0>
inline void int4_rows_each(const float* xg, int64_t K, const float* tile, int64_t gs, float* y, int64_t N,
                           bool first) {
  int4_rows<B, MR, V0, 1>(xg, K, tile, gs, y, N, first);
  if constexpr (V0 + 1 < B / 16) int4_rows_each<B, MR, V0 + 1>(xg, K, tile, gs, y, N, first);
}

// one group of MR <= 4 rows: y[m, :B] (+)= x[m, :gs] @ W[group], dequantizing each k's B weights in registers
template <int B, int MR>
inline void int4_direct(const float* xg, int64_t K, const uint8_t* pk, const v16* sc, const v16* ze, int64_t gs,
                        float* y, int64_t N, bool first) {
  // sum_k x[k] ((q[k] s + z)) = s sum_k x[k] q[k] + z sum_k x[k]: the group's codes are multiplied unscaled and
  // the scale and zero applied once per group (one FMA per 16 weights and row instead of two)
  constexpr int V = B / 16;
  v16 acc[MR][V];
  float xs[MR];
  for (int m = 0; m < MR; ++m) {
    xs[m] = 0.f;
    for (int v = 0; v < V; ++v) acc[m][v] = v16{};
  }
  for (int64_t kk = 0; kk < gs; ++kk) {
    const uint8_t* row = pk + kk * (B / 2);
    v16 w[V];
    for (int h = 0; h < V / 2; ++h) nibbles_to_float(row + h * 16, w[h], w[V / 2 + h]);
    for (int m = 0; m < MR; ++m) {
      const float xv = xg[m * K + kk];
      xs[m] += xv;
      for (int v = 0; v < V; ++v) acc[m][v] += xv * w[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) {
      const v16 r = acc[m][v] * sc[v] + xs[m] * ze[v];
      v16u* out = reinterpret_cast<v16u*>(y + m * N + v * 16);
      *out = first ? r : *out + r;
    }
}

#ifdef __AVX512BF16__
// int4_rows on a bf16 tile of k pairs ([gs / 2][B][2]) with x as bf16 pairs (xg: this group's pairs of row 0,
// rows K / 2 apart): one vdpbf16ps per k pair and 16 outputs, twice the fp32 FMA loop's FLOPS (prefill rows)
template <int B, int MR, int V0, int VN>
inline void int4_rows_dp(const uint32_t* xg, int64_t K, const uint16_t* tile, int64_t gs, float* y, int64_t N,
                         bool first) {
  __m512 acc[MR][VN];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VN; ++v)
      acc[m][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + (V0 + v) * 16);
  for (int64_t kp = 0; kp < gs / 2; ++kp) {
    __m512bh w[VN];
    for (int v = 0; v < VN; ++v) w[v] = (__m512bh)_mm512_load_si512(tile + (kp * B + (V0 + v) * 16) * 2);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xg[m * (K / 2) + kp]));
      for (int v = 0; v < VN; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xv, w[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < VN; ++v) _mm512_storeu_ps(y + m * N + (V0 + v) * 16, acc[m][v]);
}

// two dequantized k rows (16 outputs each) as 16 lanes of bf16 pairs (even k low, odd k high; nearest even)
inline __m512i bf16_pairs(const v16& even, const v16& odd) {
  __m512 e, o;
  std::memcpy(&e, &even, 64);
  std::memcpy(&o, &odd, 64);
  const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e));
  const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(o));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// the tile path of int4_block with vdpbf16ps: group g of this block dequantized into bf16 pairs, then 8-row
// passes (and a tail of fewer rows) over it
template <int B>
void int4_group_dp(const uint32_t* xb, int64_t M, int64_t K, const uint8_t* pk, const v16* sc, const v16* ze,
                   int64_t g, int64_t gs, float* y, int64_t N, int64_t n0, uint16_t* tile) {
  constexpr int V = B / 16, H = V / 2;
  for (int64_t kk = 0; kk < gs; kk += 2) {
    const uint8_t* r0 = pk + (g * gs + kk) * (B / 2);
    const uint8_t* r1 = r0 + B / 2;
    uint16_t* t = tile + kk * B;  // pair kk / 2: [B][2]
    for (int h = 0; h < H; ++h) {
      v16 lo0, hi0, lo1, hi1;
      nibbles_to_float(r0 + h * 16, lo0, hi0);
      nibbles_to_float(r1 + h * 16, lo1, hi1);
      _mm512_store_si512(t + h * 32, bf16_pairs(lo0 * sc[h] + ze[h], lo1 * sc[h] + ze[h]));
      _mm512_store_si512(t + (H + h) * 32, bf16_pairs(hi0 * sc[H + h] + ze[H + h], hi1 * sc[H + h] + ze[H + h]));
    }
  }
  const bool first = g == 0;
  const uint32_t* xg = xb + g * gs / 2;
  int64_t m0 = 0;
  for (; m0 + 8 <= M; m0 += 8) {
    int4_rows_dp<B, 8, 0, H>(xg + m0 * (K / 2), K, tile, gs, y + m0 * N + n0, N, first);
    int4_rows_dp<B, 8, H, H>(xg + m0 * (K / 2), K, tile, gs, y + m0 * N + n0, N, first);
  }
  for (; m0 < M; ++m0) int4_rows_dp<B, 1, 0, V>(xg + m0 * (K / 2), K, tile, gs, y + m0 * N + n0, N, first);
}
#endif

bool int4_decode_int16() {
#ifdef MEMFIT_INT4_DPWSSD
  return true;
#else
  return false;
#endif
}

// xb: x as bf16 pairs where the tile path runs on vdpbf16ps (rows >= kDpbf16MinRows), else null
// xi: x rounded to int16 per group where decode rows run on vpdpwssd (int4_direct_dp), else null
template <int B>
void int4_block(const float* x, const uint32_t* xb, const Int16Groups* xi, int64_t M, int64_t K, const uint8_t* pk,
                const uint16_t* sz, int64_t N, int64_t n0, int64_t gs, float* y, float* tile) {
  constexpr int V = B / 16;  // output vectors per block
  const int64_t G = K / gs;
  for (int64_t g = 0; g < G; ++g) {
    // dequantize rows [g * gs, (g + 1) * gs) of this block: tile[kk][r], r < B
    // each output's (scale, zero) bf16 pair is one 32-bit word, the scale in its low half: 16 outputs a load
    v16 sc[V], ze[V];
    for (int v = 0; v < V; ++v) {
      vu16 u;
      std::memcpy(&u, sz + (g * N + n0 + v * 16) * 2, 64);
      sc[v] = bits_f32(u << 16);
      ze[v] = bits_f32(u & 0xFFFF0000u) - 8.f * sc[v];  // (q - 8) * s + z = q * s + (z - 8 s)
    }
    if (M <= 4) {  // few rows: multiply straight from the dequantized registers, no tile
#ifdef MEMFIT_INT4_DPWSSD
      if constexpr (B == 64) {
        if (xi) {
          const uint8_t* pg = pk + g * gs * (B / 2);
          switch (M) {
            case 1: int4_direct_dp<1>(*xi, K, pg, sc, ze, g, gs, y + n0, N, g == 0); break;
            case 2: int4_direct_dp<2>(*xi, K, pg, sc, ze, g, gs, y + n0, N, g == 0); break;
            case 3: int4_direct_dp_apart<3>(*xi, K, pg, sc, ze, g, gs, y + n0, N, g == 0); break;
            default: int4_direct_dp_apart<4>(*xi, K, pg, sc, ze, g, gs, y + n0, N, g == 0); break;
          }
          continue;
        }
      }
#endif
#ifndef __AVX512F__  // AVX2's 16 ymm hold 2 rows' accumulators and the weights (B = 32); 2-row passes
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const float* xm = x + m0 * K + g * gs;
        if (M - m0 >= 2) int4_direct<B, 2>(xm, K, pk + g * gs * (B / 2), sc, ze, gs, y + m0 * N + n0, N, g == 0);
        else int4_direct<B, 1>(xm, K, pk + g * gs * (B / 2), sc, ze, gs, y + m0 * N + n0, N, g == 0);
      }
      continue;
#endif
      switch (M) {
        case 1: int4_direct<B, 1>(x + g * gs, K, pk + g * gs * (B / 2), sc, ze, gs, y + n0, N, g == 0); break;
        case 2: int4_direct<B, 2>(x + g * gs, K, pk + g * gs * (B / 2), sc, ze, gs, y + n0, N, g == 0); break;
        case 3: int4_direct<B, 3>(x + g * gs, K, pk + g * gs * (B / 2), sc, ze, gs, y + n0, N, g == 0); break;
        default: int4_direct<B, 4>(x + g * gs, K, pk + g * gs * (B / 2), sc, ze, gs, y + n0, N, g == 0); break;
      }
      continue;
    }
#ifdef __AVX512BF16__
    if (xb) {
      int4_group_dp<B>(xb, M, K, pk, sc, ze, g, gs, y, N, n0, reinterpret_cast<uint16_t*>(tile));
      continue;
    }
#endif
    for (int64_t kk = 0; kk < gs; ++kk) {
      const uint8_t* row = pk + (g * gs + kk) * (B / 2);
      float* t = tile + kk * B;
      for (int h = 0; h < V / 2; ++h) {
        v16 lo, hi;
        nibbles_to_float(row + h * 16, lo, hi);
        *reinterpret_cast<v16*>(t + h * 16) = lo * sc[h] + ze[h];
        *reinterpret_cast<v16*>(t + B / 2 + h * 16) = hi * sc[V / 2 + h] + ze[V / 2 + h];
      }
    }
#ifndef __AVX512F__  // AVX2: 6 rows x 1 vector (12 of the 16 ymm) per pass over each of the tile's V vectors
    int64_t r0 = 0;
    for (; r0 + 6 <= M; r0 += 6) int4_rows_each<B, 6>(x + r0 * K + g * gs, K, tile, gs, y + r0 * N + n0, N, g == 0);
    const float* xr = x + r0 * K + g * gs;
    float* yr = y + r0 * N + n0;
    switch (M - r0) {
      case 1: int4_rows_each<B, 1>(xr, K, tile, gs, yr, N, g == 0); break;
      case 2: int4_rows_each<B, 2>(xr, K, tile, gs, yr, N, g == 0); break;
      case 3: int4_rows_each<B, 3>(xr, K, tile, gs, yr, N, g == 0); break;
      case 4: int4_rows_each<B, 4>(xr, K, tile, gs, yr, N, g == 0); break;
      case 5: int4_rows_each<B, 5>(xr, K, tile, gs, yr, N, g == 0); break;
      default: break;
    }
    continue;
#endif
    // 8 rows x 2 vectors (16 accumulators) per pass over half the tile's columns, then 4-row passes
    constexpr int H = V / 2;
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) {
      int4_rows<B, 8, 0, H>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0);
      int4_rows<B, 8, H, H>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0);
    }
    for (; m0 + 4 <= M; m0 += 4) int4_rows<B, 4, 0, V>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0);
    switch (M - m0) {
      case 1: int4_rows<B, 1, 0, V>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0); break;
      case 2: int4_rows<B, 2, 0, V>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0); break;
      case 3: int4_rows<B, 3, 0, V>(x + m0 * K + g * gs, K, tile, gs, y + m0 * N + n0, N, g == 0); break;
      default: break;
    }
  }
}

// y = x @ W^T for x [..., K] fp32 and W in torch's CPU int4 pack with B-row blocks (B = 32 or 64).
// bf16_dot: from 8 rows on, on AVX512-BF16, x and the dequantized weights are rounded to bf16 and multiplied
// with vdpbf16ps (twice the FLOPS of the exact fp32 path; the engine's bf16 mode asks for it).
// 1-4 rows with B = 64 on AVX512-VNNI + VBMI: x rounded to int16 per (row, group) and vpdpwssd (int4_direct_dp),
// in every mode.
// act (kSilu, kGeluTanh): W is [gate; up] (N rows, the halves each a multiple of B) and y [..., N / 2] gets
// act(gate) * up, each thread computing a gate block and its up block and combining them while they are in L1
// (as the panel kernel's epilogue; replaced at::silu, narrow and mul_ after the call)
at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zeros,
                       int64_t group_size, int64_t block, int64_t act, bool bf16_dot) {
  check_f32_cpu(x_in, "x");
  TORCH_CHECK(act == kNoAct || act == kSilu || act == kGeluTanh, "unknown activation ", act);
  const bool pairs = act != kNoAct;  // gate/up pairs
  TORCH_CHECK(block == 32 || block == 64, "block must be 32 or 64");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be torch's contiguous uint8 int4 pack [N, K / 2]");
  TORCH_CHECK(scale_zeros.scalar_type() == at::kBFloat16 && scale_zeros.dim() == 3 && scale_zeros.is_contiguous(),
              "scale_zeros must be contiguous bf16 [K / group_size, N, 2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % block == 0 && group_size > 0 && K % group_size == 0 && scale_zeros.size(0) == K / group_size &&
              scale_zeros.size(1) == N && scale_zeros.size(2) == 2, "int4 pack shapes mismatch");
  TORCH_CHECK(x_in.size(-1) == K, "x's last size ", x_in.size(-1), " != the weight's ", K);
  TORCH_CHECK(!pairs || (N / 2) % block == 0, "act_mul: each half of the weight must be a multiple of the block");
  auto x = x_in.contiguous();
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = pairs ? N / 2 : N;
  auto out = at::empty(sizes, x.options());
  if (M == 0) return out;
  auto y = pairs ? at::empty({M, N}, x.options()) : out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t nb = N / block, half = N / 2;
  const Bf16Pairs xbt(x, M, bf16_dot && group_size % 2 == 0);  // the dequantized tiles on vdpbf16ps
  const uint32_t* xb = xbt.p;
  const std::unique_ptr<Int16Groups> xig = int4_decode_int16() && block == 64 && M <= 4 && group_size % 2 == 0 &&
                                                    group_size < 4369
                                                ? std::make_unique<Int16Groups>(xp, M, K, group_size)
                                                : nullptr;
  const Int16Groups* xi = xig.get();
  at::parallel_for(0, pairs ? nb / 2 : nb, 1, [&](int64_t b0, int64_t b1) {
    // the dequantized tile of the 5+ row paths (1-4 rows multiply from registers): a decode call allocated and
    // zeroed it per thread for nothing (32 KiB at group 128)
    std::vector<float> buf(M > 4 ? group_size * block + 16 : 0);
    float* tile = M > 4 ? reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63))
                        : nullptr;
    auto run = [&](int64_t b) {
      const uint8_t* pk = pp + b * block * (K / 2);
      if (block == 64) int4_block<64>(xp, xb, xi, M, K, pk, szp, N, b * 64, group_size, yp, tile);
      else int4_block<32>(xp, xb, xi, M, K, pk, szp, N, b * 32, group_size, yp, tile);
    };
    for (int64_t b = b0; b < b1; ++b) {
      run(b);
      if (!pairs) continue;
      run(b + nb / 2);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = b * block; c < (b + 1) * block; c += 16) {
          const v16 g = *reinterpret_cast<const v16u*>(yp + m * N + c);
          const v16 u = *reinterpret_cast<const v16u*>(yp + m * N + half + c);
          *reinterpret_cast<v16u*>(op + m * half + c) =
              act == kSilu ? act_mul<kSilu>(g, u) : act_mul<kGeluTanh>(g, u);
        }
    }
  });
  return out;
}

}  // namespace memfit
