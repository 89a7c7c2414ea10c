// Fused elementwise ops of a decoder layer on the CPU: RMSNorm with the residual add, SiLU-and-mul
// and the GPT-NeoX rotary embedding, each one pass over its rows instead of several PyTorch ops.
//
// Each op reproduces the PyTorch expressions of kernels/reference.py (rms_norm, silu_and_mul) and
// engine/layers/rotary_embedding.py (apply_rotary_emb) operation for operation, rounding where
// they round, so the results are those of the torch path:
//
// - rms_norm (Zhang & Sennrich 2019): s = x + residual (rounded to the dtype), h = float(s),
//   r = 1 / sqrt(sum(h * h) / n + eps), then w * dtype(h * r) (Llama) or dtype(h * r * (offset +
//   w)) (Gemma). The sum of squares is added up in the order of ATen's CPU sum kernel (its
//   cascade sum: 8 float lanes, 4 interleaved accumulators, 4 levels of partial sums, at every
//   AVX level), so float32 and bfloat16 results are the reference's bit for bit.
// - silu_and_mul (Shazeer 2020): dtype(silu(g)) * u with silu(g) = g / (1 + exp(-g)); exp is
//   SLEEF's expf (1 ulp, the one ATen's vectorized silu calls, exported by libtorch_cpu) on
//   whole vectors and std::exp on the rest, in the chunks ATen's loop uses (silu.h, which
//   gemm.cpp's gate/up epilogue shares).
// - rotary_neox (Su et al. 2021): x1' = dtype(x1 c1) - dtype(x2 s1), x2' = dtype(x2 c2) +
//   dtype(x1 s2) over the first rotary_dim features, the rest copied: bit for bit.
//
// The row loops are compiled for AVX-512, AVX2 and baseline x86-64 (GCC target_clones, picked at
// load time); the extension is built with -ffp-contract=off, so no target fuses a multiply and an
// add into one rounding where PyTorch rounds twice. Rows are split over ATen's OpenMP threads
// (at::parallel_for) only when a call has enough of them to pay for it (kGrainElements). The
// Python wrapper is kernels/cpu/elementwise.py.

#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "silu.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPILOT_X86 1
#define KVPILOT_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#include <immintrin.h>
#else
#define KVPILOT_X86 0
#define KVPILOT_TARGET_CLONES
#endif

