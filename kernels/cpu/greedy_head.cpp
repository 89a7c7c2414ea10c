// The LM head's greedy token without every float32 logit: a bfloat16 screen of the whole
// vocabulary, a rigorous error bound, and the float32 logits of the few tokens the bound cannot
// rule out, in the GEMM kernel's own summation order (gemm.cpp). The token is the argmax of
// the float32 logits packed_linear would give, bit for bit: the first index of their largest
// value.
//
// Screen. The head W [N, K] (float32, packed for gemm.cpp) is copied once as bfloat16 Ŵ
// (round to nearest even), in panels of 64 tokens stored as pairs of input features,
// [ceil(N / 64)][ceil(K / 2)][64][2], so that one AVX-512 BF16 dot product (vdpbf16ps) takes a
// pair of features of 16 tokens against a broadcast pair of x̂ = bfloat16(x): twice the
// multiply-adds of a float32 FMA per instruction and half the bytes. a_j = Σ ŵ_jk x̂_k, summed
// in float32.
//
// Bound. With t_j = Σ w_jk x_k exactly, f_j the kernel's float32 result (one rounding per
// fused multiply-add, K of them at most on any path of its summation tree) and γ = 2 K 2^-24
// (≥ K u / (1 - K u), u = 2^-24, also for a dot-product unit that rounds faithfully):
//
//     |f_j - t_j| ≤ γ ||w_j|| ||x||                      (Cauchy-Schwarz on Σ |w_jk x_k|)
//     |a_j - t_j| ≤ ||ŵ_j|| ||x̂ - x|| + ||ŵ_j - w_j|| ||x|| + γ ||ŵ_j|| ||x̂||
//
// (products of two bfloat16 values are exact in float32). A BF16 unit may take subnormal
// inputs as zero (Intel's vdpbf16ps does), so ŵ and x̂ are rounded with subnormals flushed to
// zero here: the unit sees exactly ŵ and x̂ whatever it does with subnormals (a helper's test
// with subnormal weights against x = 1e30 found the bound short without it). Products and sums
// it flushes cost at most 2^-126 each, 2K of them: the constant 2^-90. And should the float32
// kernel run with its own subnormals flushed (torch.set_flush_denormal), f_j moves by at most
// 2^-126 (||x||_1 + ||w_j||_1) ≤ 2^-126 (||x||_1 + √K n_j). So |a_j - f_j| ≤ e_j =
// n_j ρ + g_j σ + τ with n_j ≥ max(||w_j||, ||ŵ_j||) and g_j ≥ ||ŵ_j - w_j|| per token (once,
// rounded up), and per row ρ = ||x̂ - x|| + γ (||x|| + ||x̂||) + 2^-126 √K, σ = ||x||,
// τ = 2^-90 + 2^-126 ||x||_1 (in double, times 1 + 2^-16, rounded up).
// If j* is the argmax of f, then a_j* + e_j* ≥ f_j* ≥ f_k ≥ a_k - e_k for every k, so j* (and
// every token tied with it) is among the candidates {j : a_j + e_j ≥ L}, L = max_k (a_k - e_k).
// Their float32 logits are then computed as the kernel computes them, and the first largest
// is the token. The float32 arithmetic of the test itself is covered by a slack of
// 2^-19 (max |a| + max e), far above its rounding. On SmolLM2-135M's head a row has 1-35
// candidates (median 2) of 49,152.
//
// A row is left undecided (-1, the caller computes its logits in full) when x, an a_j or a
// candidate's logit is not finite (torch's argmax takes NaN as the largest), or when more
// than max_candidates tokens remain (all logits nearly equal: x ≈ 0).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "x86.h"

