// The float32 matrix multiply of the linear layers on the CPU: y[M, N] = x[M, K] W[N, K]^T, with
// W packed once into panels of 32 output features (AVX-512).
//
// Layout. A weight of N rows is cut into ceil(N / 32) panels of 32 rows (the last zero-padded);
// a panel is stored k-major, [K][32], so that the 32 weights of one input feature are two
// adjacent 64-byte vectors and a panel is one contiguous stream (pack_weight). A gate/up
// projection W = [gate; up] (2d rows) can be packed gated: panel p then holds gate rows 16p..
// 16p + 15 in its first vector and the up rows of the same features (d + 16p..) in its second,
// so that one panel's products are 16 (gate, up) pairs: the panel's rows are computed into a
// small buffer and its epilogue writes silu(gate) * up (SwiGLU, Shazeer 2020) as silu.h (ATen's
// silu kernel) computes it, or the two halves back to their [gate | up] places. The same sums
// either way; the [M, 2d] projection is never written out and read back for the activation.
//
// Summation order, fixed by K alone. The K input features are cut into chunks of kChunk (128)
// consecutive ones (the last may be shorter). Each output element is
//
//     y = (((p_0 + p_1) + p_2) + ...)   with   p_c = fma(x[k_c + 127], w[k_c + 127], ... fma(x[k_c], w[k_c], 0))
//
// every partial sum p_c taken in k order with one rounding per fused multiply-add. Nothing in it
// depends on M, on the other rows of x, on how the work is split over threads or on which
// micro-kernel runs it, so a row's result is the same bit for bit whatever the batch it is in
// (batch invariance: a request's tokens do not depend on the requests beside it). oneDNN's
// blocking, by contrast, changes with M.
//
// Micro-kernels. A call computes `rows` (1..12) rows of x against one panel: 2 x rows AVX-512
// accumulators, the weights of each k loaded once and every x[i][k] broadcast. A full call has
// 12 rows (24 accumulators, 2 weight loads and 12 broadcasts per 24 FMAs). A few rows
// alone would leave the FMA units waiting on two or four accumulator chains, so for up to 6 rows
// several chunks of the same panel are summed at once (rows x chunks <= 12, each its own
// accumulators) and combined in chunk order afterwards, which gives the same sums as one chunk
// after the other. The weights are prefetched ahead (kPrefetchFromMemory, kPrefetchNear): for
// decode-sized batches they stream from memory once per step, and a prefetch as near as the
// next 16 k left the kernel waiting on the memory's latency. Batches of 65 rows or more take
// a thread's panels two at a time where it has two left: 6 rows a call against both panels'
// 64 columns (24 accumulators, 4 weight loads and 6 broadcasts per 24 FMAs), 1.02-1.09x the
// 12-row calls at 80-2,048 rows on a Zen 4 and on par with oneDNN there; the same sums.
//
// A panel alone for 13-144 rows (2-12 calls; decode-sized batches) runs chunk by chunk: every call
// on one chunk of the panel before the next chunk, the same sums in the same order. The next chunk
// is prefetched meanwhile in as many parts as there are calls, one part a call, one cache line a k
// step, so that the panel's stream from memory runs at an even rate while all the calls compute
// (when the first call prefetched it all, at twice the rate memory gave, the FMA units waited on
// memory and the time was near the sum of the two, not the larger).
//
// Work split. Rows are taken in passes of at most 240, evened out (so the pass's x stays in
// the L3 cache while the panels go by, each panel in L2 for all of its rows; 512 rows make 3
// passes of 171, where 240 + 240 + 32 streamed every panel from memory once more for 32 rows)
// and, within one, the panels are split over ATen's OpenMP threads
// (at::parallel_for, so torch.set_num_threads applies); each thread's panels stream from memory
// once. The Python wrapper is kernels/cpu/gemm.py; engine/layers/cpu_gemm.py uses it for every
// float32 linear layer on an AVX-512 CPU.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "silu.h"
#include "x86.h"