namespace {

// Elements a thread at least (32 KiB of float32): a decode step's 32 rows of 576 features go to
// two threads, ~0.8 ms less (RMSNorm and rotary) a two-thread SmolLM2 step than with ATen's
// GRAIN_SIZE (32,768), which kept them on one (the rows come from a GEMM whose threads each
// wrote half of every row).
constexpr int64_t kGrainElements = 8192;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Rounds to the storage dtype (round to nearest even for bfloat16, as ATen's casts).
template <typename scalar_t>
inline scalar_t round_to(float x) {
  return static_cast<scalar_t>(x);
}

// ---------------------------------------------------------------------------------------------
// The sum of squares in ATen's order (aten/src/ATen/native/cpu/SumKernel.cpp, the contiguous
// inner reduction): the row is read as W-lane vectors (W = 8 float lanes; W = 1 for rows shorter
// than 8), 4 consecutive vectors go to 4 accumulators, and those are folded through 4 levels of
// partial sums every 2^level_power steps (cascade summation); then the accumulators, the
// elements past the last whole vector and the lanes are added in that order.

constexpr int kSumLanes = 8, kIlp = 4, kLevels = 4;

inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// Lane sums of h[v * W + w]^2 over vectors v < num_vectors.
template <int W>
inline __attribute__((always_inline)) void cascade_squares(const float* h, int64_t num_vectors,
                                                            float out[W]) {
  float acc[kLevels][kIlp][W] = {};
  const int64_t groups = num_vectors / kIlp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  auto add_group = [&](int64_t g) {
    for (int k = 0; k < kIlp; ++k) {
      const float* v = h + (g * kIlp + k) * W;
      for (int w = 0; w < W; ++w) acc[0][k][w] += v[w] * v[w];
    }
  };
  int64_t i = 0;
  while (i + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_group(i);
    for (int l = 1; l < kLevels; ++l) {
      for (int k = 0; k < kIlp; ++k) {
        for (int w = 0; w < W; ++w) {
          acc[l][k][w] += acc[l - 1][k][w];
          acc[l - 1][k][w] = 0.f;
        }
      }
      if ((i & (level_mask << (l * level_power))) != 0) break;
    }
  }
  for (; i < groups; ++i) add_group(i);
  for (int l = 1; l < kLevels; ++l) {
    for (int k = 0; k < kIlp; ++k) {
      for (int w = 0; w < W; ++w) acc[0][k][w] += acc[l][k][w];
    }
  }
  for (int64_t v = groups * kIlp; v < num_vectors; ++v) {
    for (int w = 0; w < W; ++w) acc[0][0][w] += h[v * W + w] * h[v * W + w];
  }
  for (int k = 1; k < kIlp; ++k) {
    for (int w = 0; w < W; ++w) acc[0][0][w] += acc[0][k][w];
  }
  for (int w = 0; w < W; ++w) out[w] = acc[0][0][w];
}

inline __attribute__((always_inline)) float sum_of_squares(const float* h, int64_t n) {
  if (n < kSumLanes) {
    float total;
    cascade_squares<1>(h, n, &total);
    return total;
  }
  const int64_t num_vectors = n / kSumLanes;
  float lanes[kSumLanes];
  cascade_squares<kSumLanes>(h, num_vectors, lanes);
  float total = 0.f;
  for (int64_t i = num_vectors * kSumLanes; i < n; ++i) total += h[i] * h[i];
  for (int w = 0; w < kSumLanes; ++w) total += lanes[w];
  return total;
}

// One row: residual_out = x + residual (when given), out = the normalised row; h: n floats.
template <typename scalar_t>
inline __attribute__((always_inline)) void rms_norm_row(scalar_t* out, scalar_t* residual_out,
                                                       const scalar_t* x, const scalar_t* residual,
                                                       const scalar_t* weight, int64_t n,
                                                       float eps, float weight_offset, float* h) {
  if (residual != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      residual_out[i] = round_to<scalar_t>(to_float(x[i]) + to_float(residual[i]));
      h[i] = to_float(residual_out[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = to_float(x[i]);
  }
  const float mean_square = sum_of_squares(h, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(mean_square + eps);
  if (weight_offset != 0.f) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = round_to<scalar_t>(h[i] * r * (weight_offset + to_float(weight[i])));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = round_to<scalar_t>(to_float(weight[i]) * to_float(round_to<scalar_t>(h[i] * r)));
    }
  }
}

// The per-row entry points, compiled once per instruction set (GCC clones no templates). The
// row templates are always_inline: a template GCC chose not to inline was compiled once, for
// baseline x86-64, and every clone called that scalar copy (RMSNorm and rotary ran 2-3x slower).
#define KVPILOT_RMS_NORM_ROW(name, scalar_t)                                                   \
  KVPILOT_TARGET_CLONES void name(scalar_t* out, scalar_t* residual_out, const scalar_t* x,    \
                                  const scalar_t* residual, const scalar_t* weight, int64_t n, \
                                  float eps, float weight_offset, float* h) {                  \
    rms_norm_row<scalar_t>(out, residual_out, x, residual, weight, n, eps, weight_offset, h);  \
  }
KVPILOT_RMS_NORM_ROW(rms_norm_row_float, float)
KVPILOT_RMS_NORM_ROW(rms_norm_row_bfloat16, c10::BFloat16)

inline void rms_norm_row_any(float* out, float* ro, const float* x, const float* r,
                             const float* w, int64_t n, float eps, float off, float* h) {
  rms_norm_row_float(out, ro, x, r, w, n, eps, off, h);
}
inline void rms_norm_row_any(c10::BFloat16* out, c10::BFloat16* ro, const c10::BFloat16* x,
                             const c10::BFloat16* r, const c10::BFloat16* w, int64_t n, float eps,
                             float off, float* h) {
  rms_norm_row_bfloat16(out, ro, x, r, w, n, eps, off, h);
}

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, scalar_t* residual_out, const scalar_t* x,
                   const scalar_t* residual, const scalar_t* weight, int64_t rows, int64_t n,
                   float eps, float weight_offset) {
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<float> h(n);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t at = row * n;
      rms_norm_row_any(out + at, residual ? residual_out + at : nullptr, x + at,
                       residual ? residual + at : nullptr, weight, n, eps, weight_offset,
                       h.data());
    }
  });
}

// ---------------------------------------------------------------------------------------------
// SiLU (silu.h: the vector expf and the chunks of ATen's silu kernel).

KVPILOT_TARGET_CLONES void bfloat16_to_float(const c10::BFloat16* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(x[i]);
}

