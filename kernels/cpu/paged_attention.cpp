// Paged attention on the CPU: PagedAttention (Kwon et al. 2023), reading K/V in place.
//
// Every query token of a step attends to its context (or the last `sliding_window` positions of
// it): a decode sequence's one new token, and a prompt's (prompt chunk's, draft's) token at
// position p, whose context is positions 0..p of its sequence (query_start_loc says which rows
// are whose). Keys and values stay where they are in the paged cache, reached through the block
// table; nothing is gathered or padded, and no slot past a sequence's end reaches an output.
//
//   scores[r, t] = scale * q[r] . k[t]            (float32 accumulation)
//   p[r, t]      = exp(scores[r, t] - max_t scores[r, t]) / sum_t exp(...)
//   out[r]       = sum_t p[r, t] * v[t]           (float32 accumulation, one division at the end)
//
// Two kinds of work items, shared out by their cost to the threads of at::parallel_for (ATen's
// OpenMP pool, so torch.set_num_threads applies; see share_out: contexts differ in length, and
// a prompt's later tokens have more of it, so equal counts would be uneven):
//
// - one token and KV head, or one token and all its KV heads when a step has many such tokens
//   (decodes; prompts where tiles do not apply; see Item): the num_heads / num_kv_heads query heads
//   that share a KV head (GQA), in a pass over the K blocks and one over the V blocks, the
//   softmax between them in AVX-512. Decode
//   attention reads each K/V row once for little arithmetic, so it is bound by memory: the rows of
//   the block two ahead are prefetched into L2 while a block is read (the blocks are scattered,
//   the hardware prefetcher cannot follow). Groups of 16 positions from a block's start (8 when the
//   block size is a multiple of 8 but not of 16) go through AVX-512 intrinsics where the CPU has
//   them (the dot products reduced together; the V sums in registers); positions after an
//   unaligned window start and other CPUs take plain loops compiled
//   for AVX-512, AVX2 and baseline x86-64 (GCC target_clones, picked at load time), so the built
//   library may move between x86 machines;
// - a tile of a prompt (float32, AVX-512, head_dim a multiple of 16, block_size a multiple of
//   8): 16 (token, head) rows of one KV head as the 16 lanes of a vector (see attend_tile), so
//   each K/V element loaded serves 16 rows; it is compute-bound, like the matrix products it
//   replaces.
//
// A row's result depends on its own query and context alone, never on the other rows of its
// tile or the step: the same bits for a prompt prefilled whole or in chunks (a one-token chunk,
// such as the last prompt token recomputed after a prefix-cache hit, goes to a tile when
// prompt_seqs marks its sequence), and whatever the batch (a decoded token takes the first
// kind, another summation order).
// The Python wrapper is kernels/cpu/paged_attention.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPILOT_X86 1
#define KVPILOT_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#include <immintrin.h>
#else
#define KVPILOT_X86 0
#define KVPILOT_TARGET_CLONES
#endif

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the upper half of a float32: a shift, which the compiler vectorizes.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void from_float(float x, float* out) { *out = x; }

inline void from_float(float x, c10::BFloat16* out) { *out = c10::BFloat16(x); }

// exp(x) for x <= 0 (a score minus the row's maximum): Cephes' expf (range reduction to
// x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial), within 1 ulp of std::exp on every
// float in [-87, 0] (checked exhaustively), as plain arithmetic that exp_nonpositive16 repeats
// on 16 lanes, operation for operation (the same bits; the scalar loop is for CPUs without
// AVX-512). Below -87 (exp < 2^-125: nothing next to the maximum's 1) it returns 0; NaN stays
// NaN. The constants, shared with the 16-lane version (exp_nonpositive16).
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  const float n = std::floor(x * kLog2e + 0.5f);
  const float clamped_n = std::max(n, -126.f);
  const float r = x - clamped_n * kLn2High + clamped_n * kLn2Low;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(clamped_n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.f ? 0.f : p * two_n;
}

// Asks for the cache lines of `count` elements at `p` (a K or V row needed soon) into L2, not
// L1 (prefetcht1, locality 2), as every K/V prefetch here: a prefetch into L1 holds one of the
// core's few L1 miss buffers until its line arrives from memory, and a block of rows two blocks
// ahead is more lines than there are, so the loads waited behind the prefetches. On an AMD EPYC
// (Zen 4) decode attention over a 205 MB cache took 7.0-8.0 ms a step on two threads with L2
// prefetches against 13.6-14.5 ms with L1 ones (docs/benchmarks.md); the same bits.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* p, int64_t count) {
  constexpr int64_t kPerLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < count; i += kPerLine) __builtin_prefetch(p + i, 0, 2);
}

// Sizes of one call, in elements, and the positions per AVX-512 group: 16 where the CPU has
// AVX-512F, head_dim is a multiple of 16 and block_size of 16; 8 where block_size is a multiple
// of 8 only; 0 (plain loops) elsewhere. The positions of a group lie in one block.
struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks_per_seq;
  int group;
};