namespace {

constexpr int64_t kPanel = 32;             // output features per panel
constexpr int kVecs = kPanel / 16;         // AVX-512 vectors per panel row
constexpr int64_t kChunk = 128;            // input features per partial sum (the summation order)
constexpr int64_t kRowChunk = 240;         // most rows of x in one pass over the panels
// k steps ahead the weights are prefetched. A panel's first call streams it from memory: one
// chunk at a time (more than kMaxRows / 2 rows) looks 128 k (16 KiB) ahead, which covers the
// memory's latency at its bandwidth (1.15-1.2x at 16-64 rows against 16 k ahead); several chunks
// at once, each 16 k ahead (farther, each would fetch what the next chunk's stream is reading).
// Later calls find the panel in L2 and look 16 k ahead. The prefetches go to L2 (T1), where L1's
// own prefetcher takes the panel's sequential stream on: on an Intel Xeon (Emerald Rapids, a
// VM reading memory at 11 GB/s a core) prefetches into L1 (T0) held the L1 miss buffers and the
// decode-sized batches waited on memory (16-256 rows 1.04-1.15x faster in L2, 2,048 rows and
// 1-4 rows the same; benchmarks in docs/benchmarks.md).
constexpr int64_t kPrefetchFromMemory = 128;
constexpr int64_t kPrefetchNear = 16;
constexpr int kMaxAcc = 24;                // accumulator registers per call
constexpr int kMaxRows = kMaxAcc / kVecs;  // rows per micro-kernel call (12)
constexpr int kMaxChains = kMaxRows;       // rows x concurrent chunks per call
// From 2 up to this many calls a panel (13-144 rows) run chunk by chunk (interleaved_panel):
// 1.1-1.3x at 24-64 rows, 1.06x at 96-128 against a call at a time; at 20 calls (240 rows) a
// chunk's x rows no longer stay near and a call at a time is faster (7%).
constexpr int64_t kMaxInterleavedCalls = 12;
// Batches of at least this many rows take a thread's panels two at a time (kPairRows rows a
// call against 64 columns): 1.02-1.09x at 80-2,048 rows on a Zen 4, where a call's 12
// broadcasts of x against 2 weight loads kept the load ports busier than 6 against 4; at 32-64
// rows the panel chunk by chunk is as fast or faster (1.03x at 32).
constexpr int64_t kMinPairRows = 65;
constexpr int kPairRows = kMaxAcc / (2 * kVecs);  // rows per call on two panels (6)

bool cpu_supported() {
#if KVPILOT_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#if KVPILOT_X86

// Chunks [first_chunk, first_chunk + CH) of one panel (or of PANELS adjacent ones, each
// ldx * kPanel floats from the last: x's rows are K apart and a panel is [K][32]; 32 x PANELS
// columns of y) for ROWS rows of x: their partial sums
// (`len` input features each; CH > 1 only for whole chunks), added in chunk order to y, or
// stored as the start of it when `first` (first_chunk is chunk 0). `cols` of the 32 are
// written. Several chunks at once (CH > 1) only for up to kMaxRows / 2 rows. With RUN, the
// `len` features from k0 are any number of chunks, one after the other in this one call (a
// call a chunk cost 2.5-4% at prefill sizes in calls and write-backs). The weights are
// prefetched `prefetch` k steps beyond each k step read (both of its cache lines), or, with
// SPREAD, one line a k step from `spread` on, `stride` (<= 64) bytes apart.
template <int ROWS, int CH, bool RUN = false, bool SPREAD = false, int PANELS = 1>
__attribute__((target("avx512f,fma"))) void chunk_group(const float* __restrict x, int64_t ldx,
                                                         const float* __restrict panel,
                                                         int64_t k0, int64_t len,
                                                         float* __restrict y, int64_t ldy,
                                                         int cols, bool first, int64_t prefetch,
                                                         const char* spread, int64_t stride) {
  static_assert(!RUN || CH == 1, "a run is one chunk at a time");
  static_assert(!SPREAD || (CH == 1 && !RUN), "a spread prefetch is for one chunk");
  static_assert(PANELS == 1 || RUN, "several panels at once are a run");
  constexpr int kVecsHere = kVecs * PANELS;
  static_assert(CH * ROWS * kVecsHere <= kMaxAcc, "more accumulators than registers");
  __m512 acc[CH][ROWS][kVecsHere];
  const int64_t ahead = prefetch * kPanel, panel_stride = ldx * kPanel;
  __mmask16 mask[kVecsHere];
#pragma GCC unroll 4
  for (int v = 0; v < kVecsHere; ++v) {
    const int n = std::clamp(cols - 16 * v, 0, 16);
    mask[v] = n == 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  }
  for (int64_t start = 0; start < (RUN ? len : 1); start += kChunk) {
    const int64_t n = RUN ? std::min(kChunk, len - start) : len;
#pragma GCC unroll 16
    for (int h = 0; h < CH; ++h) {
#pragma GCC unroll 16
      for (int i = 0; i < ROWS; ++i) {
#pragma GCC unroll 4
        for (int v = 0; v < kVecsHere; ++v) acc[h][i][v] = _mm512_setzero_ps();
      }
    }
#pragma GCC unroll 2
    for (int64_t k = 0; k < n; ++k) {
#pragma GCC unroll 16
      for (int h = 0; h < CH; ++h) {
        const int64_t kk = k0 + start + h * kChunk + k;
        __m512 wv[kVecsHere];
        if constexpr (SPREAD) _mm_prefetch(spread + k * stride, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int v = 0; v < kVecsHere; ++v) {
          const float* w = panel + (v / kVecs) * panel_stride + kk * kPanel + 16 * (v % kVecs);
          if constexpr (!SPREAD) {
            _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T1);
          }
          wv[v] = _mm512_loadu_ps(w);
        }
#pragma GCC unroll 16
        for (int i = 0; i < ROWS; ++i) {
          const __m512 a = _mm512_set1_ps(x[i * ldx + kk]);
#pragma GCC unroll 4
          for (int v = 0; v < kVecsHere; ++v) {
            acc[h][i][v] = _mm512_fmadd_ps(a, wv[v], acc[h][i][v]);
          }
        }
      }
    }
    const bool store = first && start == 0;
#pragma GCC unroll 16
    for (int i = 0; i < ROWS; ++i) {
#pragma GCC unroll 4
      for (int v = 0; v < kVecsHere; ++v) {
        float* out = y + i * ldy + 16 * v;
        __m512 sum = acc[0][i][v];
        if (!store) sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], out), sum);
#pragma GCC unroll 16
        for (int h = 1; h < CH; ++h) sum = _mm512_add_ps(sum, acc[h][i][v]);
        _mm512_mask_storeu_ps(out, mask[v], sum);
      }
    }
  }
}

