// The GGUF block types whose scales are not fp16 per 32 weights (llama.cpp's K-quants Q4_K, Q5_K, Q6_K, and
// Q5_1's 5-bit codes with a min), run exactly as the file stores them: the "q8_k" form holds each weight's
// integer code as int8 (Q4_K 0..15, Q5_K/Q5_1 0..31, Q6_K -32..31), an fp32 scale per 16 weights (Q6_K's
// sub-blocks; the K-quants' 32-weight sub-blocks repeat theirs) and optionally an fp32 min per 32. A K-quant's
// scale is its fp16 super-block scale times a 6-bit sub-block scale, a product fp16 cannot hold exactly; fp32
// does. kernels/cpu/gguf_formats.py makes the codes from a file's bytes, packing.py packs them.
//
// Layout (the q8_0 layout of qgemm.cpp, codes signed): output rows in tiles of 16, per tile and K block of 32
// the 16 rows' codes four K values at a time, [tiles][K blocks][8 quads][16 rows][4] int8; scales fp32
// [tiles][K blocks][2 halves][16]; mins fp32 [tiles][K blocks][16]; wsums int32 [tiles][K blocks][2][16], each
// half's sum of codes (the VNNI path's correction, below).
//
// The activations are quantized per block of 32 to int8 as for every group kernel (qgemm.h), so a half's
// product is an exact integer dot product, rescaled by the half's weight scale and the block's activation
// scale; the min term is the min times the block's activation scale and sum. AVX-512 VNNI: vpdpbusd takes an
// unsigned and a signed operand; here the activations are the unsigned one (q + 128, a flipped sign bit) and
// the correction is -128 times the half's code sum, known at packing. AVX2: llama.cpp's sign trick, as qgemm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qgemm.h"

namespace {

constexpr int QK = ringserve_cpu::kQK;
constexpr int TILE = ringserve_cpu::kTile;
constexpr int MAXMB = 4;
constexpr int64_t BLOCK_BYTES = 512;  // 32 codes of 16 rows

struct KRef {
  const int8_t* w;
  const float* scales;
  const float* mins;  // or nullptr
  const int32_t* wsums;
  const float* bias;  // or nullptr
  int64_t out_features, kb, tiles;
};

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int MB, bool MIN>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
void tile_vnni(const KRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
               const float* bias) {
  const int8_t* w = p.w + t * p.kb * BLOCK_BYTES;
  const float* sc = p.scales + t * p.kb * 2 * TILE;
  const float* mn = MIN ? p.mins + t * p.kb * TILE : nullptr;
  const int32_t* ws = p.wsums + t * p.kb * 2 * TILE;
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const int8_t* wb = w + b * BLOCK_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 2048), _MM_HINT_T0);
    const __m512i corr0 = _mm512_mullo_epi32(_mm512_loadu_si512(ws + b * 2 * TILE), _mm512_set1_epi32(-128));
    const __m512i corr1 = _mm512_mullo_epi32(_mm512_loadu_si512(ws + b * 2 * TILE + TILE), _mm512_set1_epi32(-128));
    __m512i h0[MB], h1[MB];
    for (int m = 0; m < MB; ++m) h0[m] = corr0, h1[m] = corr1;
    for (int qd = 0; qd < 8; ++qd) {
      const __m512i wv = _mm512_loadu_si512(wb + qd * 64);
      for (int m = 0; m < MB; ++m) {
        const __m512i av = _mm512_xor_si512(_mm512_set1_epi32(quad(a.q + (m0 + m) * a.kp + b * QK + qd * 4)), flip);
        if (qd < 4) h0[m] = _mm512_dpbusd_epi32(h0[m], av, wv);
        else h1[m] = _mm512_dpbusd_epi32(h1[m], av, wv);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(sc + b * 2 * TILE), s1 = _mm512_loadu_ps(sc + b * 2 * TILE + TILE);
    __m512 mw;
    if constexpr (MIN) mw = _mm512_loadu_ps(mn + b * TILE);
    for (int m = 0; m < MB; ++m) {
      const __m512 da = _mm512_set1_ps(a.d[(m0 + m) * a.kb + b]);
      const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1[m]), s1, _mm512_mul_ps(_mm512_cvtepi32_ps(h0[m]), s0));
      acc[m] = _mm512_fmadd_ps(part, da, acc[m]);
      if constexpr (MIN)
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.d[(m0 + m) * a.kb + b] * (float)a.s[(m0 + m) * a.kb + b]),
                                 acc[m]);
    }
  }
  const __mmask16 mask = nvalid >= TILE ? 0xffff : (__mmask16)((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * p.out_features, mask, _mm512_add_ps(acc[m], bv));
}

