// Paged attention on the CPU: PagedAttention (Kwon et al. 2023), reading K/V in place.
//
// Every query token attends to its whole context (or the last `sliding_window` positions of
// it): a decode sequence's one new token, or a prompt's token at position p, whose context is
// positions 0..p of its sequence (`table_rows` names each query's block table row). Keys and
// values stay where they are in the paged cache, reached through the block table; nothing is
// gathered or padded, and no slot past a sequence's end reaches an output. The work is split
// over (query, KV head) pairs, dealt round-robin to the threads of at::parallel_for (ATen's
// OpenMP pool, so torch.set_num_threads applies; a prompt's later tokens have more context, so
// contiguous shares would be uneven); each pair handles the num_heads / num_kv_heads query heads
// that share its KV head (GQA), in a pass over its K blocks and one over its V blocks:
//
//   scores[g, t] = scale * q[g] . k[t]            (float32 accumulation)
//   p[g, t]      = exp(scores[g, t] - max_t scores[g, t]) / sum_t exp(...)
//   out[g]       = sum_t p[g, t] * v[t]           (float32 accumulation, one division at the end)
//
// A token's result depends on its context alone, not on whether it is prefilled in one step, in
// chunks or decoded, nor on the batch. Decode attention reads each K/V row once for little
// arithmetic, so it is bound by memory: the rows of the block two ahead are prefetched while a
// block is read (the blocks are scattered, the hardware prefetcher cannot follow). Groups of 16
// positions from a block's start go through AVX-512 intrinsics where the CPU has them (16 dot
// products reduced together; the V sums in registers); positions after an unaligned window
// start and other CPUs take plain loops compiled for AVX-512, AVX2 and baseline x86-64 (GCC
// target_clones, picked at load time), so the built library may move between x86 machines.
// The Python wrapper is kernels/cpu/paged_attention.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
// float in [-87, 0] (checked exhaustively), written as plain arithmetic so the softmax loop
// vectorizes (std::exp does not without -ffast-math). Below -87 (exp < 2^-125: nothing next to
// the maximum's 1) it returns 0; NaN stays NaN.
inline float exp_nonpositive(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float clamped_n = std::max(n, -126.f);
  const float r = x - clamped_n * 0.693359375f + clamped_n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(clamped_n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.f ? 0.f : p * two_n;
}

// Asks for the cache lines of `count` elements at `p` (a K or V row needed soon).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* p, int64_t count) {
  constexpr int64_t kPerLine = 64 / sizeof(scalar_t);
  for (int64_t i = 0; i < count; i += kPerLine) __builtin_prefetch(p + i, 0, 3);
}

// Sizes of one call, in elements, and whether the AVX-512 dot products apply (the CPU has
// AVX-512F, head_dim and block_size are multiples of 16).
struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks, num_tables,
      max_blocks_per_seq;
  bool dot16;
};

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

// scores[i] = q . k_i for the rows k_i = k + i * row_stride, i < 16; q: head_dim floats. The
// same rows at `next` are prefetched along the way.
template <typename scalar_t>
__attribute__((target("avx512f"))) void dot16(const float* __restrict q,
                                              const scalar_t* __restrict k,
                                              const scalar_t* __restrict next, int64_t row_stride,
                                              int64_t head_dim, float* __restrict scores) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i * row_stride + c), _MM_HINT_T0);
      acc[i] = _mm512_fmadd_ps(qc, load16(k + i * row_stride + c), acc[i]);
    }
  }
  __m512 pairs[8], quads[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) pairs[i] = add_pairs(acc[2 * i], acc[2 * i + 1]);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) quads[i] = add_quads(pairs[2 * i], pairs[2 * i + 1]);
  // Lane j of add_lanes(add_lanes(q0, q1), add_lanes(q2, q3)) sums quads[j]: positions 4j..4j+3.
  _mm512_storeu_ps(scores, add_lanes(add_lanes(quads[0], quads[1]), add_lanes(quads[2], quads[3])));
}

