// Attention over the slot KV caches: decode (one query token per sequence) and prefill chunks (a run of
// consecutive positions of one sequence, causal over its cached prefix and itself).
#include <torch/extension.h>

#include <immintrin.h>

#include "common.h"

namespace memfit {

namespace {

// exp(p[l] - max) in place over p[0, L), 16 at a time (the tail in a padded vector); returns the sum, the max in m
inline float exp_row(float* p, int64_t L, float& m) {
  m = p[0];
  for (int64_t l = 1; l < L; ++l) m = std::max(m, p[l]);
  v16 vs = {};
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) {
    const v16 e = vexp(*reinterpret_cast<const v16u*>(p + l) - m);
    *reinterpret_cast<v16u*>(p + l) = e;
    vs += e;
  }
  float sum = hsum(vs);
  if (l < L) {
    v16 t;
    for (int i = 0; i < 16; ++i) t[i] = l + i < L ? p[l + i] - m : -100.f;
    t = vexp(t);
    for (int64_t i = 0; l + i < L; ++i) {
      p[l + i] = t[i];
      sum += t[i];
    }
  }
  return sum;
}

// softmax in place over p[0, L)
inline void softmax_row(float* p, int64_t L) {
  float m;
  const float inv = 1.f / exp_row(p, L, m);
  for (int64_t i = 0; i < L; ++i) p[i] *= inv;
}

// a run of consecutive key / value rows of one (sequence, KV head g): one block's part of the positions a work item
// reads, the first of them its row l; fp32 rows (K, V) or int8 rows (K8, V8) with a scale per row (ks, vs)
struct Span {
  const float *K, *V;
  const int8_t *K8, *V8;
  const float *ks, *vs;
  int64_t n, g, l;
};

// the rows of positions [lo, hi) of `slot`, block by block and within a block head by head: a block holds its KV
// heads' rows side by side ([KV, block_size, D]), so a whole block is one run of memory (16 KiB at 4 KV heads, D 64,
// blocks of 16) rather than KV runs of 4 KiB, 16 KiB apart, on which the hardware prefetcher restarts. Decode
// attention at batch 6 over 1000 positions, 2 threads: read head by head, 14-15 GB/s of paged cache against 23 of
// static slots; block by block, 24-27 GB/s over consecutive blocks (as static slots), ~17 over shuffled ones.
void spans_of(const KvPages& kv, int64_t slot, int64_t lo, int64_t hi, std::vector<Span>& out) {
  out.clear();
  for (int64_t p = lo; p < hi;) {
    const int64_t n = std::min(hi, (p / kv.bs + 1) * kv.bs) - p;
    for (int64_t g = 0; g < kv.KV; ++g) {
      const int64_t off = kv.at(slot, g, p);
      if (kv.q8)
        out.push_back({nullptr, nullptr, kv.k8 + off, kv.v8 + off, kv.ks + off / kv.D, kv.vs + off / kv.D, n, g,
                       p - lo});
      else
        out.push_back({kv.k + off, kv.v + off, nullptr, nullptr, nullptr, nullptr, n, g, p - lo});
    }
    p += n;
  }
}

// 16 values of a row from d (fp32, or int8 widened: its scale is applied per row by the caller)
template <bool Q8>
inline v16 row16(const float* f, const int8_t* q, int64_t d) {
  if constexpr (Q8)
    return i8_to_f32(q + d);
  else
    return *reinterpret_cast<const v16u*>(f + d);
}

// The rows a work item reads are prefetched in software kAheadBytes ahead of the row it reads, along its spans: a
// span is at most one block and the next block can be anywhere in the cache, where the hardware prefetcher starts
// over. 4 KiB ahead: 2 and 8 KiB were no faster, 16 KiB slower (and with head-by-head spans this cursor read ~16
// GB/s where prefetching a whole span, two spans ahead, read ~14).
constexpr int64_t kAheadBytes = 4096;

// a cursor over the K (or V) rows of spans: next() prefetches its row and moves on
struct RowPrefetch {
  const std::vector<Span>& spans;
  const bool value, q8;
  const int64_t row_bytes;
  size_t si = 0;
  int64_t i = 0;
  RowPrefetch(const std::vector<Span>& sp, bool v, bool q, int64_t D)
      : spans(sp), value(v), q8(q), row_bytes(D * (q ? 1 : 4)) {
    for (int64_t b = 0; b < kAheadBytes; b += row_bytes) next();
  }
  inline void next() {
    if (si >= spans.size()) return;
    const Span& sp = spans[si];
    const char* r = q8 ? reinterpret_cast<const char*>(value ? sp.V8 : sp.K8)
                       : reinterpret_cast<const char*>(value ? sp.V : sp.K);
    r += i * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(r + b);
    if (++i == sp.n) ++si, i = 0;
  }
};

// the scores of NJ query rows against one key row (p[j * L], j < NJ): the row is loaded (int8: widened) once for
// all NJ, not once a query row, so the widening is paid once per key (int8, Gemma 3's shapes, G = 4, batch 16
// at 514 positions: 3.7x -> 1.0x the time of fp32 rows)
template <bool Q8, int NJ>
inline void key_scores(const float* const* qs, const float* kf, const int8_t* kq, int64_t nd, float ksc, float* p,
                       int64_t L) {
  v16 a[NJ] = {};
  for (int64_t d = 0; d < nd; ++d) {
    const v16 k = row16<Q8>(kf, kq, d * 16);
    for (int j = 0; j < NJ; ++j) a[j] += reinterpret_cast<const v16u*>(qs[j])[d] * k;
  }
  for (int j = 0; j < NJ; ++j) p[j * L] = hsum(a[j]) * ksc;
}

// f(std::integral_constant<int, NJ>{}, j) for the query rows [j, j + NJ) of G, NJ <= 4 at a time: the score
// kernels keep NJ accumulators in registers, so NJ is a template argument
template <class F>
inline void in_fours(int64_t G, F&& f) {
  for (int64_t j = 0; j < G; j += 4) {
    switch (std::min<int64_t>(4, G - j)) {
      case 4: f(std::integral_constant<int, 4>{}, j); break;
      case 3: f(std::integral_constant<int, 3>{}, j); break;
      case 2: f(std::integral_constant<int, 2>{}, j); break;
      default: f(std::integral_constant<int, 1>{}, j);
    }
  }
}

// int8 keys against int16 queries (q16 = round(q / qs), |q16| <= 16383: a 15-bit query, relative error ~3e-5 of
// its largest value, next to int8's ~4e-3 on the key): vpmaddwd / vpdpwssd multiply 32 (16 on AVX2) int16 pairs
// per instruction and the key row is only sign-extended (int8 -> int16), not converted to float; the score is the
// exact int32 sum times qs * key scale * softmax scale. |sum| <= D * 16383 * 127 < 2^31 for D <= 512.
#if defined(__AVX512BW__)
#define MEMFIT_I16_DOT 1
constexpr int64_t kI16Lanes = 32;
template <int NJ>
inline void key_scores_i16(const int16_t* q16, const int8_t* kq, int64_t D, const float* qsc, float ksc, float* p,
                           int64_t L) {
  __m512i a[NJ];
  for (int j = 0; j < NJ; ++j) a[j] = _mm512_setzero_si512();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kq + d)));
    for (int j = 0; j < NJ; ++j) {
      const __m512i q = _mm512_loadu_si512(q16 + j * D + d);
#if defined(__AVX512VNNI__)
      a[j] = _mm512_dpwssd_epi32(a[j], k, q);
#else
      a[j] = _mm512_add_epi32(a[j], _mm512_madd_epi16(k, q));
#endif
    }
  }
  for (int j = 0; j < NJ; ++j) p[j * L] = static_cast<float>(_mm512_reduce_add_epi32(a[j])) * qsc[j] * ksc;
}
#elif defined(__AVX2__)
#define MEMFIT_I16_DOT 1
constexpr int64_t kI16Lanes = 16;
template <int NJ>
inline void key_scores_i16(const int16_t* q16, const int8_t* kq, int64_t D, const float* qsc, float ksc, float* p,
                           int64_t L) {
  __m256i a[NJ];
  for (int j = 0; j < NJ; ++j) a[j] = _mm256_setzero_si256();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256i k = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kq + d)));
    for (int j = 0; j < NJ; ++j)
      a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(k, _mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(q16 + j * D + d))));
  }
  for (int j = 0; j < NJ; ++j) {
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), a[j]);
    p[j * L] = static_cast<float>((t[0] + t[1]) + (t[2] + t[3]) + ((t[4] + t[5]) + (t[6] + t[7]))) * qsc[j] * ksc;
  }
}
#endif