// 8 of the tile's 16 rows (`h` the half of the tile), llama.cpp's sign trick: |w| x (a * sign(w)).
template <int MB, bool MIN>
__attribute__((target("avx2,fma")))
void half_avx2(const KRef& p, int64_t t, int h, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
               const float* bias) {
  const int8_t* w = p.w + t * p.kb * BLOCK_BYTES + h * 32;
  const float* sc = p.scales + t * p.kb * 2 * TILE + h * 8;
  const float* mn = MIN ? p.mins + t * p.kb * TILE + h * 8 : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const int8_t* wb = w + b * BLOCK_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(wb + 2048), _MM_HINT_T0);
    __m256i h0[MB], h1[MB];
    for (int m = 0; m < MB; ++m) h0[m] = h1[m] = _mm256_setzero_si256();
    for (int qd = 0; qd < 8; ++qd) {
      const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + qd * 64));
      const __m256i wa = _mm256_abs_epi8(ws);
      for (int m = 0; m < MB; ++m) {
        const __m256i av = _mm256_set1_epi32(quad(a.q + (m0 + m) * a.kp + b * QK + qd * 4));
        const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(av, ws)), ones);
        if (qd < 4) h0[m] = _mm256_add_epi32(h0[m], prod);
        else h1[m] = _mm256_add_epi32(h1[m], prod);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(sc + b * 2 * TILE), s1 = _mm256_loadu_ps(sc + b * 2 * TILE + TILE);
    __m256 mw;
    if constexpr (MIN) mw = _mm256_loadu_ps(mn + b * TILE);
    for (int m = 0; m < MB; ++m) {
      const float d = a.d[(m0 + m) * a.kb + b];
      const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1[m]), s1, _mm256_mul_ps(_mm256_cvtepi32_ps(h0[m]), s0));
      acc[m] = _mm256_fmadd_ps(part, _mm256_set1_ps(d), acc[m]);
      if constexpr (MIN) acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(d * (float)a.s[(m0 + m) * a.kb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[m]);
    float* dst = y + (m0 + m) * p.out_features;
    for (int j = 0; j < nvalid; ++j) dst[j] = out[j] + (bias ? bias[j] : 0.0f);
  }
}

// One activation row, the whole 16-row tile in one pass over K: half_avx2<1, MIN>'s per-row arithmetic (exact
// integer half-block sums, then the same float operations in the same order), each activation quad broadcast
// and sign-applied once per pair of weight vectors, each block prefetched once.
template <bool MIN>
__attribute__((target("avx2,fma")))
void tile1_avx2(const KRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
                const float* bias) {
  const int8_t* w = p.w + t * p.kb * BLOCK_BYTES;
  const float* sc = p.scales + t * p.kb * 2 * TILE;
  const float* mn = MIN ? p.mins + t * p.kb * TILE : nullptr;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* aq_row = a.q + m0 * a.kp;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const int8_t* wb = w + b * BLOCK_BYTES;
    for (int64_t line = 0; line < BLOCK_BYTES; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2048 + line), _MM_HINT_T0);
    __m256i h[2][2];  // [rows 0-7, 8-15][first, second half block]
    for (int r = 0; r < 2; ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
    for (int qd = 0; qd < 8; ++qd) {
      const __m256i av = _mm256_set1_epi32(quad(aq_row + b * QK + qd * 4));
      for (int r = 0; r < 2; ++r) {
        const __m256i ws = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + qd * 64 + r * 32));
        const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(ws), _mm256_sign_epi8(av, ws)),
                                               ones);
        h[r][qd / 4] = _mm256_add_epi32(h[r][qd / 4], prod);
      }
    }
    const float d = a.d[m0 * a.kb + b];
    const float* sb = sc + b * 2 * TILE;
    const __m256 part0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[0][1]), _mm256_loadu_ps(sb + TILE),
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(h[0][0]), _mm256_loadu_ps(sb)));
    const __m256 part1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[1][1]), _mm256_loadu_ps(sb + TILE + 8),
                                         _mm256_mul_ps(_mm256_cvtepi32_ps(h[1][0]), _mm256_loadu_ps(sb + 8)));
    acc0 = _mm256_fmadd_ps(part0, _mm256_set1_ps(d), acc0);
    acc1 = _mm256_fmadd_ps(part1, _mm256_set1_ps(d), acc1);
    if constexpr (MIN) {
      const __m256 dm = _mm256_set1_ps(d * (float)a.s[m0 * a.kb + b]);
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b * TILE), dm, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(mn + b * TILE + 8), dm, acc1);
    }
  }
  alignas(32) float out[TILE];
  _mm256_store_ps(out, acc0);
  _mm256_store_ps(out + 8, acc1);
  float* dst = y + m0 * p.out_features;
  for (int j = 0; j < nvalid; ++j) dst[j] = out[j] + (bias ? bias[j] : 0.0f);
}