// Shape::group for a block size, where AVX-512 applies.
constexpr int positions_per_group(int64_t block_size) {
  return block_size % 16 == 0 ? 16 : block_size % 8 == 0 ? 8 : 0;
}

#if KVPILOT_X86
// 16 dot products at once with AVX-512. Reducing each position's 16-lane partial sums on its own
// (a horizontal add per position and head) costs more than its four FMAs; here the 16
// positions' partial sums are reduced together by a transpose-and-add tree (15 steps of two
// shuffles and one add for 16 results).
#define KVPILOT_AVX512 __attribute__((target("avx512f"), always_inline)) inline

KVPILOT_AVX512 __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

KVPILOT_AVX512 __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// a, b hold partial sums of positions A, B (16 lanes each) -> per 128-bit lane [A B A B].
KVPILOT_AVX512 __m512 add_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

// Two [A B A B] vectors (positions A, B and C, D) -> per 128-bit lane [A B C D].
KVPILOT_AVX512 __m512 add_quads(__m512 a, __m512 b) {
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
}

// Adds adjacent 128-bit lanes: lanes [a0+a1, a2+a3, b0+b1, b2+b3].
KVPILOT_AVX512 __m512 add_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp_nonpositive on 16 lanes: the same range reduction and polynomial, in AVX-512.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 clamped_n = _mm512_max_ps(n, _mm512_set1_ps(-126.f));
  const __m512 r = _mm512_fmadd_ps(clamped_n, _mm512_set1_ps(kLn2Low),
                                   _mm512_fnmadd_ps(clamped_n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
#pragma GCC unroll 5
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(clamped_n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  // Below -87 (-inf included): 0; NaN stays NaN (the comparison is false for it).
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ), result,
                              _mm512_setzero_ps());
}

// row[t] = exp_nonpositive(row[t] - max(row)) for t < n, n a multiple of 16: the same bits as
// the scalar loop (a NaN score is passed over by the maximum, as std::max does, and gives NaN).
__attribute__((target("avx512f"))) void exp_minus_max16(float* __restrict row, int64_t n) {
  // _mm512_max_ps returns its second operand where either is NaN: the running maximum.
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) lanes = _mm512_max_ps(_mm512_loadu_ps(row + t), lanes);
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(lanes));
  for (int64_t t = 0; t < n; t += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(row + t), max_score);
    _mm512_storeu_ps(row + t, exp_nonpositive16(x));
  }
}

// scores[i] = q . k_i for the rows k_i = k + i * row_stride, i < N (16 or 8); q: head_dim
// floats. The same rows at `next` are prefetched along the way. Each dot product is summed in
// the same order for either N: the same bits.
template <int N, typename scalar_t>
__attribute__((target("avx512f"))) void dot_positions(const float* __restrict q,
                                                      const scalar_t* __restrict k,
                                                      const scalar_t* __restrict next,
                                                      int64_t row_stride, int64_t head_dim,
                                                      float* __restrict scores) {
  static_assert(N == 16 || N == 8, "groups of 16 or 8 positions");
  __m512 acc[N];
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i * row_stride + c), _MM_HINT_T1);
      acc[i] = _mm512_fmadd_ps(qc, load16(k + i * row_stride + c), acc[i]);
    }
  }
  __m512 pairs[N / 2], quads[N / 4];
#pragma GCC unroll 8
  for (int i = 0; i < N / 2; ++i) pairs[i] = add_pairs(acc[2 * i], acc[2 * i + 1]);
#pragma GCC unroll 4
  for (int i = 0; i < N / 4; ++i) quads[i] = add_quads(pairs[2 * i], pairs[2 * i + 1]);
  // Lane j of add_lanes(add_lanes(q0, q1), add_lanes(q2, q3)) sums quads[j]: positions 4j..4j+3.
  if constexpr (N == 16) {
    _mm512_storeu_ps(scores,
                     add_lanes(add_lanes(quads[0], quads[1]), add_lanes(quads[2], quads[3])));
  } else {
    const __m512 halves = add_lanes(quads[0], quads[1]);
    _mm256_storeu_ps(scores, _mm512_castps512_ps256(add_lanes(halves, halves)));
  }
}