#ifdef MEMFIT_I16_DOT
// G query rows as int16 (q16 [G, D]) and their scales, for key_scores_i16
inline void queries_i16(const float* const* qs, int64_t G, int64_t D, std::vector<int16_t>& q16,
                        std::vector<float>& qsc) {
  q16.resize(G * D);
  qsc.resize(G);
  for (int64_t j = 0; j < G; ++j) {
    float m = 0.f;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(qs[j][d]));
    const float inv = m > 0.f ? 16383.f / m : 0.f;
    qsc[j] = m / 16383.f;
    for (int64_t d = 0; d < D; ++d) q16[j * D + d] = static_cast<int16_t>(std::nearbyint(qs[j][d] * inv));
  }
}

#endif

// A decode work item: the H query rows of one sequence against its rows in spans (all KV heads; query row h reads
// head h / G), L rows in all. Scores go to p [H, L]; each row's exp leaves its max in m[h] and its sum in s[h]; the
// value rows weighted by the unnormalized exps go to out [H, D] (the caller merges a sequence's items). Each key
// and value row is loaded once for the G query rows of its head (accumulating in an [H, D] tile in L1); int8
// rows are widened 16 lanes at a time, the key's scale multiplies its score, the value's its probability.
template <bool Q8>
void attend_vec(const float* const* qs, const std::vector<Span>& spans, int64_t L, int64_t H, int64_t G, int64_t D,
                float sc, float* m, float* s, float* out, std::vector<float>& p, std::vector<v16>& acc,
                const int16_t* q16 = nullptr, const float* q16s = nullptr) {
  const int64_t nd = D / 16;
  p.resize(H * L);
  acc.assign(H * nd, v16{});
  RowPrefetch pk(spans, false, Q8, D);
  for (const Span& sp : spans) {
    const int64_t h0 = sp.g * G;
    for (int64_t i = 0; i < sp.n; ++i) {
      pk.next();
      float* pr = p.data() + h0 * L + sp.l + i;
      const float ksc = Q8 ? sp.ks[i] * sc : sc;
#ifdef MEMFIT_I16_DOT
      if (Q8 && q16) {
        in_fours(G, [&](auto nj, int64_t j) {
          key_scores_i16<decltype(nj)::value>(q16 + (h0 + j) * D, sp.K8 + i * D, D, q16s + h0 + j, ksc,
                                              pr + j * L, L);
        });
        continue;
      }
#endif
      in_fours(G, [&](auto nj, int64_t j) {
        key_scores<Q8, decltype(nj)::value>(qs + h0 + j, Q8 ? nullptr : sp.K + i * D, Q8 ? sp.K8 + i * D : nullptr,
                                            nd, ksc, pr + j * L, L);
      });
    }
  }
  for (int64_t h = 0; h < H; ++h) s[h] = exp_row(p.data() + h * L, L, m[h]);
  float pl[64];  // G <= 64 (checked by AttnArgs)
  RowPrefetch pv(spans, true, Q8, D);
  for (const Span& sp : spans) {
    const int64_t h0 = sp.g * G;
    v16* a = acc.data() + h0 * nd;
    for (int64_t i = 0; i < sp.n; ++i) {
      pv.next();
      const float* vf = Q8 ? nullptr : sp.V + i * D;
      const int8_t* vq = Q8 ? sp.V8 + i * D : nullptr;
      const float vsc = Q8 ? sp.vs[i] : 1.f;
      for (int64_t j = 0; j < G; ++j) pl[j] = p[(h0 + j) * L + sp.l + i] * vsc;
      for (int64_t d = 0; d < nd; ++d) {
        const v16 v = row16<Q8>(vf, vq, d * 16);
        for (int64_t j = 0; j < G; ++j) a[j * nd + d] += pl[j] * v;
      }
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t d = 0; d < nd; ++d) *reinterpret_cast<v16u*>(out + h * D + d * 16) = acc[h * nd + d];
}

// the same for any D, one element at a time
void attend_scalar(const float* const* qs, const std::vector<Span>& spans, int64_t L, int64_t H, int64_t G,
                   int64_t D, float sc, float* m, float* s, float* out, std::vector<float>& p) {
  auto elem = [D](const float* f, const int8_t* q, const float* s, int64_t i, int64_t d) {
    return f ? f[i * D + d] : static_cast<float>(q[i * D + d]) * s[i];
  };
  p.resize(H * L);
  for (const Span& sp : spans)
    for (int64_t i = 0; i < sp.n; ++i)
      for (int64_t h = sp.g * G; h < (sp.g + 1) * G; ++h) {
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += qs[h][d] * elem(sp.K, sp.K8, sp.ks, i, d);
        p[h * L + sp.l + i] = a * sc;
      }
  for (int64_t h = 0; h < H; ++h) s[h] = exp_row(p.data() + h * L, L, m[h]);
  std::fill_n(out, H * D, 0.f);
  for (const Span& sp : spans)
    for (int64_t i = 0; i < sp.n; ++i)
      for (int64_t h = sp.g * G; h < (sp.g + 1) * G; ++h)
        for (int64_t d = 0; d < D; ++d) out[h * D + d] += p[h * L + sp.l + i] * elem(sp.V, sp.V8, sp.vs, i, d);
}

// What the two attention kernels share: the checks on q [rows, H, D] (last dim contiguous, e.g. the query heads of
// the fused qkv output) and on the paged caches (KvPages), and where a query vector starts
struct AttnArgs {
  KvPages kv;
  int64_t rows, H, D, KV, G;
  float sc;
  const float* qp;
  int64_t sq0, sq1;

  AttnArgs(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table, double scale,
           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale)
      : kv(kc, vc, table, q.size(-1), k_scale, v_scale) {
    check_f32_cpu(q, "q");
    TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, H, D] with a contiguous last dim");
    rows = q.size(0), H = q.size(1), D = q.size(2), KV = kv.KV;
    TORCH_CHECK(H % KV == 0, "query heads must be a multiple of the KV heads");
    G = H / KV;
    TORCH_CHECK(G <= 64, "at most 64 query heads per KV head");
    sc = static_cast<float>(scale);
    qp = q.data_ptr<float>();
    sq0 = q.stride(0), sq1 = q.stride(1);
  }
  const float* query(int64_t row, int64_t head) const { return qp + row * sq0 + head * sq1; }
};

}  // namespace