// acc[0..head_dim) += sum_i p[i] * v_i for the rows v_i = v + i * row_stride, i < n (16 when
// kWhole), with the accumulators in registers across the rows (four independent chains of 16
// floats); the same rows at `next` are prefetched along the way. Rows from n on are not read.
template <bool kWhole, typename scalar_t>
__attribute__((target("avx512f"))) void accumulate16(float* __restrict acc,
                                                     const float* __restrict p,
                                                     const scalar_t* __restrict v,
                                                     const scalar_t* __restrict next,
                                                     int64_t row_stride, int64_t head_dim,
                                                     int n) {
  const int rows = kWhole ? 16 : n;
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
      _mm_prefetch(reinterpret_cast<const char*>(next + i * row_stride + c), _MM_HINT_T0);
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), load16(v + i * row_stride + c), a);
    }
    _mm512_storeu_ps(acc + c, a);
  }
}
#endif

// Scores are kept in rows of a multiple of 16 floats (the padding holds -inf, whose exp is 0),
// so the softmax loops run whole vectors, without a scalar remainder; with 15 more, the 16
// scores of a sequence's last, partial group of positions fit wherever the group starts.
inline int64_t padded_span(int64_t span) { return (span + 15 + 15) / 16 * 16; }

// One (sequence, KV head) pair: `group` query heads over positions [start, seq_len).
// q: [group, head_dim] float32, already multiplied by the scale. scores: [group,
// padded_span(seq_len - start)] scratch.
// acc: [group, head_dim] scratch. out: [group, head_dim] rows of the output.
template <typename scalar_t, int64_t kHeadDim>
__attribute__((always_inline)) inline void attend_one(
    const float* __restrict q, const scalar_t* __restrict k_cache,
    const scalar_t* __restrict v_cache, const int32_t* __restrict block_table, int64_t start,
    int64_t seq_len, int64_t kv_head, int64_t group, const Shape& s, float* __restrict scores,
    float* __restrict acc, scalar_t* __restrict out) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : s.head_dim, block_size = s.block_size;
  const int64_t row_stride = s.num_kv_heads * head_dim;  // between positions of one block
  const int64_t span = seq_len - start, stride = padded_span(span);
  const int64_t first_block = start / block_size, last_block = (seq_len - 1) / block_size;

  // The blocks are scattered, so the hardware prefetcher cannot guess the next one: while a
  // block is read, the same row of the block kAhead blocks later is requested (in pass 1 past the
  // last K block, the first V blocks).
  constexpr int64_t kAhead = 2;
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t block = block_table[b];
    TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_decode_attention: block id ", block,
                " out of range [0, ", s.num_blocks, ")");
  }
  const int64_t head_offset = kv_head * head_dim;
  auto block_rows = [&](const scalar_t* cache, int64_t b) {
    return cache + static_cast<int64_t>(block_table[b]) * block_size * row_stride + head_offset;
  };

  // Calls sixteen(rows, next_rows, i, n) for each 16 positions of a block read from its start
  // when the AVX-512 dot products apply (n < 16 of them in the sequence at its end: the block's
  // rows past them exist, and their scores land in the padding that is reset to -inf), else
  // one(row, i) for each position after prefetching its row in the block next_block(b); i is
  // the position's index in the scores, rows point into `cache`.
  auto walk = [&](const scalar_t* cache, auto next_block, auto sixteen, auto one)
                  __attribute__((always_inline)) {
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t t0 = std::max(b * block_size, start);
      const int64_t t1 = std::min((b + 1) * block_size, seq_len);
      const scalar_t* rows = block_rows(cache, b);
      const scalar_t* next = next_block(b);
      const bool aligned = s.dot16 && t0 == b * block_size;
      for (int64_t t = t0; t < t1; t += aligned ? 16 : 1) {
        const int64_t row = (t - b * block_size) * row_stride;
        if (aligned) {
          sixteen(rows + row, next + row, t - start, static_cast<int>(std::min<int64_t>(16, t1 - t)));
        } else {
          prefetch_row(next + row, head_dim);
          one(rows + row, t - start);
        }
      }
    }
  };

  // Pass 1: scores of every position, block by block.
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
        for (int64_t g = 0; g < group; ++g)
          dot16(q + g * head_dim, k, next, row_stride, head_dim, scores + g * stride + i);