// acc[0..head_dim) += sum_i p[i] * v_i for the rows v_i = v + i * row_stride, i < n (kRows
// when kRows > 0), with the accumulators in registers across the rows (four independent chains
// of 16 floats); the same rows at `next` are prefetched along the way. Rows from n on are not
// read.
template <int kRows, typename scalar_t>
__attribute__((target("avx512f"))) void accumulate16(float* __restrict acc,
                                                     const float* __restrict p,
                                                     const scalar_t* __restrict v,
                                                     const scalar_t* __restrict next,
                                                     int64_t row_stride, int64_t head_dim,
                                                     int n) {
  const int rows = kRows > 0 ? kRows : n;
  int64_t c = 0;
  for (; c + 64 <= head_dim; c += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + c), a1 = _mm512_loadu_ps(acc + c + 16);
    __m512 a2 = _mm512_loadu_ps(acc + c + 32), a3 = _mm512_loadu_ps(acc + c + 48);
#pragma GCC unroll 16
    for (int i = 0; i < rows; ++i) {
      const __m512 pi = _mm512_set1_ps(p[i]);
      const scalar_t* vi = v + i * row_stride + c;
      prefetch_row(next + i * row_stride + c, 64);
      a0 = _mm512_fmadd_ps(pi, load16(vi), a0);
      a1 = _mm512_fmadd_ps(pi, load16(vi + 16), a1);
      a2 = _mm512_fmadd_ps(pi, load16(vi + 32), a2);
      a3 = _mm512_fmadd_ps(pi, load16(vi + 48), a3);
    }
    _mm512_storeu_ps(acc + c, a0);
    _mm512_storeu_ps(acc + c + 16, a1);
    _mm512_storeu_ps(acc + c + 32, a2);
    _mm512_storeu_ps(acc + c + 48, a3);
  }
  for (; c < head_dim; c += 16) {
    __m512 a = _mm512_loadu_ps(acc + c);
#pragma GCC unroll 16
    for (int i = 0; i < rows; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i * row_stride + c), _MM_HINT_T1);
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), load16(v + i * row_stride + c), a);
    }
    _mm512_storeu_ps(acc + c, a);
  }
}
#endif

// Scores are kept in rows of a multiple of 16 floats (the padding holds -inf, whose exp is 0),
// so the softmax loops run whole vectors, without a scalar remainder. The 16 scores of a
// sequence's last, partial group of positions land at a multiple of 16 when the span starts on
// one (no window, or one starting on a block); else the row holds 15 more.
inline int64_t padded_span(int64_t start, int64_t seq_len) {
  const int64_t span = seq_len - start + (start % 16 == 0 ? 0 : 15);
  return (span + 15) / 16 * 16;
}

// One sequence's KV heads kv_head..kv_head + num_kv - 1, each with its `group` query heads
// (rows = num_kv * group of them, in head order) over positions [start, seq_len).
// q: [rows, head_dim] float32, already multiplied by the scale. scores: [rows,
// padded_span(start, seq_len)] scratch.
// acc: [rows, head_dim] scratch. out: [rows, head_dim] rows of the output.
template <typename scalar_t, int64_t kHeadDim>
__attribute__((always_inline)) inline void attend_one(
    const float* __restrict q, const scalar_t* __restrict k_cache,
    const scalar_t* __restrict v_cache, const int32_t* __restrict block_table, int64_t start,
    int64_t seq_len, int64_t kv_head, int64_t num_kv, int64_t group, const Shape& s,
    float* __restrict scores, float* __restrict acc, scalar_t* __restrict out) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : s.head_dim, block_size = s.block_size;
  const int64_t row_stride = s.num_kv_heads * head_dim;  // between positions of one block
  const int64_t span = seq_len - start, stride = padded_span(start, seq_len);
  const int64_t rows = num_kv * group;  // query heads
  const int64_t first_block = start / block_size, last_block = (seq_len - 1) / block_size;

  // The blocks are scattered, so the hardware prefetcher cannot guess the next one: while a
  // block is read, the same row of the block kAhead blocks later is requested (in pass 1 past the
  // last K block, the first V blocks).
  constexpr int64_t kAhead = 2;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t block = block_table[b];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_attention: block id ", block,
                " out of range [0, ", s.num_blocks, ")");
  }
  const int64_t head_offset = kv_head * head_dim;
  auto block_rows = [&](const scalar_t* cache, int64_t b) {
    return cache + static_cast<int64_t>(block_table[b]) * block_size * row_stride + head_offset;
  };

  // Calls group_of(rows, next_rows, i, n) for each s.group positions of a block read from its
  // start when the AVX-512 dot products apply (n < s.group of them in the sequence at its end:
  // the block's rows past them exist, and their scores land in the padding that is reset to
  // -inf), else one(row, i) for each position after prefetching its row in the block
  // next_block(b); i is the position's index in the scores, rows point into `cache`.
  auto walk = [&](const scalar_t* cache, auto next_block, auto group_of, auto one)
                  __attribute__((always_inline)) {
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t t0 = std::max(b * block_size, start);
      const int64_t t1 = std::min((b + 1) * block_size, seq_len);
      const scalar_t* rows = block_rows(cache, b);
      const scalar_t* next = next_block(b);
      const bool aligned = s.group > 0 && t0 == b * block_size;
      for (int64_t t = t0; t < t1; t += aligned ? s.group : 1) {
        const int64_t row = (t - b * block_size) * row_stride;
        if (aligned) {
          const int n = static_cast<int>(std::min<int64_t>(s.group, t1 - t));
          group_of(rows + row, next + row, t - start, n);
        } else {
          prefetch_row(next + row, num_kv * head_dim);
          one(rows + row, t - start);
        }
      }
    }
  };

  // Pass 1: scores of every position, block by block.
#if KVPILOT_X86
  const auto dot = s.group == 16 ? &dot_positions<16, scalar_t> : &dot_positions<8, scalar_t>;