// out = bfloat16(bfloat16(s) * up), the rounding of silu's output and of the product.
KVPILOT_TARGET_CLONES void bfloat16_mul(const float* s, const c10::BFloat16* up,
                                        c10::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = round_to<c10::BFloat16>(to_float(round_to<c10::BFloat16>(s[i])) * to_float(up[i]));
  }
}

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, const scalar_t* x, int64_t rows, int64_t d) {
  const kvpilot_silu::Vector v = kvpilot_silu::torch_vector();
  const int64_t vectorized = kvpilot_silu::vectorized(d, v, sizeof(scalar_t));
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> g, s;
    if constexpr (!std::is_same_v<scalar_t, float>) g.resize(d), s.resize(d);
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = x + row * 2 * d;
      if constexpr (std::is_same_v<scalar_t, float>) {
        // float32 rounds silu's output and the product each once: one pass, in registers.
        kvpilot_silu::silu_floats(gate, gate + d, out + row * d, d, vectorized, v);
      } else {
        bfloat16_to_float(gate, g.data(), d);
        kvpilot_silu::silu_floats(g.data(), nullptr, s.data(), d, vectorized, v);
        bfloat16_mul(s.data(), gate + d, out + row * d, d);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// GPT-NeoX rotary embedding: x * cos + rotate_half(x) * sin, each product and the sum rounded.

// One token's heads: x [heads, head_dim] (rows contiguous) -> out, cos/sin [rotary_dim]. The
// pointers do not alias (out is a new tensor), which lets the compiler vectorize the loop.
template <typename scalar_t>
inline __attribute__((always_inline)) void rotary_token(scalar_t* __restrict out,
                                                       const scalar_t* __restrict x,
                                                       const scalar_t* __restrict c,
                                                       const scalar_t* __restrict s, int64_t heads,
                                                       int64_t head_dim, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* xh = x + h * head_dim;
    scalar_t* oh = out + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(xh[i]), x2 = to_float(xh[i + half]);
      const float a = to_float(round_to<scalar_t>(x1 * to_float(c[i])));
      const float b = to_float(round_to<scalar_t>(x2 * to_float(s[i])));
      oh[i] = round_to<scalar_t>(a - b);
      const float e = to_float(round_to<scalar_t>(x2 * to_float(c[i + half])));
      const float f = to_float(round_to<scalar_t>(x1 * to_float(s[i + half])));
      oh[i + half] = round_to<scalar_t>(e + f);
    }
    for (int64_t i = rotary_dim; i < head_dim; ++i) oh[i] = xh[i];
  }
}

#define KVPILOT_ROTARY_TOKEN(name, scalar_t)                                                   \
  KVPILOT_TARGET_CLONES void name(scalar_t* out, const scalar_t* x, const scalar_t* c,         \
                                  const scalar_t* s, int64_t heads, int64_t head_dim,          \
                                  int64_t rotary_dim) {                                        \
    rotary_token<scalar_t>(out, x, c, s, heads, head_dim, rotary_dim);                         \
  }
KVPILOT_ROTARY_TOKEN(rotary_token_float, float)
KVPILOT_ROTARY_TOKEN(rotary_token_bfloat16, c10::BFloat16)

inline void rotary_token_any(float* out, const float* x, const float* c, const float* s,
                             int64_t heads, int64_t head_dim, int64_t rotary_dim) {
  rotary_token_float(out, x, c, s, heads, head_dim, rotary_dim);
}
inline void rotary_token_any(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* c,
                             const c10::BFloat16* s, int64_t heads, int64_t head_dim,
                             int64_t rotary_dim) {
  rotary_token_bfloat16(out, x, c, s, heads, head_dim, rotary_dim);
}

template <typename scalar_t>
void rotary_rows(scalar_t* out, const scalar_t* x, int64_t token_stride, const scalar_t* cos,
                 const scalar_t* sin, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim) {
  at::parallel_for(0, tokens, grain_rows(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotary_token_any(out + t * heads * head_dim, x + t * token_stride, cos + t * rotary_dim,
                       sin + t * rotary_dim, heads, head_dim, rotary_dim);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Argmax of float32 rows, as torch.argmax(dim=-1): the first index of the largest value, or of
// the first NaN (which torch ranks above every number). Greedy sampling's pick: ATen's CPU
// argmax compares one element at a time; here the maximum is found a vector at a time, then
// the first element equal to it.

// The first NaN's index in x[0..n), or -1.
inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

#if KVPILOT_X86
__attribute__((target("avx512f"))) int64_t argmax_row16(const float* x, int64_t n) {
  const int64_t whole = n / 16 * 16;
  __m512 lanes = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lanes = _mm512_max_ps(v, lanes);  // a NaN v leaves the lanes as they were
  }
  float best = _mm512_reduce_max_ps(lanes);
  for (int64_t i = whole; i < n; ++i) {
    if (std::isnan(x[i])) nan = 1;
    best = std::max(best, x[i]);
  }
  if (nan) return first_nan(x, n);
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t i = 0; i < whole; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = whole; i < n; ++i)
    if (x[i] == best) return i;
  return 0;  // not reached: some element equals the maximum
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
#if KVPILOT_X86
  if (__builtin_cpu_supports("avx512f")) return argmax_row16(x, n);
#endif
  int64_t index = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[index]) index = i;
  }
  return index;
}