using ChunkGroup = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*,
                            int64_t, int, bool, int64_t, const char*, int64_t);

template <int ROWS, int CH>
constexpr ChunkGroup group_or_null() {
  if constexpr (ROWS * CH <= kMaxChains && (CH == 1 || 2 * ROWS <= kMaxRows)) {
    return &chunk_group<ROWS, CH>;
  } else {
    return nullptr;
  }
}

template <int ROWS, int... CH>
constexpr std::array<ChunkGroup, kMaxChains> groups_of(std::integer_sequence<int, CH...>) {
  return {group_or_null<ROWS, CH + 1>()...};
}

template <int... ROWS>
constexpr std::array<std::array<ChunkGroup, kMaxChains>, kMaxRows> group_table(
    std::integer_sequence<int, ROWS...>) {
  return {groups_of<ROWS + 1>(std::make_integer_sequence<int, kMaxChains>{})...};
}

// kRuns[rows - 1]: all of a panel's chunks in one call, one after the other.
template <int... ROWS>
constexpr std::array<ChunkGroup, kMaxRows> run_table(std::integer_sequence<int, ROWS...>) {
  return {&chunk_group<ROWS + 1, 1, true>...};
}
constexpr auto kRuns = run_table(std::make_integer_sequence<int, kMaxRows>{});

