// The 4-bit Linear's decode rows (1-4 rows of x) on vpdpwssd (AVX512-VNNI, with AVX512-VBMI's byte permutation),
// for int4.cpp's int4_linear.
#pragma once

#include <immintrin.h>

#include <limits>

#include "common.h"

namespace memfit {

// x rounded to int16 per (row, group) with the scale max|x| / 32767, the group's 4-bit codes widened to int16 k
// pairs, and one vpdpwssd per k pair and 16 outputs summing q[k] x[k] exactly in int32 (15 * 32767 * gs fits for
// gs < 4369). The fp32 path widens each code to a float and spends an FMA on it: ~22 instructions per 64 codes
// against ~8 here, and at one row it ran at ~20 GB/s, below the memory's ~33 (Gemma 3's 4096 x 640 gate/up, 2
// threads). x's rounding is within 1.6e-5 of each group's largest |x|; bf16 x (the prefill's vdpbf16ps) is within
// 2^-9 of each value.
struct Int16Groups {
  std::vector<int16_t> q;    // [M][K]
  std::vector<float> s, xs;  // [M][K / gs]: the scale, and the sum of the rounded x (scale * sum q)
  Int16Groups(const float* x, int64_t M, int64_t K, int64_t gs) : q(M * K), s(M * (K / gs)), xs(M * (K / gs)) {
    const int64_t G = K / gs;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* xg = x + m * K + g * gs;
        float amax = 0.f;
        bool finite = true;  // std::max drops a NaN
        for (int64_t i = 0; i < gs; ++i) {
          amax = std::max(amax, std::fabs(xg[i]));
          finite = finite && std::isfinite(xg[i]);
        }
        int16_t* qg = q.data() + m * K + g * gs;
        if (!finite) {  // NaN / inf stay visible in y, as the fp32 path leaves them
          std::fill_n(qg, gs, int16_t{0});
          s[m * G + g] = xs[m * G + g] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        int64_t sum = 0;
        for (int64_t i = 0; i < gs; ++i) sum += qg[i] = static_cast<int16_t>(std::nearbyint(xg[i] * inv));
        s[m * G + g] = amax / 32767.f;
        xs[m * G + g] = s[m * G + g] * static_cast<float>(sum);
      }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define MEMFIT_INT4_DPWSSD 1
// int4_direct for B = 64 on vpdpwssd: group g of the MR rows of xi, y[m, :64] (+)= x̂[m] @ W[group]
template <int MR>
inline void int4_direct_dp(const Int16Groups& xi, int64_t K, const uint8_t* pk, const v16* sc,
                           const v16* ze, int64_t g, int64_t gs, float* y, int64_t N, bool first) {
  // torch's pack: row k is 32 bytes, byte j = output j (low nibble) and j + 32 (high). Two rows, 64 bytes, become
  // k pairs by one byte permutation per nibble half: byte 2j <- row k's byte j, 2j + 1 <- row k + 1's
  alignas(64) static const std::array<uint8_t, 64> kPairs = [] {
    std::array<uint8_t, 64> a{};
    for (int j = 0; j < 32; ++j) a[2 * j] = j, a[2 * j + 1] = 32 + j;
    return a;
  }();
  const __m512i perm = _mm512_load_si512(kPairs.data()), low = _mm512_set1_epi8(15);
  __m512i acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_setzero_si512();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xi.q.data() + g * gs);  // x pairs
  for (int64_t kk = 0; kk < gs; kk += 2) {
    const __m512i r = _mm512_loadu_si512(pk + kk * 32);
    __builtin_prefetch(pk + kk * 32 + 2048);  // 2 KiB ahead: 31 -> 34 GB/s at one row (79 MB of 4096 x 640 packs)
    const __m512i lo = _mm512_permutexvar_epi8(perm, _mm512_and_si512(r, low));  // outputs 0..31
    const __m512i hi = _mm512_permutexvar_epi8(perm, _mm512_and_si512(_mm512_srli_epi16(r, 4), low));  // 32..63
    const __m512i w[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)),
                          _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                          _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)),
                          _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[m * (K / 2) + kk / 2]));
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_dpwssd_epi32(acc[m][v], w[v], xv);
    }
  }
  const int64_t G = K / gs;
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 4; ++v) {
      v16 q;
      const __m512 f = _mm512_cvtepi32_ps(acc[m][v]);
      std::memcpy(&q, &f, 64);
      const v16 r = q * (xi.s[m * G + g] * sc[v]) + xi.xs[m * G + g] * ze[v];
      v16u* out = reinterpret_cast<v16u*>(y + m * N + v * 16);
      *out = first ? r : *out + r;
    }
}

// int4_direct_dp for 3-4 rows, out of line: inlined into int4_block, the caller's 8 scale and zero vectors took
// registers from the 16 accumulators and GCC spilled accumulators inside the k loop (4 rows, 21 MB weight, 2
// threads: 12.6 GB/s inlined, 20.3 out of line; 1-2 rows are as fast either way)
template <int MR>
__attribute__((noinline)) void int4_direct_dp_apart(const Int16Groups& xi, int64_t K, const uint8_t* pk,
                                                    const v16* sc, const v16* ze, int64_t g, int64_t gs, float* y,
                                                    int64_t N, bool first) {
  int4_direct_dp<MR>(xi, K, pk, sc, ze, g, gs, y, N, first);
}
#endif

}  // namespace memfit
