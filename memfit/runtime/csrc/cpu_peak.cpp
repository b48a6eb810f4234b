// What the CPU can do, for the kernels' choices and the benchmarks' ceilings: whether these kernels have
// AVX512-BF16, and a register-only loop's peak GFLOPS (bench/bf16.py measures the panel GEMMs against it).
#include <immintrin.h>

#include <chrono>

#include "common.h"

namespace memfit {

bool has_avx512_bf16() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

// The CPU's peak GFLOPS for fp32 FMAs (bf16 = false) or vdpbf16ps (bf16 = true) on all threads: a loop on
// registers only (independent accumulators filling the vector registers, no memory), the ceiling the panel GEMMs
// are measured against.
double peak_gflops(bool bf16, int64_t iters) {
#ifdef __AVX512F__
  constexpr int kFmaAcc = 16;  // of 32 zmm registers
#else
  constexpr int kFmaAcc = 6;  // two ymm each, of 16 (12 independent FMA chains: 2 FMA units x latency 4 need 8)
#endif
  TORCH_CHECK(!bf16 || has_avx512_bf16(), "peak_gflops: these kernels have no AVX512-BF16");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * 16);
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      v16 acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = v16{} + 1e-3f * i;
      v16 a = v16{} + 0.9999f, c = v16{} + 1e-4f;  // converges: no overflow
#ifdef __AVX512BF16__
      if (bf16) {
        __m512 A[16];
        std::memcpy(A, acc, sizeof(A));
        __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3f7f3f7f);
        for (int64_t it = 0; it < iters; ++it)
          for (int i = 0; i < 16; ++i) {
            A[i] = _mm512_dpbf16_ps(A[i], x, y);
            asm volatile("" : "+v"(A[i]));  // keep every instruction
          }
        std::memcpy(acc, A, sizeof(A));
      } else
#endif
        for (int64_t it = 0; it < iters; ++it)
          for (int i = 0; i < kFmaAcc; ++i) {
            acc[i] = acc[i] * a + c;
#ifdef __AVX512F__  // keep every instruction
            asm volatile("" : "+v"(acc[i]));
#else
            asm volatile("" : "+x"(acc[i].lo), "+x"(acc[i].hi));
#endif
          }
      v16 sum = v16{};
      for (int i = 0; i < 16; ++i) sum += acc[i];
      std::memcpy(&sink[t * 16], &sum, 64);
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // per instruction and lane: one FMA (2 flops) in fp32, two multiply-adds (4 flops) in vdpbf16ps
  return static_cast<double>(threads) * iters * (bf16 ? 16 : kFmaAcc) * 16 * (bf16 ? 4 : 2) / s / 1e9 +
         (sink[0] == 1234.5f ? 1e-9 : 0.0);  // the sums are used
}

}  // namespace memfit
