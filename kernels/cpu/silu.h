// SiLU, g / (1 + exp(-g)), as ATen's CPU silu kernel computes it, for the CPU kernels that apply
// it: elementwise.cpp (silu_and_mul) and gemm.cpp (the gate/up projection's epilogue), so that
// both give the same bits as the torch path.
//
// ATen's loop takes a row in chunks of two vectors of the dtype (2 x 64 bytes with AVX-512, 2 x
// 32 with AVX2, as at::get_cpu_capability() says) through SLEEF's expf (1 ulp; exported by
// libtorch_cpu) and the elements after the last whole chunk through std::exp; so does this. The
// vector code is written with intrinsics (a division, then a product: nothing a compiler may
// fuse), the rest is plain C++ with the same two roundings.

#pragma once

#include <ATen/Version.h>

#include <cmath>
#include <cstdint>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPILOT_SILU_X86 1
#include <immintrin.h>
// SLEEF's vector expf, as ATen's Vectorized<float>::exp() calls it (exported by libtorch_cpu).
#pragma GCC push_options
#pragma GCC target("avx512f")
extern "C" __m512 Sleef_expf16_u10(__m512);
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2")
extern "C" __m256 Sleef_expf8_u10(__m256);
#pragma GCC pop_options
#else
#define KVPILOT_SILU_X86 0
#endif

namespace kvpilot_silu {

enum class Vector { kNone, kAvx2, kAvx512 };

// The vectors ATen's kernels run with in this process.
inline Vector torch_vector() {
#if KVPILOT_SILU_X86
  static const Vector v = [] {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") return Vector::kAvx512;
    if (capability == "AVX2") return Vector::kAvx2;
    return Vector::kNone;
  }();
  return v;
#else
  return Vector::kNone;
#endif
}

// How many of a row's first `d` elements of `element_bytes` each ATen takes the vector way (whole
// chunks of two vectors).
inline int64_t vectorized(int64_t d, Vector v, int64_t element_bytes) {
  const int64_t vector_bytes = v == Vector::kAvx512 ? 64 : v == Vector::kAvx2 ? 32 : 0;
  const int64_t chunk = 2 * vector_bytes / element_bytes;
  return chunk == 0 ? 0 : d / chunk * chunk;
}

#if KVPILOT_SILU_X86
// out[i] = silu(g[i]) * (up ? up[i] : 1) for i < count (a multiple of the vector's lanes).
__attribute__((target("avx512f"))) inline void silu16(const float* g, const float* up, float* out,
                                                      int64_t count) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int64_t i = 0; i < count; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = Sleef_expf16_u10(
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));
    __m512 y = _mm512_div_ps(x, _mm512_add_ps(one, e));
    if (up != nullptr) y = _mm512_mul_ps(y, _mm512_loadu_ps(up + i));
    _mm512_storeu_ps(out + i, y);
  }
}

__attribute__((target("avx2"))) inline void silu8(const float* g, const float* up, float* out,
                                                  int64_t count) {
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < count; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_xor_ps(x, sign));
    __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, e));
    if (up != nullptr) y = _mm256_mul_ps(y, _mm256_loadu_ps(up + i));
    _mm256_storeu_ps(out + i, y);
  }
}
#endif

// silu(g) (times up when given) of `count` floats, the first `vector_count` the vector way (a
// multiple of v's lanes; see vectorized()).
inline void silu_floats(const float* g, const float* up, float* out, int64_t count,
                        int64_t vector_count, Vector v) {
#if KVPILOT_SILU_X86
  if (v == Vector::kAvx512) {
    silu16(g, up, out, vector_count);
  } else if (v == Vector::kAvx2) {
    silu8(g, up, out, vector_count);
  }
#else
  vector_count = 0;
#endif
  for (int64_t i = vector_count; i < count; ++i) {
    const float y = g[i] / (1.f + std::exp(-g[i]));
    out[i] = up != nullptr ? y * up[i] : y;
  }
}

}  // namespace kvpilot_silu