// One query token per sequence: out[i, h] = softmax(q[i, h] . K[slot_i, h / G, lo_i:len_i] * scale) V[...], with
// lo_i = max(0, len_i - window) for a sliding window (HF's rule: the query at position p sees keys p - window < j
// <= p) and 0 without one (window 0). q [n, H, D] (last dim contiguous), paged caches (KvPages); G = H / KV query
// heads share a KV head, so each key and value row is loaded once for the G of them.
// A work item is one sequence's rows in a range of positions, all heads (spans_of: whole blocks are read as one
// run); a sequence's rows are split into ranges (flash-decoding's split) so that a step has about kItemsPerThread
// items a thread, for small batches and long contexts, then its items' partial results are merged exactly.
// Ranges are kMinItemRows long at least, except where the step has fewer rows than that per thread: then they are
// a thread's share of them, kMinSplitRows at least (at batch 1, 200 positions were one item and 300 two of 256
// and 44 rows: one thread read the K/V while the other waited).
constexpr int64_t kItemsPerThread = 4, kMinItemRows = 256, kMinSplitRows = 64;

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                            const at::Tensor& slots, const at::Tensor& lens, double scale, int64_t window,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  const AttnArgs A(q, kc, vc, table, scale, k_scale, v_scale);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  const int64_t n = A.rows, H = A.H, D = A.D, G = A.G;
  auto sl = checked_indices(slots, n, 0, A.kv.slots, "slot");
  auto ln = checked_indices(lens, n, 1, A.kv.MB * A.kv.bs + 1, "length");
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* lnp = ln.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) A.kv.span(slp[i], lnp[i]);
  auto lo_of = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, lnp[i] - window) : 0; };
  // the items: rows [a, b) of sequence i, ranges of R rows (a multiple of 16) aligned to multiples of R
  int64_t rows = 0;
  for (int64_t i = 0; i < n; ++i) rows += lnp[i] - lo_of(i);
  const int64_t threads = at::get_num_threads(), want = kItemsPerThread * threads;
  const int64_t least = std::min(kMinItemRows, std::max(kMinSplitRows, (rows + threads - 1) / threads));
  const int64_t R = (std::max(least, (rows + want - 1) / want) + 15) / 16 * 16;
  std::vector<std::array<int64_t, 3>> items;
  std::vector<int64_t> first(n + 1);  // sequence i's items are [first[i], first[i + 1])
  for (int64_t i = 0; i < n; ++i) {
    first[i] = static_cast<int64_t>(items.size());
    for (int64_t a = lo_of(i), b; a < lnp[i]; a = b) {
      b = std::min(lnp[i], (a / R + 1) * R);
      items.push_back({i, a, b});
    }
  }
  first[n] = static_cast<int64_t>(items.size());
  const int64_t ni = first[n];
  std::vector<float> ms(ni * H), ss(ni * H), part(ni * H * D);  // per item: max, sum and weighted values per head
  at::parallel_for(0, ni, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> p;
    std::vector<v16> acc;
    std::vector<Span> spans;
#ifdef MEMFIT_I16_DOT
    std::vector<int16_t> q16;
    std::vector<float> q16s;
#endif
    std::vector<const float*> qs(H);
    for (int64_t w = w0; w < w1; ++w) {
      const auto [i, a, b] = items[w];
      spans_of(A.kv, slp[i], a, b, spans);
      for (int64_t h = 0; h < H; ++h) qs[h] = A.query(i, h);
      float *m = ms.data() + w * H, *s = ss.data() + w * H, *o = part.data() + w * H * D;
      if (D % 16 == 0 && A.kv.q8) {
#ifdef MEMFIT_I16_DOT
        if (D % kI16Lanes == 0 && D <= 512) {
          queries_i16(qs.data(), H, D, q16, q16s);
          attend_vec<true>(qs.data(), spans, b - a, H, G, D, A.sc, m, s, o, p, acc, q16.data(), q16s.data());
          continue;
        }
#endif
        attend_vec<true>(qs.data(), spans, b - a, H, G, D, A.sc, m, s, o, p, acc);
      } else if (D % 16 == 0) {
        attend_vec<false>(qs.data(), spans, b - a, H, G, D, A.sc, m, s, o, p, acc);
      } else {
        attend_scalar(qs.data(), spans, b - a, H, G, D, A.sc, m, s, o, p);
      }
    }
  });
  // merge: out = sum_w e^(m_w - M) o_w / sum_w e^(m_w - M) s_w over the sequence's items, M their largest max
  auto out = at::empty({n, H, D}, q.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = r / H, h = r % H;
      float M = -INFINITY, S = 0.f;
      for (int64_t w = first[i]; w < first[i + 1]; ++w) M = std::max(M, ms[w * H + h]);
      float* dst = op + r * D;
      std::fill_n(dst, D, 0.f);
      for (int64_t w = first[i]; w < first[i + 1]; ++w) {
        const float f = std::exp(ms[w * H + h] - M);
        S += f * ss[w * H + h];
        const float* src = part.data() + (w * H + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += f * src[d];
      }
      const float inv = 1.f / S;
      for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
    }
  });
  return out;
}