#endif
  walk(
      k_cache,
      [&](int64_t b) __attribute__((always_inline)) {
        const int64_t ahead = b + kAhead;
        return ahead <= last_block
                   ? block_rows(k_cache, ahead)
                   : block_rows(v_cache,
                                std::min(first_block + ahead - last_block - 1, last_block));
      },
      [&](const scalar_t* k, const scalar_t* next, int64_t i, int) __attribute__((always_inline)) {
#if KVPILOT_X86
        for (int64_t g = 0; g < rows; ++g) {
          const int64_t h = g / group * head_dim;  // its KV head's offset in a position's row
          dot(q + g * head_dim, k + h, next + h, row_stride, head_dim, scores + g * stride + i);
        }
#endif
      },
      [&](const scalar_t* k, int64_t i) __attribute__((always_inline)) {
        for (int64_t g = 0; g < rows; ++g) {
          const float* qg = q + g * head_dim;
          const scalar_t* kg = k + g / group * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(kg[d]);
          scores[g * stride + i] = dot;
        }
      });

  // Numerically stable softmax numerators; the normalisation waits for the output.
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * stride;
    std::fill(sg + span, sg + stride, -std::numeric_limits<float>::infinity());
#if KVPILOT_X86
    if (s.group > 0) {
      exp_minus_max16(sg, stride);
      continue;
    }
#endif
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < stride; ++t) max_score = std::max(max_score, sg[t]);
    for (int64_t t = 0; t < stride; ++t) sg[t] = exp_nonpositive(sg[t] - max_score);
  }
  // Each row's sum in position order, the rows side by side (independent chains).
  std::vector<float> inv_sum(rows, 0.f);
  for (int64_t t = 0; t < span; ++t)
    for (int64_t g = 0; g < rows; ++g) inv_sum[g] += scores[g * stride + t];
  for (int64_t g = 0; g < rows; ++g) inv_sum[g] = 1.f / inv_sum[g];

  // Pass 2: weighted sum of the values.
  std::fill(acc, acc + rows * head_dim, 0.f);
  walk(
      v_cache,
      [&](int64_t b) __attribute__((always_inline)) {
        return block_rows(v_cache, std::min(b + kAhead, last_block));
      },
      [&](const scalar_t* v, const scalar_t* next, int64_t i, int n)
          __attribute__((always_inline)) {
#if KVPILOT_X86
        for (int64_t g = 0; g < rows; ++g) {
          float* ag = acc + g * head_dim;
          const float* pg = scores + g * stride + i;
          const int64_t h = g / group * head_dim;
          if (n == 16) {
            accumulate16<16>(ag, pg, v + h, next + h, row_stride, head_dim, n);
          } else if (n == 8) {
            accumulate16<8>(ag, pg, v + h, next + h, row_stride, head_dim, n);
          } else {
            accumulate16<0>(ag, pg, v + h, next + h, row_stride, head_dim, n);
          }
        }
#endif
      },
      [&](const scalar_t* v, int64_t i) __attribute__((always_inline)) {
        for (int64_t g = 0; g < rows; ++g) {
          const float p = scores[g * stride + i];
          const scalar_t* vg = v + g / group * head_dim;
          float* ag = acc + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(vg[d]);
        }
      });
  for (int64_t g = 0; g < rows; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      from_float(acc[g * head_dim + d] * inv_sum[g], out + g * s.head_dim + d);
}

// The entry points compiled once per instruction set (GCC clones no templates), for the common
// head sizes as constants (loops the compiler unrolls) and for any other head size.
#define KVPILOT_ATTEND_ONE(name, scalar_t, head_dim)                                           \
  KVPILOT_TARGET_CLONES void name(const float* q, const scalar_t* k_cache,                   \
                                  const scalar_t* v_cache, const int32_t* block_table,         \
                                  int64_t start, int64_t seq_len, int64_t kv_head,             \
                                  int64_t num_kv, int64_t group, const Shape& s, float* scores, \
                                  float* acc, scalar_t* out) {                                 \
    attend_one<scalar_t, head_dim>(q, k_cache, v_cache, block_table, start, seq_len, kv_head,  \
                                   num_kv, group, s, scores, acc, out);                        \
  }
KVPILOT_ATTEND_ONE(attend_one_float_64, float, 64)
KVPILOT_ATTEND_ONE(attend_one_float_128, float, 128)
KVPILOT_ATTEND_ONE(attend_one_float_any, float, 0)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_64, c10::BFloat16, 64)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_128, c10::BFloat16, 128)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_any, c10::BFloat16, 0)

template <typename scalar_t>
using AttendOne = void (*)(const float*, const scalar_t*, const scalar_t*, const int32_t*, int64_t,
                           int64_t, int64_t, int64_t, int64_t, const Shape&, float*, float*,
                           scalar_t*);

inline AttendOne<float> pick_attend_one(const Shape& s, float*) {
  return s.head_dim == 64    ? attend_one_float_64
         : s.head_dim == 128 ? attend_one_float_128
                             : attend_one_float_any;
}