// Calls f with a value of the tensor's element type (float or c10::BFloat16; check_dtype first).
template <typename F>
void dispatch(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kFloat32) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

void check_dtype(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16, op,
              ": float32 or bfloat16 only, got ", t.scalar_type());
}

}  // namespace

// See kernels/cpu/elementwise.py (rms_norm) for the contract.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps,
              c10::optional<torch::Tensor> residual_out, c10::optional<torch::Tensor> residual,
              double weight_offset) {
  check_dtype(x, "rms_norm");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "rms_norm: x must have a non-empty last dimension");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "rms_norm: weight must be [", n,
              "] (x's last dimension), got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must share one dtype");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous() &&
                  out.sizes() == x.sizes(),
              "rms_norm: x, weight and out must be contiguous, out shaped like x");
  TORCH_CHECK(residual.has_value() == residual_out.has_value(),
              "rms_norm: residual and residual_out go together");
  if (residual.has_value()) {
    for (const auto& r : {*residual, *residual_out}) {
      TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() &&
                      r.is_contiguous() && r.device().is_cpu(),
                  "rms_norm: residual must be contiguous, x's shape and dtype, got ", r.sizes(),
                  " ", r.scalar_type());
    }
  }
  const int64_t rows = x.numel() / n;
  const float e = static_cast<float>(eps), offset = static_cast<float>(weight_offset);
  dispatch(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(),
                            residual ? residual_out->data_ptr<scalar_t>() : nullptr,
                            x.data_ptr<scalar_t>(),
                            residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), rows, n, e, offset);
  });
}

// See kernels/cpu/elementwise.py (silu_and_mul) for the contract.
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_dtype(x, "silu_and_mul");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: x's last dimension must be even (gate, then up), got ", x.sizes());
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x and out must be contiguous, one dtype");
  const int64_t d = x.size(-1) / 2;
  TORCH_CHECK(out.numel() * 2 == x.numel() && out.size(-1) == d,
              "silu_and_mul: out must be x's shape with the last dimension halved");
  const int64_t rows = d == 0 ? 0 : x.numel() / (2 * d);
  dispatch(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows, d);
  });
}

// See kernels/cpu/elementwise.py (rotary_neox) for the contract: out is x rotated.
void rotary_neox(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_dtype(x, "rotary_neox");
  TORCH_CHECK(x.dim() == 3, "rotary_neox: x must be [num_tokens, num_heads, head_dim], got ",
              x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && (heads == 1 || x.stride(1) == head_dim),
              "rotary_neox: each token's [num_heads, head_dim] must be contiguous");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "rotary_neox: out must be contiguous, x's shape and dtype");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  cos.dim() >= 2 && cos.size(0) == tokens &&
                  cos.numel() == tokens * cos.size(-1),
              "rotary_neox: cos and sin must be contiguous [num_tokens, (1,) rotary_dim] in x's "
              "dtype");
  at::assert_no_overlap(out, x);
  const int64_t rotary_dim = cos.size(-1);
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "rotary_neox: rotary_dim must be even and at most head_dim, got ", rotary_dim);
  dispatch(x, [&](auto tag) {
    using scalar_t = decltype(tag);
    rotary_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0),
                          cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), tokens, heads,
                          head_dim, rotary_dim);
  });
}

// See kernels/cpu/elementwise.py (argmax) for the contract.
void argmax(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) > 0,
              "argmax: x must be a contiguous, non-empty [rows, n] float32 CPU tensor, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == torch::kInt64 && out.dim() == 1 && out.size(0) == x.size(0) &&
                  out.is_contiguous(),
              "argmax: out must be a contiguous [rows] int64 tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, the residual add fused, into out (CPU).");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up into out (CPU).");
  m.def("rotary_neox", &rotary_neox, "GPT-NeoX rotary embedding of x into out (CPU).");
  m.def("argmax", &argmax, "torch.argmax(x, dim=-1) of float32 rows into out (CPU).");
}