// kPairRuns[rows - 1]: a run on two adjacent panels.
template <int... ROWS>
constexpr std::array<ChunkGroup, kPairRows> pair_run_table(std::integer_sequence<int, ROWS...>) {
  return {&chunk_group<ROWS + 1, 1, true, false, 2>...};
}
constexpr auto kPairRuns = pair_run_table(std::make_integer_sequence<int, kPairRows>{});

// kSpread[rows - 1]: one chunk, its prefetch spread (interleaved_panel).
template <int... ROWS>
constexpr std::array<ChunkGroup, kMaxRows> spread_table(std::integer_sequence<int, ROWS...>) {
  return {&chunk_group<ROWS + 1, 1, false, true>...};
}
constexpr auto kSpread = spread_table(std::make_integer_sequence<int, kMaxRows>{});

// kGroups[rows - 1][chunks - 1]: null where rows x chunks > 12, or chunks > 1 with rows > 6.
constexpr auto kGroups = group_table(std::make_integer_sequence<int, kMaxRows>{});

// y[rows, cols] of one panel: every chunk, several at once where the rows are few; the weights
// are prefetched `prefetch` k steps ahead.
void panel_rows(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int rows,
                int cols, int64_t prefetch) {
  const int64_t at_once = 2 * rows <= kMaxRows ? kMaxChains / rows : 1;
  if (at_once == 1) {
    kRuns[rows - 1](x, K, panel, 0, K, y, ldy, cols, true, prefetch, nullptr, 0);
    return;
  }
  const int64_t num_chunks = (K + kChunk - 1) / kChunk, whole = K / kChunk;
  int64_t c = 0;
  while (c < whole) {
    const int64_t n = std::min(at_once, whole - c);
    kGroups[rows - 1][n - 1](x, K, panel, c * kChunk, kChunk, y, ldy, cols, c == 0,
                             prefetch, nullptr, 0);
    c += n;
  }
  if (c < num_chunks) {
    kGroups[rows - 1][0](x, K, panel, c * kChunk, K - c * kChunk, y, ldy, cols, c == 0,
                         prefetch, nullptr, 0);
  }
}

// Rows of the next call: the rows left spread evenly over the calls left (no call of one or
// two rows).
int rows_of_call(int64_t rows_left, int64_t calls_left) {
  return static_cast<int>((rows_left + calls_left - 1) / calls_left);
}

// y[rows, cols] of one panel in `calls` calls of at most kMaxRows rows, chunk by chunk: every
// call on a chunk (16 KiB of weights, then in L1) before the next chunk. The 16 KiB after the
// chunk (the next one, or after a panel's last the next panel's first) are prefetched in
// `calls` parts, the i-th by the i-th call, one line a k step (a short last chunk covers what
// 64 bytes a step reach; the hardware's prefetcher the rest). The same chunk partial sums
// added in the same order as panel_rows.
void interleaved_panel(const float* x, int64_t K, const float* panel, float* y, int64_t ldy,
                       int64_t rows, int64_t calls, int cols) {
  const int64_t num_chunks = (K + kChunk - 1) / kChunk;
  const int64_t part = (kChunk * kPanel * static_cast<int64_t>(sizeof(float)) + calls - 1) / calls;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t len = std::min(kChunk, K - c * kChunk);
    const char* next = reinterpret_cast<const char*>(panel + (c * kChunk + len) * kPanel);
    const int64_t stride = std::min<int64_t>(64, (part + len - 1) / len);
    int64_t m = 0;
    for (int64_t call = 0; call < calls; ++call) {
      const int n = rows_of_call(rows - m, calls - call);
      kSpread[n - 1](x + m * K, K, panel, c * kChunk, len, y + m * ldy, ldy, cols, c == 0,
                     0, next + call * part, stride);
      m += n;
    }
  }
}

#endif  // KVPILOT_X86

void check(bool ok, const std::string& message) { TORCH_CHECK(ok, "kvpilot cpu gemm: ", message); }

}  // namespace

bool supported() { return cpu_supported(); }