namespace {

constexpr int64_t kCols = 64;   // tokens per bfloat16 panel (4 vectors of 16)
constexpr int64_t kPanel = 32;  // tokens per float32 panel (gemm.cpp's kPanel)
constexpr int64_t kChunk = 128; // gemm.cpp's summation chunk
constexpr int kRows = 6;        // rows of x a screen call takes (24 accumulators)
constexpr int64_t kGroupRows = 10 * kRows;  // rows screened before they are decided
constexpr int64_t kPrefetch = 16;  // feature pairs ahead the screen's panel is prefetched
constexpr double kInflate = 1.0 + 1.0 / 65536;  // 1 + 2^-16
constexpr double kTiny = 0x1p-90;       // flushed products and sums (see the header)
constexpr double kSubnormal = 0x1p-126;  // the largest float32 subnormal, rounded up

void check(bool ok, const std::string& message) {
  TORCH_CHECK(ok, "kvpilot greedy head: ", message);
}

bool cpu_supported() {
#if KVPILOT_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool supported() { return cpu_supported(); }

// float32 -> bfloat16 bits, round to nearest even (as torch's conversion; NaN stays a NaN),
// a subnormal result flushed to a zero of its sign (what a BF16 unit may take it for).
uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  const auto out = static_cast<uint16_t>(bits >> 16);
  return (out & 0x7F80) == 0 ? static_cast<uint16_t>(out & 0x8000) : out;
}

float from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The smallest float32 at least `value` (a double).
float round_up(double value) {
  const float f = static_cast<float>(value);
  return static_cast<double>(f) >= value ? f : std::nextafter(f, std::numeric_limits<float>::infinity());
}

// The packed float32 weight's element (token j, feature k), as gemm.cpp's pack_weight stores it.
inline float packed_at(const float* panels, int64_t K, int64_t j, int64_t k) {
  return panels[(j / kPanel) * K * kPanel + k * kPanel + j % kPanel];
}

}  // namespace

// From the float32 panels of a head of N tokens: the bfloat16 screen
// [ceil(N / 64), ceil(K / 2), 64, 2] (int16 bits; zero past N and K), and per token
// n_j ≥ max(||w_j||, ||ŵ_j||) and g_j ≥ ||ŵ_j - w_j|| (float32, rounded up).
void pack_screen(const torch::Tensor& panels, int64_t N, torch::Tensor screen,
                 torch::Tensor norms, torch::Tensor gaps) {
  check(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
            panels.scalar_type() == torch::kFloat32,
        "the float32 weight must come from gemm.pack_weight");
  const int64_t K = panels.size(1), K2 = (K + 1) / 2, P = (N + kCols - 1) / kCols;
  check(N > (panels.size(0) - 1) * kPanel && N <= panels.size(0) * kPanel,
        "out_features " + std::to_string(N) + " does not match the packed weight");
  check(screen.dim() == 4 && screen.size(0) == P && screen.size(1) == K2 &&
            screen.size(2) == kCols && screen.size(3) == 2 && screen.is_contiguous() &&
            screen.scalar_type() == torch::kInt16,
        "the screen must be a contiguous int16 [ceil(N / 64), ceil(K / 2), 64, 2] tensor");
  check(norms.numel() == N && gaps.numel() == N && norms.is_contiguous() &&
            gaps.is_contiguous() && norms.scalar_type() == torch::kFloat32 &&
            gaps.scalar_type() == torch::kFloat32,
        "norms and gaps must be contiguous float32 [N] tensors");
  const float* w = panels.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(screen.data_ptr());
  float* n_out = norms.data_ptr<float>();
  float* g_out = gaps.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t j = p * kCols + c;
        double norm = 0, norm_bf16 = 0, gap = 0;
        for (int64_t k = 0; k < 2 * K2; ++k) {
          const float value = j < N && k < K ? packed_at(w, K, j, k) : 0.0f;
          const uint16_t bits = to_bf16(value);
          dst[((p * K2 + k / 2) * kCols + c) * 2 + k % 2] = bits;
          const double v = value, b = from_bf16(bits);
          norm += v * v;
          norm_bf16 += b * b;
          gap += (b - v) * (b - v);
        }
        if (j < N) {
          n_out[j] = round_up(std::sqrt(std::max(norm, norm_bf16)) * kInflate);
          g_out[j] = round_up(std::sqrt(gap) * kInflate);
        }
      }
    }
  });
}

#if KVPILOT_X86
namespace {

// a[ROWS][64] = x̂[ROWS] · (the panel's 64 tokens), K2 feature pairs; rows ldx pairs apart.
template <int ROWS>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void screen_call(
    const uint32_t* x, int64_t ldx, int64_t K2, const uint16_t* panel, float* a, int64_t lda) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = panel + kk * kCols * 2;
    if (kk + kPrefetch < K2) {
      const char* ahead = reinterpret_cast<const char*>(w + kPrefetch * kCols * 2);
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + kk]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xr);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xr);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(a + r * lda + 16 * v, acc[r][v]);
}

using ScreenCall = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, float*, int64_t);
constexpr ScreenCall kScreenCalls[kRows + 1] = {nullptr,         screen_call<1>, screen_call<2>,
                                                screen_call<3>, screen_call<4>, screen_call<5>,
                                                screen_call<6>};