#endif
      },
      [&](const scalar_t* k, int64_t i) __attribute__((always_inline)) {
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(k[d]);
          scores[g * stride + i] = dot;
        }
      });

  // Numerically stable softmax numerators; the normalisation waits for the output.
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * stride;
    std::fill(sg + span, sg + stride, -std::numeric_limits<float>::infinity());
    float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
    for (int64_t t = 0; t < stride; ++t) max_score = std::max(max_score, sg[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < stride; ++t) {
      sg[t] = exp_nonpositive(sg[t] - max_score);
      sum += sg[t];
    }
    inv_sum[g] = 1.f / sum;
  }

  // Pass 2: weighted sum of the values.
  std::fill(acc, acc + group * head_dim, 0.f);
  walk(
      v_cache,
      [&](int64_t b) __attribute__((always_inline)) {
        return block_rows(v_cache, std::min(b + kAhead, last_block));
      },
      [&](const scalar_t* v, const scalar_t* next, int64_t i, int n)
          __attribute__((always_inline)) {
#if KVPILOT_X86
        for (int64_t g = 0; g < group; ++g) {
          float* ag = acc + g * head_dim;
          const float* pg = scores + g * stride + i;
          if (n == 16) {
            accumulate16<true>(ag, pg, v, next, row_stride, head_dim, n);
          } else {
            accumulate16<false>(ag, pg, v, next, row_stride, head_dim, n);
          }
        }
#endif
      },
      [&](const scalar_t* v, int64_t i) __attribute__((always_inline)) {
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * stride + i];
          float* ag = acc + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(v[d]);
        }
      });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      from_float(acc[g * head_dim + d] * inv_sum[g], out + g * s.head_dim + d);
}

// The entry points compiled once per instruction set (GCC clones no templates), for the common
// head sizes as constants (loops the compiler unrolls) and for any other head size.
#define KVPILOT_ATTEND_ONE(name, scalar_t, head_dim)                                           \
  KVPILOT_TARGET_CLONES void name(const float* q, const scalar_t* k_cache,                   \
                                  const scalar_t* v_cache, const int32_t* block_table,         \
                                  int64_t start, int64_t seq_len, int64_t kv_head,             \
                                  int64_t group, const Shape& s, float* scores, float* acc,    \
                                  scalar_t* out) {                                             \
    attend_one<scalar_t, head_dim>(q, k_cache, v_cache, block_table, start, seq_len, kv_head,  \
                                   group, s, scores, acc, out);                                \
  }
KVPILOT_ATTEND_ONE(attend_one_float_64, float, 64)
KVPILOT_ATTEND_ONE(attend_one_float_128, float, 128)
KVPILOT_ATTEND_ONE(attend_one_float_any, float, 0)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_64, c10::BFloat16, 64)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_128, c10::BFloat16, 128)
KVPILOT_ATTEND_ONE(attend_one_bfloat16_any, c10::BFloat16, 0)

template <typename scalar_t>
using AttendOne = void (*)(const float*, const scalar_t*, const scalar_t*, const int32_t*, int64_t,
                           int64_t, int64_t, int64_t, const Shape&, float*, float*, scalar_t*);

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