// ---- prefill chunks --------------------------------------------------------------------------------------------
// Why our own: a serving step's prompt chunks are short (the benchmark's are 64 tokens, 4 per step), and aten's
// CPU flash kernel spends most of such a call on setup, not arithmetic (hot, 2 threads, 8 query / 4 KV heads,
// D 64: ~110 us a 64-token chunk, i.e. ~20 GFLOP/s). Here every (chunk, KV head, block of kRows positions) is
// one work item over all the step's chunks: the scores of the block's G * kRows query vectors against 32 keys at
// a time (each chunk's keys transposed once for all its blocks, then broadcast-FMAs, no horizontal sums), an
// exact softmax per row over its causal length (and sliding window), then the value rows weighted into
// accumulators held in registers. The scores are materialized (kRows * G * keys floats per thread) and the
// transposed keys take KV * keys * D floats per chunk, keys = the chunk's end (with a sliding window: its end
// less the keys before its first row's window), hence the key bound; longer contexts take aten's flash kernel.
namespace {

constexpr int64_t kRows = 8;
constexpr int64_t kMaxKeys = 1024;  // past ~1k keys aten's flash kernel was as fast (2 threads, D 64)

#ifdef __AVX512F__
constexpr int64_t kScoreRows = 8;  // score_block's Q: 2 x 8 accumulators of the 32 zmm
#else
constexpr int64_t kScoreRows = 2;  // 2 x 2 v16, 8 of AVX2's 16 ymm
#endif

// dst[i][lb, lb + 32) = sc * (q_i . K[l]) for Q query vectors and 32 keys, given as two blocks of 16 transposed
// ([D][16] each): per d, two key vectors loaded and each q_i[d] broadcast for two FMAs (a 2 x Q register tile)
template <int Q>
inline void score_block(const float* const* qs, const float* KT, int64_t D, float sc, float* const* dst,
                        int64_t lb) {
  v16 acc0[Q] = {}, acc1[Q] = {};
  const float* KT1 = KT + 16 * D;
  for (int64_t d = 0; d < D; ++d) {
    const v16 k0 = *reinterpret_cast<const v16u*>(KT + d * 16);
    const v16 k1 = *reinterpret_cast<const v16u*>(KT1 + d * 16);
    for (int i = 0; i < Q; ++i) {
      const float x = qs[i][d];
      acc0[i] += x * k0;
      acc1[i] += x * k1;
    }
  }
  for (int i = 0; i < Q; ++i) {
    *reinterpret_cast<v16u*>(dst[i] + lb) = acc0[i] * sc;
    *reinterpret_cast<v16u*>(dst[i] + lb + 16) = acc1[i] * sc;
  }
}

// outs[j] = sum_l ps[j][l] * V[l] for nq (a multiple of 16 / ND) probability rows; D = 16 * ND
template <int ND>
void weigh_values(const float* const* ps, int64_t nq, const float* V, int64_t L, float* const* outs) {
#ifdef __AVX512F__
  constexpr int Q = 16 / ND, DB = ND;  // Q rows x DB vectors of D per pass: 16 of the 32 zmm
#else
  constexpr int DB = ND < 4 ? ND : 4, Q = ND < 4 ? 4 / ND : 1;  // 4 v16, 8 of AVX2's 16 ymm
#endif
  for (int64_t j0 = 0; j0 < nq; j0 += Q)
    for (int d0 = 0; d0 < ND; d0 += DB) {
      v16 acc[Q][DB] = {};
      for (int64_t l = 0; l < L; ++l) {
        const v16u* vr = reinterpret_cast<const v16u*>(V + l * ND * 16) + d0;
        for (int i = 0; i < Q; ++i) {
          const float p = ps[j0 + i][l];
          for (int d = 0; d < DB; ++d) acc[i][d] += p * vr[d];
        }
      }
      for (int i = 0; i < Q; ++i)
        for (int d = 0; d < DB; ++d) *reinterpret_cast<v16u*>(outs[j0 + i] + (d0 + d) * 16) = acc[i][d];
    }
}

void weigh_values_any(const float* const* ps, int64_t nq, const float* V, int64_t L, int64_t D, float* const* outs) {
  switch (D / 16) {
    case 1: return weigh_values<1>(ps, nq, V, L, outs);
    case 2: return weigh_values<2>(ps, nq, V, L, outs);
    case 4: return weigh_values<4>(ps, nq, V, L, outs);
    case 8: return weigh_values<8>(ps, nq, V, L, outs);
    case 16: return weigh_values<16>(ps, nq, V, L, outs);
  }
  TORCH_CHECK(false, "prefill_attention: unsupported head_dim ", D);
}

}  // namespace