// Row of W that column j of panel p holds: panel p's rows in order, or, gated, the 16 gate rows
// from 16p and the 16 up rows from d + 16p (d = N / 2); -1 for a zero (padding).
int64_t packed_row(int64_t p, int64_t j, int64_t N, bool gated) {
  if (!gated) return p * kPanel + j < N ? p * kPanel + j : -1;
  const int64_t d = N / 2, half = kPanel / 2, at = p * half + j % half;
  return at < d ? at + (j < half ? 0 : d) : -1;
}

void pack_weight(const torch::Tensor& weight, torch::Tensor packed, bool gated) {
  check(weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 && weight.dim() == 2,
        "the weight must be a 2-D float32 CPU tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  check(!gated || N % 2 == 0, "a gated weight stacks gate and up: an even number of rows");
  const int64_t panels = (N + kPanel - 1) / kPanel;  // gated too: ceil(N / 2 / 16), N even
  check(packed.dim() == 3 && packed.size(0) == panels && packed.size(1) == K &&
            packed.size(2) == kPanel && packed.is_contiguous() &&
            packed.scalar_type() == torch::kFloat32 && packed.device().is_cpu(),
        "the packed tensor must be a contiguous float32 [ceil(N / 32), K, 32] CPU tensor");
  const auto dense = weight.contiguous();
  const float* src = dense.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t rows[kPanel];
      for (int64_t j = 0; j < kPanel; ++j) rows[j] = packed_row(p, j, N, gated);
      for (int64_t k = 0; k < K; ++k) {
        float* out = dst + (p * K + k) * kPanel;
        for (int64_t j = 0; j < kPanel; ++j) out[j] = rows[j] < 0 ? 0.0f : src[rows[j] * K + k];
      }
    }
  });
}

// What packed_linear writes: W x (a plain or a gated packing; gated, y is [gate | up] as the
// unpacked weight would give it), or silu(gate) * up (gated only; SwiGLU, Shazeer 2020).
enum Output : int64_t { kLinear = 0, kSiluAndMul = 1 };

#if KVPILOT_X86
// y[rows, cols] (ldy apart) of one panel, or of two adjacent ones (`panels`), for `rows` rows
// of x: one panel chunk by chunk in 2-12 calls, or call after call; two panels call after call,
// kPairRows rows a call, the first streaming them from memory.
void panel_product(const float* x, int64_t K, const float* panel, float* y, int64_t ldy,
                   int64_t rows, int cols, int64_t panels) {
  const int64_t most = panels == 2 ? kPairRows : kMaxRows;
  const int64_t calls = (rows + most - 1) / most;
  if (panels == 1 && calls > 1 && calls <= kMaxInterleavedCalls) {
    interleaved_panel(x, K, panel, y, ldy, rows, calls, cols);
    return;
  }
  int64_t m = 0;
  for (int64_t call = 0; call < calls; ++call) {
    const int n = rows_of_call(rows - m, calls - call);
    const bool far = call == 0 && (panels == 2 || 2 * n > kMaxRows);
    const int64_t prefetch = far ? kPrefetchFromMemory : kPrefetchNear;
    if (panels == 2) {
      kPairRuns[n - 1](x + m * K, K, panel, 0, K, y + m * ldy, ldy, cols, true, prefetch,
                       nullptr, 0);
    } else {
      panel_rows(x + m * K, K, panel, y + m * ldy, ldy, n, cols, prefetch);
    }
    m += n;
  }
}

// A gated panel's products, s[rows, 32] (lds apart; 16 gate columns, then their 16 up columns),
// into the output: y[rows, 2d] as [gate | up], or y[rows, d] = silu(gate) * up (ldy apart),
// columns c0 to c0 + n, n <= 16; silu's vector part is the first `vector_count` of a row of d.
void gated_epilogue(const float* s, int64_t lds, float* y, int64_t ldy, int64_t rows, int64_t d,
                    int64_t c0, int64_t n, Output output, int64_t vector_count,
                    kvpilot_silu::Vector v) {
  constexpr int64_t half = kPanel / 2;
  const int64_t vectors = std::clamp<int64_t>(vector_count - c0, 0, n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = s + r * lds;
    float* out = y + r * ldy + c0;
    if (output == kSiluAndMul) {
      kvpilot_silu::silu_floats(gate, gate + half, out, n, vectors, v);
    } else {
      std::copy(gate, gate + n, out);
      std::copy(gate + half, gate + half + n, out + d);
    }
  }
}
#endif

