// 16 lanes of float (v16), int32 (vi16) or uint32 (vu16): the kernels' vector types, and the few helpers whose
// spelling differs between the two ways they are built.
//
// With AVX-512 they are GCC's generic vectors of 64 bytes: one zmm register each. Without it (AVX2 hosts) GCC has
// no 64-byte vector mode and keeps such vectors in memory, every operation a load and a store: a register-only FMA
// loop ran at 7.4 GFLOPS a core instead of 42 (g++ 12, -march=znver3), and the panel GEMM at 4 GFLOPS on 2 cores
// against MKL's 100. There they are two 8-lane halves, each one ymm register, with the operators the kernels use.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace memfit {

#ifdef __AVX512F__

typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
typedef int32_t vi16 __attribute__((vector_size(64), aligned(64)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(64)));

inline v16 vmin(v16 a, float b) { return a < b ? a : b; }
inline v16 vmax(v16 a, float b) { return a > b ? a : b; }
inline v16 vfloor_from_trunc(v16 n, v16 x) { return n > x ? n - 1.f : n; }  // n = trunc(x)
inline vi16 to_i32(v16 a) { return __builtin_convertvector(a, vi16); }
inline v16 to_f32(vi16 a) { return __builtin_convertvector(a, v16); }
inline v16 bits_f32(vu16 a) { v16 r; std::memcpy(&r, &a, 64); return r; }
inline v16 bits_f32(vi16 a) { v16 r; std::memcpy(&r, &a, 64); return r; }
// 16 int8 values widened to floats
inline v16 i8_to_f32(const int8_t* p) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  v16 r;
  std::memcpy(&r, &f, 64);
  return r;
}
// the sum of 16 lanes as a tree of halves (4 dependent adds, not 15: a decode key row's G dot products each end in
// one, and the serial chain was the K loop's bottleneck)
inline float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#else  // AVX2: two ymm halves

typedef float f8 __attribute__((vector_size(32)));
typedef float f8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint32_t u8x __attribute__((vector_size(32)));

struct v16u;

struct alignas(64) v16 {
  f8 lo, hi;
  v16() = default;  // v16{} is zero, `v16 x;` uninitialized, as a generic vector
  v16(f8 l, f8 h) : lo(l), hi(h) {}
  inline v16(const v16u& u);  // an unaligned load
  float& operator[](int i) { return reinterpret_cast<float*>(this)[i]; }
  float operator[](int i) const { return reinterpret_cast<const float*>(this)[i]; }
  v16& operator+=(v16 b) { lo += b.lo; hi += b.hi; return *this; }
  v16& operator-=(v16 b) { lo -= b.lo; hi -= b.hi; return *this; }
  v16& operator*=(v16 b) { lo *= b.lo; hi *= b.hi; return *this; }
  v16& operator*=(float b) { lo *= b; hi *= b; return *this; }
};

struct __attribute__((may_alias)) v16u {
  f8u lo, hi;
  v16u& operator=(const v16& v) { lo = v.lo; hi = v.hi; return *this; }
};
inline v16::v16(const v16u& u) : lo(u.lo), hi(u.hi) {}

inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(v16 a, v16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator/(v16 a, v16 b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline v16 operator+(v16 a, float b) { return {a.lo + b, a.hi + b}; }
inline v16 operator-(v16 a, float b) { return {a.lo - b, a.hi - b}; }
inline v16 operator*(v16 a, float b) { return {a.lo * b, a.hi * b}; }
inline v16 operator/(v16 a, float b) { return {a.lo / b, a.hi / b}; }
inline v16 operator+(float a, v16 b) { return {a + b.lo, a + b.hi}; }
inline v16 operator-(float a, v16 b) { return {a - b.lo, a - b.hi}; }
inline v16 operator*(float a, v16 b) { return {a * b.lo, a * b.hi}; }
inline v16 operator/(float a, v16 b) { return {a / b.lo, a / b.hi}; }
inline v16 operator-(v16 a) { return {-a.lo, -a.hi}; }

template <typename H>
struct alignas(64) Int16Lanes {  // vi16 (H = i8x) and vu16 (H = u8x)
  H lo, hi;
  Int16Lanes operator+(int b) const { return {lo + b, hi + b}; }
  Int16Lanes operator<<(int b) const { return {lo << b, hi << b}; }
  Int16Lanes operator&(uint32_t b) const { return {lo & b, hi & b}; }
};
typedef Int16Lanes<i8x> vi16;
typedef Int16Lanes<u8x> vu16;

inline v16 vmin(v16 a, float b) { return {a.lo < b ? a.lo : b, a.hi < b ? a.hi : b}; }
inline v16 vmax(v16 a, float b) { return {a.lo > b ? a.lo : b, a.hi > b ? a.hi : b}; }
inline v16 vfloor_from_trunc(v16 n, v16 x) {
  return {n.lo > x.lo ? n.lo - 1.f : n.lo, n.hi > x.hi ? n.hi - 1.f : n.hi};
}
inline vi16 to_i32(v16 a) { return {__builtin_convertvector(a.lo, i8x), __builtin_convertvector(a.hi, i8x)}; }
inline v16 to_f32(vi16 a) { return {__builtin_convertvector(a.lo, f8), __builtin_convertvector(a.hi, f8)}; }
template <typename H>
inline v16 bits_f32(Int16Lanes<H> a) { return {(f8)a.lo, (f8)a.hi}; }
inline v16 i8_to_f32(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 l = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m256 h = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  return {(f8)l, (f8)h};
}
inline float hsum(v16 v) {
  typedef float v4 __attribute__((vector_size(16)));
  const f8 a = v.lo + v.hi;
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#endif

}  // namespace memfit