bool prefill_attention_fits(int64_t head_dim, int64_t keys) {
  const int64_t nd = head_dim / 16;
  return head_dim % 16 == 0 && (nd == 1 || nd == 2 || nd == 4 || nd == 8 || nd == 16) && keys <= kMaxKeys;
}

// the first key a chunk starting at `start` reads: its first query's window starts there (window 0: none)
int64_t first_key(int64_t start, int64_t window) { return window > 0 ? std::max<int64_t>(0, start - window + 1) : 0; }

// out[a + r, h] = softmax(q[a + r, h] . K[slot, h / G, lo_r:start + r + 1] * scale) V[...] for each chunk
// (a, n, slot, start) of segs and r < n, lo_r = first_key(start + r, window); the chunk's keys and values are in the
// paged caches already (rope_store). q [T, H, D] (last dim contiguous), out [T, H, D] contiguous; rows of no chunk
// are left as they are.
void prefill_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
                       at::Tensor& out, const std::vector<int64_t>& segs, double scale, int64_t window,
                       const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  const AttnArgs A(q, kc, vc, table, scale, k_scale, v_scale);
  const KvPages& kv = A.kv;
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  check_f32_cpu(out, "out");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, q's shape");
  TORCH_CHECK(segs.size() % 4 == 0, "segs: (offset, length, slot, start) per chunk");
  const int64_t T = A.rows, H = A.H, D = A.D, KV = A.KV, G = A.G;
  std::vector<std::array<int64_t, 3>> items;  // (chunk, KV head, first row)
  std::vector<int64_t> kt_at;  // per (chunk, KV head): where its transposed keys start in kt
  std::vector<int64_t> vt_at;  // per (chunk, KV head): where its gathered values start in vt, -1: read in place
  int64_t kt_size = 0, vt_size = 0;
  for (size_t c = 0; c < segs.size(); c += 4) {
    const int64_t a = segs[c], n = segs[c + 1], slot = segs[c + 2], start = segs[c + 3];
    TORCH_CHECK(a >= 0 && n > 0 && a + n <= T && start >= 0, "prefill_attention: chunk out of range");
    kv.span(slot, start + n);
    const int64_t k0 = first_key(start, window), keys = start + n - k0;
    TORCH_CHECK(prefill_attention_fits(D, keys), "prefill_attention: head_dim or length not supported");
    // fp32 values inside one block are read in place (the static cache's case); across blocks, or int8, gathered
    // (and widened) once
    const bool gather = kv.q8 || k0 / kv.bs != (start + n - 1) / kv.bs;
    for (int64_t g = 0; g < KV; ++g) {
      kt_at.push_back(kt_size);
      kt_size += (keys + 31) / 32 * 32 * D;
      vt_at.push_back(gather ? vt_size : -1);
      vt_size += gather ? keys * D : 0;
      for (int64_t r = 0; r < n; r += kRows) items.push_back({static_cast<int64_t>(c), g, r});
    }
  }
  float* op = out.data_ptr<float>();
  // each chunk's keys [k0, end) per KV head (k0 = first_key(start)), transposed once for all of its row blocks, in
  // blocks of 16 keys ([(end - k0) / 16][D][16], zeros past end up to a multiple of 32): transposing per work item
  // instead cost as much as the score FMAs at long prefixes. Values spread over several blocks are gathered to
  // [end - k0][D] in the same pass.
  std::vector<float> kt(kt_size), vt(vt_size);
  at::parallel_for(0, static_cast<int64_t>(kt_at.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c = p / KV * 4, g = p % KV, slot = segs[c + 2], k0 = first_key(segs[c + 3], window);
      const int64_t L = segs[c + 3] + segs[c + 1] - k0;
      float* dst = kt.data() + kt_at[p];
      std::vector<float> row(D);
      for (int64_t lb = 0; lb < (L + 31) / 32 * 32; lb += 16, dst += 16 * D)
        for (int64_t i = 0; i < 16; ++i) {
          if (lb + i >= L) {
            for (int64_t d = 0; d < D; ++d) dst[d * 16 + i] = 0.f;
            continue;
          }
          const float* K = row.data();
          if (kv.q8)
            kv.load(false, kv.at(slot, g, k0 + lb + i), row.data());
          else
            K = kv.k + kv.at(slot, g, k0 + lb + i);
          for (int64_t d = 0; d < D; ++d) dst[d * 16 + i] = K[d];
        }
      if (vt_at[p] >= 0)
        for (int64_t l = 0; l < L; ++l) kv.load(true, kv.at(slot, g, k0 + l), vt.data() + vt_at[p] + l * D);
    }
  });
  // query vectors of an item, padded to a multiple of 16 for the 8-query score tiles and the value loop's 16 / ND
  const int64_t nq_max = (kRows * G + 15) / 16 * 16;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> P, zero_q(D, 0.f), sink(D);
    std::vector<const float*> qs(nq_max);
    std::vector<float*> rows(nq_max), outs(nq_max);
    std::vector<int64_t> from(nq_max), lens(nq_max);
    for (int64_t w = w0; w < w1; ++w) {
      const auto [c, g, r0] = items[w];
      const int64_t a = segs[c], n = segs[c + 1], slot = segs[c + 2], start = segs[c + 3];
      // this item's keys: [k0 + lb0, k0 + L) of the chunk's transposed [k0, end), lb0 a whole 32-key block (0
      // without a window) at or before the window of its first row
      const int64_t k0 = first_key(start, window), r1 = std::min(n, r0 + kRows), L = start + r1 - k0;
      const int64_t lb0 = (first_key(start + r0, window) - k0) / 32 * 32, Lpad = (L + 31) / 32 * 32 - lb0;
      const int64_t nq = (r1 - r0) * G, nq_pad = (nq + 15) / 16 * 16;
      const float* KT = kt.data() + kt_at[c / 4 * KV + g];
      const int64_t pg = c / 4 * KV + g;
      const float* V = (vt_at[pg] >= 0 ? vt.data() + vt_at[pg] : kv.v + kv.at(slot, g, k0)) + lb0 * D;
      P.assign(nq_pad * Lpad, 0.f);
      for (int64_t j = 0; j < nq_pad; ++j) {
        const bool real = j < nq;
        const int64_t r = r0 + j / G, h = g * G + j % G;
        qs[j] = real ? A.query(a + r, h) : zero_q.data();
        outs[j] = real ? op + ((a + r) * H + h) * D : sink.data();
        rows[j] = P.data() + j * Lpad;
        // the row's keys [from[j], lens[j]) of the item's [0, Lpad): causal, and inside its window
        from[j] = real ? first_key(start + r, window) - k0 - lb0 : 0;
        lens[j] = real ? start + r + 1 - k0 - lb0 : 0;
      }
      for (int64_t lb = lb0; lb < L; lb += 32)
        for (int64_t j = 0; j < nq_pad; j += kScoreRows)
          score_block<kScoreRows>(qs.data() + j, KT + lb * D, D, A.sc, rows.data() + j, lb - lb0);
      for (int64_t j = 0; j < nq_pad; ++j) {  // exact zeros outside the row's keys
        if (lens[j] > 0) softmax_row(rows[j] + from[j], lens[j] - from[j]);
        std::fill(rows[j], rows[j] + from[j], 0.f);
        std::fill(rows[j] + lens[j], rows[j] + Lpad, 0.f);
      }
      weigh_values_any(rows.data(), nq_pad, V, L - lb0, D, outs.data());
    }
  });
}

}  // namespace memfit