inline AttendOne<c10::BFloat16> pick_attend_one(const Shape& s, c10::BFloat16*) {
  return s.head_dim == 64    ? attend_one_bfloat16_64
         : s.head_dim == 128 ? attend_one_bfloat16_128
                             : attend_one_bfloat16_any;
}

constexpr int kTileRows = 16;  // (token, head) rows of a prompt tile (below)

#if KVPILOT_X86
// Prompt tiles (float32, AVX-512, head_dim a multiple of 16, block_size a multiple of 8). A
// tile is 16 consecutive (query token, query head) rows of one sequence and KV head: row f of
// the sequence's q_len x group rows is token f / group, head kv_head * group + f % group, at
// position seq_len - q_len + f / group. The 16 rows are the 16 lanes of a vector, so every K
// and V element is loaded once per tile and broadcast against all of them (16 rows per
// multiply-add, no horizontal sums), and the causal mask and the softmax run across the rows at
// once. Scores are stored position-major, [positions][16].

constexpr int kTilePositions = 8;  // positions scored at once: 8 accumulators, 8 chains

// st[i][0..16) = sum_d k_i[d] * qt[d][0..16) for the N positions k_i = k + i * row_stride.
template <int N>
__attribute__((target("avx512f"))) void score_positions(const float* __restrict qt,
                                                        const float* __restrict k,
                                                        int64_t row_stride, int64_t head_dim,
                                                        float* __restrict st) {
  __m512 acc[N];
#pragma GCC unroll 12
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 qd = _mm512_loadu_ps(qt + d * kTileRows);
#pragma GCC unroll 12
    for (int i = 0; i < N; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(k[i * row_stride + d]), qd, acc[i]);
  }
#pragma GCC unroll 12
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(st + i * kTileRows, acc[i]);
}

using ScorePositions = void (*)(const float*, const float*, int64_t, int64_t, float*);

template <int... N>
constexpr std::array<ScorePositions, sizeof...(N)> score_table(std::integer_sequence<int, N...>) {
  return {&score_positions<N + 1>...};
}

constexpr auto kScorePositions = score_table(std::make_integer_sequence<int, kTilePositions>{});

// ot[d][0..16) = sum_t p[t - lo][0..16) * v_t[d] for d < 16 and the positions t in [lo, hi),
// in position order, v_t = v + (the row of position t, block by block through block_table): 16
// accumulators of 16 rows each, in registers across the blocks.
__attribute__((target("avx512f"))) void accumulate_positions(
    const float* __restrict p, const float* __restrict v, const int32_t* __restrict block_table,
    int64_t block_size, int64_t row_stride, int64_t lo, int64_t hi, float* __restrict ot) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int d = 0; d < 16; ++d) acc[d] = _mm512_setzero_ps();
  for (int64_t t = lo; t < hi;) {
    const int64_t n = std::min(hi - t, block_size - t % block_size);
    const float* rows = v + (static_cast<int64_t>(block_table[t / block_size]) * block_size +
                             t % block_size) * row_stride;
    const float* pt = p + (t - lo) * kTileRows;
    for (int64_t i = 0; i < n; ++i) {
      const __m512 pi = _mm512_loadu_ps(pt + i * kTileRows);
      const float* vi = rows + i * row_stride;
#pragma GCC unroll 16
      for (int d = 0; d < 16; ++d) acc[d] = _mm512_fmadd_ps(_mm512_set1_ps(vi[d]), pi, acc[d]);
    }
    t += n;
  }
#pragma GCC unroll 16
  for (int d = 0; d < 16; ++d) _mm512_storeu_ps(ot + d * kTileRows, acc[d]);
}