template <typename scalar_t>
void run(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_lens, const torch::Tensor& table_rows, double scale,
         int64_t sliding_window, const Shape& s) {
  const int64_t num_seqs = query.size(0), head_dim = s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* rows_of = table_rows.numel() > 0 ? table_rows.data_ptr<int32_t>() : nullptr;
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t q_stride = query.stride(0), out_stride = out.stride(0);

  const AttendOne<scalar_t> attend = pick_attend_one(s, out_ptr);
  // The (query, KV head) items are dealt round-robin to the threads: the queries of one prompt
  // attend to 1, 2, 3, ... positions, so contiguous shares would leave the last thread most of
  // the work.
  const int64_t num_items = num_seqs * s.num_kv_heads;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t worker = first_worker; worker < last_worker; ++worker)
    for (int64_t item = worker; item < num_items; item += workers) {
      const int64_t seq = item / s.num_kv_heads, kv_head = item % s.num_kv_heads;
      const int64_t seq_len = lens[seq];
      scalar_t* o = out_ptr + seq * out_stride + kv_head * group * head_dim;
      if (seq_len <= 0) {
        for (int64_t i = 0; i < group * head_dim; ++i) from_float(0.f, o + i);
        continue;
      }
      TORCH_CHECK(seq_len <= s.max_blocks_per_seq * s.block_size, "paged_decode_attention: ",
                  "seq_lens[", seq, "] = ", seq_len, " exceeds its block table");
      const int64_t table_row = rows_of != nullptr ? rows_of[seq] : seq;
      TORCH_CHECK(table_row >= 0 && table_row < s.num_tables, "paged_decode_attention: ",
                  "table_rows[", seq, "] = ", table_row, " is not a row of block_tables");
      const int64_t start =
          sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const scalar_t* qs = q_ptr + seq * q_stride + kv_head * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i)
        q[i] = to_float(qs[i]) * static_cast<float>(scale);
      scores.resize(group * padded_span(seq_len - start));
      attend(q.data(), k_ptr, v_ptr, tables + table_row * s.max_blocks_per_seq, start, seq_len,
             kv_head, group, s, scores.data(), acc.data(), o);
    }
  });
}

}  // namespace

// See kernels/cpu/paged_attention.py (paged_decode_attention) for the contract.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, torch::Tensor table_rows, double scale,
                            int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "paged_decode_attention: query and out must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: caches must be [num_blocks, block_size, num_kv_heads, "
              "head_dim], both the same");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "paged_decode_attention: query and out rows must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: query, out and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "paged_decode_attention: block_tables must be contiguous int32 [num_seqs, n]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.is_contiguous(),
              "paged_decode_attention: seq_lens must be contiguous int32 [num_seqs]");
  const int64_t num_seqs = query.size(0);
  TORCH_CHECK(seq_lens.size(0) == num_seqs, "paged_decode_attention: one length per query");
  if (table_rows.numel() > 0) {
    TORCH_CHECK(table_rows.scalar_type() == torch::kInt32 && table_rows.dim() == 1 &&
                    table_rows.is_contiguous() && table_rows.size(0) == num_seqs,
                "paged_decode_attention: table_rows must be contiguous int32 [num_queries]");
  } else {
    TORCH_CHECK(block_tables.size(0) == num_seqs,
                "paged_decode_attention: one block table row per query without table_rows");
  }
  TORCH_CHECK(k_cache.size(3) == query.size(2), "paged_decode_attention: head_dim mismatch");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: num_heads must be a multiple of num_kv_heads");
#if KVPILOT_X86
  static const bool has_avx512 = __builtin_cpu_supports("avx512f");
#else
  constexpr bool has_avx512 = false;
#endif
  const bool dot16 = has_avx512 && query.size(2) % 16 == 0 && k_cache.size(1) % 16 == 0;
  const Shape s{query.size(1),        k_cache.size(2),      query.size(2),
                k_cache.size(1),      k_cache.size(0),      block_tables.size(0),
                block_tables.size(1), dot16};
  if (query.scalar_type() == torch::kFloat32) {
    run<float>(out, query, k_cache, v_cache, block_tables, seq_lens, table_rows, scale,
               sliding_window, s);
  } else if (query.scalar_type() == torch::kBFloat16) {
    run<c10::BFloat16>(out, query, k_cache, v_cache, block_tables, seq_lens, table_rows, scale,
                       sliding_window, s);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ",
                query.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-table KV cache, in place (CPU).");
}