template <int MB, bool MIN>
void tile(const KRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
          const float* bias) {
  if (ringserve_cpu::isa_is_avx512()) {
    tile_vnni<MB, MIN>(p, t, a, m0, y, nvalid, bias);
    return;
  }
  if constexpr (MB == 1) {
    tile1_avx2<MIN>(p, t, a, m0, y, nvalid, bias);
    return;
  }
  for (int h = 0; h < 2 && h * 8 < nvalid; ++h)
    half_avx2<MB, MIN>(p, t, h, a, m0, y + h * 8, std::min(8, nvalid - h * 8), bias ? bias + h * 8 : nullptr);
}

template <bool MIN>
void tile_rows(const KRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, int mb, float* y, int nvalid,
               const float* bias) {
  switch (mb) {
    case 1: tile<1, MIN>(p, t, a, m0, y, nvalid, bias); break;
    case 2: tile<2, MIN>(p, t, a, m0, y, nvalid, bias); break;
    case 3: tile<3, MIN>(p, t, a, m0, y, nvalid, bias); break;
    default: tile<4, MIN>(p, t, a, m0, y, nvalid, bias); break;
  }
}

// y[M, N] = x[M, K] W^T (+ bias) for a weight in the q8_k form above.
at::Tensor k8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, const at::Tensor& wsums,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const int64_t kb = (k + QK - 1) / QK, tiles = (out_features + TILE - 1) / TILE;
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kChar && qweight.numel() == tiles * kb * BLOCK_BYTES,
              "qweight does not match out_features and K");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == tiles * kb * 2 * TILE,
              "bad scales");
  TORCH_CHECK(wsums.is_contiguous() && wsums.scalar_type() == at::kInt && wsums.numel() == tiles * kb * 2 * TILE,
              "bad wsums");
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_min || (mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->numel() == tiles * kb * TILE),
              "bad mins");
  const at::Tensor bias_c = bias.has_value() && bias->defined() ? bias->contiguous().to(at::kFloat) : at::Tensor();
  TORCH_CHECK(!bias_c.defined() || bias_c.numel() == out_features, "bias must have out_features values");
  const KRef p{qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), has_min ? mins->data_ptr<float>() : nullptr,
               wsums.data_ptr<int32_t>(), bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, out_features, kb,
               tiles};
  at::Tensor y = at::empty({m, out_features}, xc.options());
  if (m == 0 || out_features == 0) return y;
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> da;
  thread_local std::vector<int32_t> sa;
  const int64_t kp = kb * QK;
  if ((int64_t)qa.size() < m * kp) qa.resize(m * kp);
  if ((int64_t)da.size() < m * kb) da.resize(m * kb), sa.resize(m * kb);
  const float* xp = xc.data_ptr<float>();
  // the calling thread's scratch: a worker thread naming `qa` would reach its own (empty) thread_local
  int8_t* qp = qa.data();
  float* dp = da.data();
  int32_t* sp = sa.data();
  at::parallel_for(0, m, m * k >= (1 << 16) ? 1 : m, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ringserve_cpu::quantize_row_blocks(xp + r * k, k, 0, kb, qp + r * kp, dp + r * kb, sp + r * kb);
  });
  const ringserve_cpu::QuantRows a{qp, dp, sp, kp, kb};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int nvalid = (int)std::min<int64_t>(TILE, out_features - t * TILE);
      const float* bt = p.bias ? p.bias + t * TILE : nullptr;
      for (int64_t m0 = 0; m0 < m; m0 += MAXMB) {
        const int mb = (int)std::min<int64_t>(MAXMB, m - m0);
        if (p.mins) tile_rows<true>(p, t, a, m0, mb, yp + t * TILE, nvalid, bt);
        else tile_rows<false>(p, t, a, m0, mb, yp + t * TILE, nvalid, bt);
      }
    }
  });
  return y;
}

}  // namespace

// The op's schema and fake are defined in kernels/cpu/__init__.py (which registers the torch fallback instead
// when this library cannot be built).
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("k8_linear", &k8_linear); }