// One tile: rows f0..f0 + rows - 1 (rows <= 16) of sequence `seq`, KV head `kv_head`.
// qt: [head_dim][16] scratch, st: [positions][16] scratch, ot: [head_dim][16] scratch.
__attribute__((target("avx512f"))) void attend_tile(
    const float* __restrict q_ptr, int64_t q_stride, const float* __restrict k_cache,
    const float* __restrict v_cache, const int32_t* __restrict block_table, int64_t first_token,
    int64_t q_len, int64_t seq_len, int64_t kv_head, int64_t group, int64_t f0, int rows,
    float scale, int64_t sliding_window, const Shape& s, std::vector<float>& qt,
    std::vector<float>& st, std::vector<float>& ot, float* __restrict out_ptr,
    int64_t out_stride) {
  const int64_t head_dim = s.head_dim, block_size = s.block_size;
  const int64_t row_stride = s.num_kv_heads * head_dim;
  alignas(64) float position[kTileRows];
  int64_t token[kTileRows], head[kTileRows];
  for (int l = 0; l < kTileRows; ++l) {
    const int64_t f = f0 + std::min(l, rows - 1);  // spare lanes repeat the last row
    token[l] = first_token + f / group;
    head[l] = kv_head * group + f % group;
    position[l] = static_cast<float>(seq_len - q_len + f / group);
  }
  const int64_t first_pos = seq_len - q_len + f0 / group;
  const int64_t last_pos = seq_len - q_len + (f0 + rows - 1) / group;
  const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) : 0;
  const int64_t hi = last_pos + 1, span = hi - lo;
  for (int64_t b = lo / block_size; b <= (hi - 1) / block_size; ++b) {
    const int64_t block = block_table[b];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_attention: block id ", block,
                " out of range [0, ", s.num_blocks, ")");
  }
  qt.resize(head_dim * kTileRows);
  for (int l = 0; l < kTileRows; ++l) {
    const float* qr = q_ptr + token[l] * q_stride + head[l] * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) qt[d * kTileRows + l] = qr[d] * scale;
  }
  st.resize(span * kTileRows);
  auto rows_at = [&](const float* cache, int64_t t) {
    return cache + static_cast<int64_t>(block_table[t / block_size]) * block_size * row_stride +
           (t % block_size) * row_stride + kv_head * head_dim;
  };
  // Pass 1: scores, up to 12 positions of one block at a time.
  for (int64_t t = lo; t < hi;) {
    const int64_t n = std::min({static_cast<int64_t>(kTilePositions), hi - t,
                                block_size - t % block_size});
    kScorePositions[n - 1](qt.data(), rows_at(k_cache, t), row_stride, head_dim,
                           st.data() + (t - lo) * kTileRows);
    t += n;
  }
  // Causal and window masks, then the numerically stable softmax numerators, per lane.
  const __m512 pos = _mm512_load_ps(position), neg_inf = _mm512_set1_ps(-INFINITY);
  const float window = sliding_window > 0 ? static_cast<float>(sliding_window) : INFINITY;
  __m512 max_score = neg_inf;
  for (int64_t t = lo; t < hi; ++t) {
    float* row = st.data() + (t - lo) * kTileRows;
    const __m512 tv = _mm512_set1_ps(static_cast<float>(t));
    const __mmask16 keep = _mm512_cmp_ps_mask(tv, pos, _CMP_LE_OQ) &
                           _mm512_cmp_ps_mask(tv, _mm512_sub_ps(pos, _mm512_set1_ps(window)),
                                              _CMP_GT_OQ);
    const __m512 v = _mm512_mask_blend_ps(keep, neg_inf, _mm512_loadu_ps(row));
    _mm512_storeu_ps(row, v);
    max_score = _mm512_max_ps(max_score, v);
  }
  __m512 sum_vec = _mm512_setzero_ps();
  for (int64_t t = 0; t < span; ++t) {
    float* row = st.data() + t * kTileRows;
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row), max_score));
    _mm512_storeu_ps(row, e);
    sum_vec = _mm512_add_ps(sum_vec, e);
  }
  alignas(64) float sum[kTileRows];
  _mm512_store_ps(sum, sum_vec);
  // Pass 2: the weighted values, 16 features at a time.
  ot.resize(head_dim * kTileRows);
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
    accumulate_positions(st.data(), v_cache + kv_head * head_dim + d0, block_table, block_size,
                         row_stride, lo, hi, ot.data() + d0 * kTileRows);
  }
  for (int l = 0; l < rows; ++l) {
    float* o = out_ptr + token[l] * out_stride + head[l] * head_dim;
    const float inv = 1.f / sum[l];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = ot[d * kTileRows + l] * inv;
  }
}
#endif  // KVPILOT_X86

// A unit of work: a tile of a prompt's rows (f0 >= 0, KV head kv_head) or one query token's
// heads of KV heads kv_head..kv_head + num_kv - 1 (f0 < 0: the token is `token` of the
// sequence). A token is one item for all its KV heads when the step has at least
// kTokensPerThreadForWholeItems such tokens a thread: each item then reads whole blocks, every
// KV head's rows of a position in a row, where an item per KV head reads a third of each
// position's row and two threads' items share the blocks' cache lines (2 threads: 10.7 -> 6.4-7.4
// ms for 32 decodes of 144 positions x 30 layers from memory; 1 thread: the same). Fewer
// tokens keep an item per KV head, so that a few long sequences still spread over the threads.
// The arithmetic of each row is the same either way: the same bits.
struct Item {
  int64_t seq, kv_head, f0, token, num_kv;
};
constexpr int64_t kTokensPerThreadForWholeItems = 4;

// The items' indices shared out over `workers` threads by their cost (positions read x query
// rows): the costliest first, each to the thread with the least so far (LPT, Graham 1969), then
// each thread's in their order. The threads then finish together whatever the mix of short and
// long contexts (dealt round-robin, one thread could get a tenth more of a decode step's reads:
// 32 decodes of 16-256 positions x 30 layers on 2 threads, 0.91-0.99x the time). Each item's
// arithmetic is its own: the split changes no bit.
template <typename Cost>
std::vector<std::vector<int64_t>> share_out(const std::vector<Item>& items, int64_t workers,
                                            Cost cost) {
  std::vector<std::vector<int64_t>> shares(workers);
  if (workers == 1) {  // what the rule gives one thread, without sorting for it
    shares[0].resize(items.size());
    std::iota(shares[0].begin(), shares[0].end(), int64_t{0});
    return shares;
  }
  std::vector<std::pair<int64_t, int64_t>> order;  // (cost, index)
  order.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) order.emplace_back(cost(items[i]), i);
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int64_t> load(workers, 0);
  for (const auto& [c, i] : order) {
    const auto w = std::min_element(load.begin(), load.end()) - load.begin();
    shares[w].push_back(i);
    load[w] += c;
  }
  // Each thread in the items' own order: a prompt's tiles of one KV head, one after the other,
  // read the same blocks while they are still in the cache.
  for (auto& share : shares) std::sort(share.begin(), share.end());
  return shares;
}