// One row's float32 logit of token j in gemm.cpp's order: chunks of 128 features, each summed
// from zero by fused multiply-adds in k order, the chunks' sums added in chunk order.
__attribute__((target("avx512f,fma"))) float exact_logit(const float* x, const float* panels,
                                                       int64_t K, int64_t j) {
  const float* w = panels + (j / kPanel) * K * kPanel + j % kPanel;
  float y = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    __m128 p = _mm_setzero_ps();
    for (int64_t k = k0; k < std::min(K, k0 + kChunk); ++k)
      p = _mm_fmadd_ss(_mm_set_ss(x[k]), _mm_set_ss(w[k * kPanel]), p);
    y = k0 == 0 ? _mm_cvtss_f32(p) : y + _mm_cvtss_f32(p);
  }
  return y;
}

// A row's terms of the bound (see the header), each rounded up.
struct RowBound {
  float rho, sigma, tau;
};

// e_j of the 16 tokens from `at` (those of mask m), as in the header: fma(n, ρ, g σ + τ).
__attribute__((target("avx512f"))) inline __m512 bound_at(const float* norms, const float* gaps,
                                                        int64_t at, __mmask16 m, __m512 rho,
                                                        __m512 sigma, __m512 tau) {
  return _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, norms + at), rho,
                         _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, gaps + at), sigma, tau));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// The token of one row from its screened logits a[N] (see the header), or -1.
__attribute__((target("avx512f,fma"))) int64_t decide(const float* a, const float* norms,
                                                    const float* gaps, int64_t N,
                                                    const RowBound& bound, const float* x,
                                                    const float* panels, int64_t K,
                                                    int64_t max_candidates,
                                                    std::vector<int64_t>& candidates) {
  const __m512 vrho = _mm512_set1_ps(bound.rho), vsigma = _mm512_set1_ps(bound.sigma);
  const __m512 vtau = _mm512_set1_ps(bound.tau);
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 lo_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 a_max = _mm512_setzero_ps(), e_max = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < N; j += 16) {
    const __mmask16 m = tail_mask(N - j);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + j);
    const __m512 e = bound_at(norms, gaps, j, m, vrho, vsigma, vtau);
    const __m512 magnitude = _mm512_abs_ps(av);
    // Not finite: a NaN is unordered with itself; an infinity exceeds the largest float.
    if (_mm512_mask_cmp_ps_mask(m, av, av, _CMP_UNORD_Q) |
        _mm512_mask_cmp_ps_mask(m, magnitude, largest, _CMP_GT_OQ))
      return -1;
    lo_max = _mm512_mask_max_ps(lo_max, m, lo_max, _mm512_sub_ps(av, e));
    a_max = _mm512_max_ps(a_max, magnitude);
    e_max = _mm512_max_ps(e_max, e);
  }
  const float L = _mm512_reduce_max_ps(lo_max);
  const float slack = 0x1p-19f * (_mm512_reduce_max_ps(a_max) + _mm512_reduce_max_ps(e_max));
  const __m512 threshold = _mm512_set1_ps(L - slack);
  candidates.clear();
  for (j = 0; j < N; j += 16) {
    const __mmask16 m = tail_mask(N - j);
    const __m512 hi = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + j),
                                    bound_at(norms, gaps, j, m, vrho, vsigma, vtau));
    uint32_t hit = _mm512_mask_cmp_ps_mask(m, hi, threshold, _CMP_GE_OQ);
    while (hit) {
      candidates.push_back(j + __builtin_ctz(hit));
      hit &= hit - 1;
    }
    if (static_cast<int64_t>(candidates.size()) > max_candidates) return -1;
  }
  int64_t best = -1;
  float best_logit = 0.0f;
  for (const int64_t c : candidates) {  // ascending: the first of equal logits wins
    const float logit = exact_logit(x, panels, K, c);
    if (!std::isfinite(logit)) return -1;
    if (best < 0 || logit > best_logit) {
      best = c;
      best_logit = logit;
    }
  }
  return best;
}

}  // namespace
#endif

