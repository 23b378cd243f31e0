// Float32 linear for the few rows of a decode step: y[M, N] = x[M, K] W[N, K]^T + b, reading W in the model's
// own row-major layout (the weight tensor itself: nothing repacked, nothing copied).
//
// Why: at one row a float32 linear only streams its weight from memory, and MKL's sgemm/sgemv does that at a
// third of the memory's speed on some hosts (AMD Zen 4: 10-12 GB/s where a plain sum reads ~30;
// docs/benchmarks.md, "float32 on the AMD host"). Here each thread takes a range of output rows, in blocks of
// several rows; for each block the x rows (at most four at a time) are multiplied with the block's weight rows
// in one pass over K, so every weight byte is loaded once per four x rows.
//
// Order of the sums: per output, 16 (AVX-512) or 8 (AVX2) lanes of partial sums along K, a tail of K % lanes
// masked into them, then the lanes added. It is not MKL's order, so results differ from torch's in the last
// bits (kernels/float_linear.py says what that means for greedy output). Paths chosen per function at run time
// by target attributes, as in qgemm.cpp: AVX-512F where the kernels' ISA is avx512vnni, else AVX2 + FMA.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qgemm.h"
#include "simd.h"

namespace {

constexpr int kMaxRows = 4;  // x rows per pass over the weight
constexpr int kTask = 48;    // weight rows per unit of the threads' split (a multiple of every block below)
constexpr int64_t kGrainBytes = 64 << 10;  // weight bytes per parallel task at least

// y[m][n0 + r] for M x rows and R weight rows from n0: one pass over K, every weight vector used M times.
template <int M, int R>
__attribute__((target("avx512f")))
void block_avx512(const float* x, const float* w, int64_t k, int64_t n0, float* y, int64_t ldy,
                  const float* bias) {
  const int64_t kv = k / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - kv)) - 1);
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kv; i += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + (n0 + r) * k + i);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  if (tail) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, x + m * k + kv);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, w + (n0 + r) * k + kv);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}

template <int M, int R>
__attribute__((target("avx2,fma")))
void block_avx2(const float* x, const float* w, int64_t k, int64_t n0, float* y, int64_t ldy, const float* bias) {
  const int64_t kv = k / 8 * 8;
  alignas(32) int32_t lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = j < k - kv ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < kv; i += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_loadu_ps(x + m * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(w + (n0 + r) * k + i);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  if (k > kv) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm256_maskload_ps(x + m * k + kv, tail);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(w + (n0 + r) * k + kv, tail);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm256_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * ldy + n0 + r] = ringserve_cpu::hsum_avx2(acc[m][r]) + (bias ? bias[n0 + r] : 0.0f);
}

// Weight rows per block for M x rows: as many as the vector registers hold as accumulators (M x R of them, plus
// the x rows and a weight vector: 32 registers with AVX-512, 16 with AVX2). Each block row is another stream of
// loads in flight, and more streams read the memory faster: at one row R = 16 reads ~33 GB/s on two Zen 4
// threads where R = 4 read ~21 (bench/fp32_gemv.py).
template <int M>
constexpr int kRowsAvx512 = M == 1 ? 16 : M <= 3 ? 8 : 6;
template <int M>
constexpr int kRowsAvx2 = M == 1 ? 8 : M == 2 ? 4 : 2;

// Weight rows [n0, n1) for M x rows: whole blocks, then the rest one row at a time.
template <int M, int R, bool AVX512>
void rows_range_isa(const float* x, const float* w, int64_t k, int64_t n0, int64_t n1, float* y, int64_t ldy,
                    const float* bias) {
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    AVX512 ? block_avx512<M, R>(x, w, k, n, y, ldy, bias) : block_avx2<M, R>(x, w, k, n, y, ldy, bias);
  for (; n < n1; ++n)
    AVX512 ? block_avx512<M, 1>(x, w, k, n, y, ldy, bias) : block_avx2<M, 1>(x, w, k, n, y, ldy, bias);
}

template <int M>
void rows_range(const float* x, const float* w, int64_t k, int64_t n0, int64_t n1, float* y, int64_t ldy,
                const float* bias, bool avx512) {
  if (avx512)
    rows_range_isa<M, kRowsAvx512<M>, true>(x, w, k, n0, n1, y, ldy, bias);
  else
    rows_range_isa<M, kRowsAvx2<M>, false>(x, w, k, n0, n1, y, ldy, bias);
}

void rows_for(int64_t rows, const float* x, const float* w, int64_t k, int64_t n0, int64_t n1, float* y,
              int64_t ldy, const float* bias, bool avx512) {
  switch (rows) {
    case 1: rows_range<1>(x, w, k, n0, n1, y, ldy, bias, avx512); break;
    case 2: rows_range<2>(x, w, k, n0, n1, y, ldy, bias, avx512); break;
    case 3: rows_range<3>(x, w, k, n0, n1, y, ldy, bias, avx512); break;
    default: rows_range<4>(x, w, k, n0, n1, y, ldy, bias, avx512); break;
  }
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "f32_linear: x [M, K] and weight [N, K] expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "f32_linear: float32 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "f32_linear: contiguous x and weight expected");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "f32_linear: a contiguous float32 bias of ", n, " values expected");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const bool avx512 = ringserve_cpu::isa_is_avx512();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tasks = (n + kTask - 1) / kTask;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kTask * k * 4));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kTask, n1 = std::min(n, t1 * kTask);
    for (int64_t m0 = 0; m0 < m; m0 += kMaxRows)
      rows_for(std::min<int64_t>(kMaxRows, m - m0), xp + m0 * k, wp, k, n0, n1, yp + m0 * n, n, b, avx512);
  });
  return y;
}

}  // namespace

// The op's schema and fake implementation are defined in kernels/cpu/__init__.py, which registers the torch
// fallback instead when this library cannot be built.
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("f32_linear", &f32_linear); }