void packed_linear(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& packed,
                   int64_t N, bool gated, int64_t output) {
  check(cpu_supported(), "this CPU has no AVX-512");
  check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
            x.device().is_cpu(),
        "x must be a contiguous [M, K] float32 CPU tensor");
  check(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kPanel &&
            packed.scalar_type() == torch::kFloat32,
        "the packed weight must come from pack_weight");
  check(output == kLinear || (output == kSiluAndMul && gated),
        "silu_and_mul needs a gated packing");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  check(packed.size(1) == K, "x has " + std::to_string(K) + " features, the weight " +
                                 std::to_string(packed.size(1)));
  check((!gated || N % 2 == 0) && N > (panels - 1) * kPanel && N <= panels * kPanel,
        "out_features " + std::to_string(N) + " does not match the packed weight");
  const int64_t d = N / 2;  // gated: the gate's (and the up's) features
  const int64_t width = output == kSiluAndMul ? d : N;
  check(y.dim() == 2 && y.size(0) == M && y.size(1) == width && y.is_contiguous() &&
            y.scalar_type() == torch::kFloat32,
        "y must be a contiguous [M, " + std::to_string(width) + "] float32 tensor");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    y.zero_();
    return;
  }
#if KVPILOT_X86
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const kvpilot_silu::Vector v = kvpilot_silu::torch_vector();
  const int64_t vector_count = kvpilot_silu::vectorized(d, v, sizeof(float));
  const int64_t passes = (M + kRowChunk - 1) / kRowChunk;
  const int64_t pass_rows = (M + passes - 1) / passes;
  for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
    const int64_t rows_here = std::min(pass_rows, M - m0);
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      // A gated panel's (or pair's) products wait here (<= 60 KiB, in L2) for the epilogue:
      // one buffer a thread, kept between calls (every element read is written first).
      thread_local std::vector<float> s;
      const auto size = static_cast<size_t>(gated ? rows_here * 2 * kPanel : 0);
      if (s.size() < size) s.resize(size);
      for (int64_t p = p0; p < p1;) {
        const int64_t panels_here = rows_here >= kMinPairRows && p + 1 < p1 ? 2 : 1;
        const float* panel = wp + p * K * kPanel;
        const float* xm = xp + m0 * K;
        if (!gated) {
          const int cols = static_cast<int>(std::min(panels_here * kPanel, N - p * kPanel));
          panel_product(xm, K, panel, yp + m0 * N + p * kPanel, N, rows_here, cols, panels_here);
        } else {
          const int64_t lds = panels_here * kPanel;
          panel_product(xm, K, panel, s.data(), lds, rows_here, static_cast<int>(lds),
                        panels_here);
          for (int64_t q = 0; q < panels_here; ++q) {
            const int64_t c0 = (p + q) * (kPanel / 2);
            gated_epilogue(s.data() + q * kPanel, lds, yp + m0 * width, width, rows_here, d, c0,
                           std::min(kPanel / 2, d - c0), static_cast<Output>(output),
                           vector_count, v);
          }
        }
        p += panels_here;
      }
    });
  }
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "Whether this CPU runs the kernel (AVX-512F and FMA).");
  m.def("pack_weight", &pack_weight,
        "W[N, K] -> panels [ceil(N / 32), K, 32], or gated (W = [gate; up]) [ceil(N / 32), K, "
        "32] of 16 gate and their 16 up rows (every element written; zero-padded).",
        py::arg("weight"), py::arg("packed"), py::arg("gated") = false);
  m.def("packed_linear", &packed_linear,
        "y[M, N] = x[M, K] W^T with W packed (float32), or y[M, N / 2] = silu(gate) * up "
        "(output 1, gated packing).",
        py::arg("y"), py::arg("x"), py::arg("packed"), py::arg("N"), py::arg("gated") = false,
        py::arg("output") = 0);
}