template <typename scalar_t>
void run(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, const bool* prompt,
         double scale, int64_t sliding_window, const Shape& s) {
  const int64_t num_seqs = seq_lens.size(0), head_dim = s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t q_stride = query.stride(0), out_stride = out.stride(0);
  const bool tiles = std::is_same_v<scalar_t, float> && s.group > 0;

  // A prompt's (prompt chunk's) tokens in tiles, a one-token chunk too when `prompt` says it is
  // one, so that a prompt row's bits never depend on how its prompt was cut into chunks.
  auto in_tiles = [&](int64_t seq, int64_t q_len) {
    const bool prompt_token = q_len == 1 && prompt != nullptr && prompt[seq] && lens[seq] > 0;
    return tiles && (q_len > 1 || prompt_token);
  };
  // A token's KV heads in one item when there are enough tokens to share out (see Item).
  int64_t single_tokens = 0;  // query tokens that are items of their own (not in tiles)
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq];
    TORCH_CHECK(q_len >= 0 && starts[seq] >= 0 && starts[seq + 1] <= query.size(0),
                "paged_attention: query_start_loc must rise within the query's rows");
    TORCH_CHECK(lens[seq] <= s.max_blocks_per_seq * s.block_size, "paged_attention: seq_lens[",
                seq, "] = ", lens[seq], " exceeds its block table");
    TORCH_CHECK((q_len <= 1 && lens[seq] <= 0) || lens[seq] >= q_len,
                "paged_attention: seq_lens[", seq, "] = ", lens[seq], " is shorter than its ",
                q_len, " query tokens");
    if (!in_tiles(seq, q_len)) single_tokens += q_len;
  }
  const int64_t num_kv =
      single_tokens >= kTokensPerThreadForWholeItems * at::get_num_threads() ? s.num_kv_heads : 1;
  std::vector<Item> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq];
    if (in_tiles(seq, q_len)) {
      for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head)
        for (int64_t f0 = 0; f0 < q_len * group; f0 += kTileRows)
          items.push_back({seq, kv_head, f0, 0, 1});
      continue;
    }
    for (int64_t kv_head = 0; kv_head < s.num_kv_heads; kv_head += num_kv)
      for (int64_t j = 0; j < q_len; ++j) items.push_back({seq, kv_head, -1, j, num_kv});
  }

  const AttendOne<scalar_t> attend = pick_attend_one(s, out_ptr);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const std::vector<std::vector<int64_t>> shares =
      share_out(items, workers, [&](const Item& item) {
        const int64_t q_len = starts[item.seq + 1] - starts[item.seq];
        const int64_t last = item.f0 >= 0
                                 ? std::min(q_len, (item.f0 + kTileRows + group - 1) / group) - 1
                                 : item.token;
        const int64_t len = lens[item.seq] - q_len + last + 1;
        const int64_t span = sliding_window > 0 ? std::min(len, sliding_window) : len;
        return std::max<int64_t>(span, 1) * (item.f0 >= 0 ? kTileRows : item.num_kv * group);
      });
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    std::vector<float> q(s.num_heads * head_dim), acc(s.num_heads * head_dim), scores, qt, st,
        ot;
    for (int64_t worker = first_worker; worker < last_worker; ++worker) {
      for (const int64_t i : shares[worker]) {
        const Item& item = items[i];
        const int64_t q_len = starts[item.seq + 1] - starts[item.seq];
        const int32_t* table = tables + item.seq * s.max_blocks_per_seq;
#if KVPILOT_X86
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (item.f0 >= 0) {
            const int rows =
                static_cast<int>(std::min<int64_t>(kTileRows, q_len * group - item.f0));
            attend_tile(q_ptr, q_stride, k_ptr, v_ptr, table, starts[item.seq], q_len,
                        lens[item.seq], item.kv_head, group, item.f0, rows,
                        static_cast<float>(scale), sliding_window, s, qt, st, ot, out_ptr,
                        out_stride);
            continue;
          }
        }
#endif
        const int64_t row = starts[item.seq] + item.token;
        const int64_t seq_len = lens[item.seq] - q_len + item.token + 1;
        scalar_t* o = out_ptr + row * out_stride + item.kv_head * group * head_dim;
        const int64_t width = item.num_kv * group * head_dim;  // this item's query heads
        if (seq_len <= 0) {
          for (int64_t d = 0; d < width; ++d) from_float(0.f, o + d);
          continue;
        }
        const int64_t start =
            sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
        const scalar_t* qs = q_ptr + row * q_stride + item.kv_head * group * head_dim;
        for (int64_t d = 0; d < width; ++d) q[d] = to_float(qs[d]) * static_cast<float>(scale);
        scores.resize(item.num_kv * group * padded_span(start, seq_len));
        attend(q.data(), k_ptr, v_ptr, table, start, seq_len, item.kv_head, item.num_kv, group,
               s, scores.data(), acc.data(), o);
      }
    }
  });
}

}  // namespace