// tokens[M] = the argmax of x[M, K] W^T (float32, W packed for gemm.cpp) for each row, or -1
// where the row is left to the caller (see the header).
void greedy_tokens(torch::Tensor tokens, const torch::Tensor& x, const torch::Tensor& panels,
                   int64_t N, const torch::Tensor& screen, const torch::Tensor& norms,
                   const torch::Tensor& gaps, int64_t max_candidates) {
  check(cpu_supported(), "this CPU has no AVX-512 BF16");
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
            x.device().is_cpu(),
        "x must be a contiguous [M, K] float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), K2 = (K + 1) / 2;
  check(panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kPanel &&
            panels.is_contiguous() && panels.scalar_type() == torch::kFloat32,
        "x has " + std::to_string(K) + " features; the float32 weight must be packed for them");
  const int64_t P = (N + kCols - 1) / kCols;
  check(screen.dim() == 4 && screen.size(0) == P && screen.size(1) == K2 &&
            screen.scalar_type() == torch::kInt16 && screen.is_contiguous(),
        "the screen does not match the weight (pack_screen)");
  check(norms.numel() == N && gaps.numel() == N, "norms and gaps must have N elements");
  check(tokens.dim() == 1 && tokens.size(0) == M && tokens.scalar_type() == torch::kInt64 &&
            tokens.is_contiguous(),
        "tokens must be a contiguous int64 [M] tensor");
  if (M == 0) return;
#if KVPILOT_X86
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  const auto* sp = reinterpret_cast<const uint16_t*>(screen.data_ptr());
  int64_t* out = tokens.data_ptr<int64_t>();
  // x̂ as feature pairs, and each row's ρ, σ and τ (see the header).
  thread_local std::vector<uint32_t> xb;
  thread_local std::vector<float> a;  // one group's screened logits, kept between calls
  xb.assign(static_cast<size_t>(M * K2), 0);
  std::vector<RowBound> bounds(M);
  std::vector<char> finite(M);
  const double gamma = 2.0 * static_cast<double>(K) * 0x1p-24;
  for (int64_t m = 0; m < M; ++m) {
    double norm = 0, norm_bf16 = 0, gap = 0, l1 = 0;
    bool ok = true;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xp[m * K + k];
      l1 += std::fabs(static_cast<double>(v));
      ok = ok && std::isfinite(v);
      const uint16_t bits = to_bf16(v);
      xb[m * K2 + k / 2] |= static_cast<uint32_t>(bits) << (16 * (k % 2));
      const double b = from_bf16(bits);
      norm += static_cast<double>(v) * v;
      norm_bf16 += b * b;
      gap += (b - v) * (b - v);
    }
    finite[m] = ok;
    const double rho = std::sqrt(gap) + gamma * (std::sqrt(norm) + std::sqrt(norm_bf16)) +
                       kSubnormal * std::sqrt(static_cast<double>(K));
    const double sigma = std::sqrt(norm), tau = kTiny + kSubnormal * l1;
    bounds[m] = {round_up(rho * kInflate), round_up(sigma * kInflate), round_up(tau * kInflate)};
  }
  const int64_t lda = P * kCols;
  const float* np = norms.data_ptr<float>();
  const float* gp = gaps.data_ptr<float>();
  // Rows in groups of kGroupRows, so that the screened logits held at once stay bounded
  // (kGroupRows x N floats: 11.8 MB for a 49,152-token vocabulary).
  for (int64_t g0 = 0; g0 < M; g0 += kGroupRows) {
    const int64_t rows_here = std::min(kGroupRows, M - g0);
    a.resize(static_cast<size_t>(rows_here * lda));
    float* ap = a.data();
    const uint32_t* xbp = xb.data() + g0 * K2;
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t m = 0; m < rows_here; m += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_here - m));
          kScreenCalls[rows](xbp + m * K2, K2, K2, sp + p * K2 * kCols * 2,
                             ap + m * lda + p * kCols, lda);
        }
    });
    at::parallel_for(0, rows_here, 1, [&](int64_t m0, int64_t m1) {
      std::vector<int64_t> candidates;
      for (int64_t m = m0; m < m1; ++m) {
        const int64_t row = g0 + m;
        out[row] = finite[row] ? decide(ap + m * lda, np, gp, N, bounds[row], xp + row * K, wp,
                                        K, max_candidates, candidates)
                               : -1;
      }
    });
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "Whether this CPU runs the kernel (AVX-512F, AVX-512 BF16, FMA).");
  m.def("pack_screen", &pack_screen,
        "From gemm.cpp's float32 panels of N tokens: the bfloat16 screen [ceil(N / 64), "
        "ceil(K / 2), 64, 2] (int16), and per token the norm bound and the rounding gap bound.",
        py::arg("panels"), py::arg("N"), py::arg("screen"), py::arg("norms"), py::arg("gaps"));
  m.def("greedy_tokens", &greedy_tokens,
        "tokens[M] = argmax of the float32 logits x W^T per row, or -1 where undecided.",
        py::arg("tokens"), py::arg("x"), py::arg("panels"), py::arg("N"), py::arg("screen"),
        py::arg("norms"), py::arg("gaps"), py::arg("max_candidates"));
}