// See kernels/cpu/paged_attention.py (paged_attention) for the contract.
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                     torch::Tensor query_start_loc, torch::Tensor prompt_seqs, double scale,
                     int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_attention: query and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_attention: caches must be [num_blocks, block_size, num_kv_heads, "
              "head_dim], both the same");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "paged_attention: query and out rows must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_attention: query, out and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "paged_attention: block_tables must be contiguous int32 [num_seqs, n]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "paged_attention: seq_lens must be contiguous int32 [num_seqs]");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt32 && query_start_loc.dim() == 1 &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == num_seqs + 1,
              "paged_attention: query_start_loc must be contiguous int32 [num_seqs + 1]");
  TORCH_CHECK(block_tables.size(0) == num_seqs,
              "paged_attention: one block table row and one length per sequence");
  TORCH_CHECK(prompt_seqs.numel() == 0 ||
                  (prompt_seqs.scalar_type() == torch::kBool && prompt_seqs.dim() == 1 &&
                   prompt_seqs.is_contiguous() && prompt_seqs.size(0) == num_seqs),
              "paged_attention: prompt_seqs must be empty or contiguous bool [num_seqs]");
  const bool* prompt = prompt_seqs.numel() == 0 ? nullptr : prompt_seqs.data_ptr<bool>();
  TORCH_CHECK(k_cache.size(3) == query.size(2), "paged_attention: head_dim mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0,
              "paged_attention: num_heads must be a multiple of num_kv_heads");
#if KVPILOT_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f");
#else
  constexpr bool has_avx512 = false;
#endif
  const Shape s{query.size(1),   k_cache.size(2),      query.size(2), k_cache.size(1),
                k_cache.size(0), block_tables.size(1),
                has_avx512 && query.size(2) % 16 == 0 ? positions_per_group(k_cache.size(1)) : 0};
  if (query.scalar_type() == torch::kFloat32) {
    run<float>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, prompt,
               scale, sliding_window, s);
  } else if (query.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                       prompt, scale, sliding_window, s);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only, got ", query.scalar_type());
  }
}

// See kernels/cpu/paged_attention.py (reshape_and_cache) for the contract: each new token's K
// and V rows copied into its slot of the paged caches (vLLM's reshape_and_cache), both caches in
// one call.
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && key.device().is_cpu() &&
                  value.device().is_cpu() && slot_mapping.device().is_cpu(),
              "reshape_and_cache: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "reshape_and_cache: caches must be contiguous [num_blocks, block_size, "
              "num_kv_heads, head_dim], one shape");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t row = k_cache.size(2) * k_cache.size(3);
  for (const auto& t : {key, value}) {
    TORCH_CHECK(t.dim() == 3 && t.size(0) == num_tokens && t.size(1) == k_cache.size(2) &&
                    t.size(2) == k_cache.size(3) && t.stride(2) == 1 &&
                    (t.size(1) == 1 || t.stride(1) == t.size(2)),
                "reshape_and_cache: key and value must be [num_tokens, num_kv_heads, head_dim] "
                "with each token's row contiguous, got ",
                t.sizes());
    TORCH_CHECK(t.scalar_type() == k_cache.scalar_type() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "reshape_and_cache: key, value and caches must share one dtype");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous(),
              "reshape_and_cache: slot_mapping must be contiguous int64 [num_tokens]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = row * k_cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "reshape_and_cache: slot ", slots[t], " out of range [0, ",
                num_slots, ")");
  }
  const auto* k_src = static_cast<const char*>(key.data_ptr());
  const auto* v_src = static_cast<const char*>(value.data_ptr());
  auto* k_dst = static_cast<char*>(k_cache.data_ptr());
  auto* v_dst = static_cast<char*>(v_cache.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;  // -1: no write (padding)
    std::memcpy(k_dst + slots[t] * bytes, k_src + t * k_stride, bytes);
    std::memcpy(v_dst + slots[t] * bytes, v_src + t * v_stride, bytes);
  }
}

bool tiles_supported() {
#if KVPILOT_X86
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiles_supported", &tiles_supported,
        "Whether this CPU runs the prompt tiles (AVX-512F).");
  m.def("reshape_and_cache", &reshape_and_cache,
        "Each new token's K and V rows into its slot of the paged caches (CPU).");
  m.def("paged_attention", &paged_attention,
        "Paged attention of decode and prompt tokens over a block-table KV cache, in place "
        "(CPU).");
}
