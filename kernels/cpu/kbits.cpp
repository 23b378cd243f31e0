// GGUF's 4-, 5- and 6-bit block types at (nearly) their own size: the "q4_k", "q5_k" and "q6_k" forms hold each
// weight's unsigned integer code in 4, 5 or 6 bits, an fp32 scale per 32 weights (per 16 for 6 bits) and
// optionally an fp32 min per 32: w = scale * (code - offset) + min, offset 32 for 6 bits (Q6_K's codes are
// -32..31) and 0 otherwise. Q4_K/Q5_K's scale d * sc and min -dmin * m, Q5_1's d and m, Q5_0's d and -16 d, Q6_K's
// d * sc are each exact in fp32; kernels/cpu/gguf_formats.py makes the codes, packing_kbits.py packs them.
//
// Layout: output rows in tiles of 16 as in qgemm.cpp; per tile and K block of 32, 64 * bits bytes: the 32 codes'
// low nibbles in the q4 layout ([4 vectors][16 rows][4]; low nibbles quads 0-3, high nibbles quads 4-7), then one
// 64-byte plane per further bit, bit i of byte j of a plane the bit of quad i's byte j. Scales fp32
// [tiles][K blocks][16] ([tiles][K blocks][2 halves][16] for 6 bits), mins fp32 [tiles][K blocks][16].
//
// Activations are quantized per block of 32 as for every group kernel (qgemm.h). The codes are unsigned, so
// they are vpdpbusd's unsigned operand (vpmaddubsw's on AVX2) as q4_1's are; the 6-bit offset is -32 times the
// activations' sum over each half block, computed once per call.

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

struct BitsRef {
  const uint8_t* w;
  const float* scales;
  const float* mins;  // or nullptr
  const int32_t* half_sums;  // activation sums per 16, [M][K blocks][2] (6 bits only)
  int64_t out_features, kb, block_bytes;
};

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Quads i and i + 4 of the codes: the nibbles of `raw` with bit `i` (and `i + 4`) of the planes above them.
template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void codes_vnni(const uint8_t* wb, int p, __m512i& lo,
                                                                            __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i raw = _mm512_loadu_si512(wb + p * 64);
  lo = _mm512_and_si512(raw, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
  if constexpr (BITS >= 5) {
    const __m512i h = _mm512_loadu_si512(wb + 256);  // bit p of a byte -> bit 4; bit p + 4 -> bit 4
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 4 - p), _mm512_set1_epi8(0x10)));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(h, p), _mm512_set1_epi8(0x10)));
  }
  if constexpr (BITS == 6) {
    const __m512i h = _mm512_loadu_si512(wb + 320);  // bit p -> bit 5
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(h, 5 - p), _mm512_set1_epi8(0x20)));
    const __m512i up = p == 0 ? _mm512_slli_epi16(h, 1) : _mm512_srli_epi16(h, p - 1);  // bit p + 4 -> bit 5
    hi = _mm512_or_si512(hi, _mm512_and_si512(up, _mm512_set1_epi8(0x20)));
  }
}

template <int BITS>
__attribute__((target("avx2"))) inline void codes_avx2(const uint8_t* wb, int p, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
  lo = _mm256_and_si256(raw, low4);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
  if constexpr (BITS >= 5) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4 - p), _mm256_set1_epi8(0x10)));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(h, p), _mm256_set1_epi8(0x10)));
  }
  if constexpr (BITS == 6) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 320));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 5 - p), _mm256_set1_epi8(0x20)));
    const __m256i up = p == 0 ? _mm256_slli_epi16(h, 1) : _mm256_srli_epi16(h, p - 1);
    hi = _mm256_or_si256(hi, _mm256_and_si256(up, _mm256_set1_epi8(0x20)));
  }
}

template <int BITS, int MB, bool MIN>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
void tile_vnni(const BitsRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
               const float* bias) {
  constexpr int SC = BITS == 6 ? 2 * TILE : TILE;
  const uint8_t* w = p.w + t * p.kb * p.block_bytes;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* wb = w + b * p.block_bytes;
    for (int64_t line = 0; line < p.block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2048 + line), _MM_HINT_T0);
    __m512i h0[MB], h1[MB];
    for (int m = 0; m < MB; ++m) h0[m] = h1[m] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
      __m512i lo, hi;
      codes_vnni<BITS>(wb, q, lo, hi);
      for (int m = 0; m < MB; ++m) {
        const int8_t* aq = a.q + (m0 + m) * a.kp + b * QK;
        h0[m] = _mm512_dpbusd_epi32(h0[m], lo, _mm512_set1_epi32(quad(aq + q * 4)));
        h1[m] = _mm512_dpbusd_epi32(h1[m], hi, _mm512_set1_epi32(quad(aq + (q + 4) * 4)));
      }
    }
    const float* sc = p.scales + (t * p.kb + b) * SC;
    const float* mn = MIN ? p.mins + (t * p.kb + b) * TILE : nullptr;
    for (int m = 0; m < MB; ++m) {  // per-32 scale, or per-16 scales and the 6-bit offset; then the min term
      const int64_t r = (m0 + m) * a.kb + b;
      __m512 part;
      if constexpr (BITS == 6) {
        const __m512i c0 = _mm512_sub_epi32(h0[m], _mm512_set1_epi32(32 * p.half_sums[2 * r]));
        const __m512i c1 = _mm512_sub_epi32(h1[m], _mm512_set1_epi32(32 * p.half_sums[2 * r + 1]));
        part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), _mm512_loadu_ps(sc + TILE),
                               _mm512_mul_ps(_mm512_cvtepi32_ps(c0), _mm512_loadu_ps(sc)));
      } else {
        part = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0[m], h1[m])), _mm512_loadu_ps(sc));
      }
      acc[m] = _mm512_fmadd_ps(part, _mm512_set1_ps(a.d[r]), acc[m]);
      if constexpr (MIN) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(mn), _mm512_set1_ps(a.d[r] * (float)a.s[r]), acc[m]);
    }
  }
  const __mmask16 mask = nvalid >= TILE ? 0xffff : (__mmask16)((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * p.out_features, mask, _mm512_add_ps(acc[m], bv));
}

// 8 of the tile's 16 rows (`h` the half of the tile). vpmaddubsw pairs reach 2 * 63 * 127: two quads' sum in
// int16 at most, then widened.
template <int BITS, int MB, bool MIN>
__attribute__((target("avx2,fma")))
void half_avx2(const BitsRef& p, int64_t t, int h, const ringserve_cpu::QuantRows& a, int64_t m0, float* y,
               int nvalid, const float* bias) {
  constexpr int SC = BITS == 6 ? 2 * TILE : TILE;
  const uint8_t* w = p.w + t * p.kb * p.block_bytes + h * 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* wb = w + b * p.block_bytes;
    for (int64_t line = 0; line < p.block_bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2048 + line), _MM_HINT_T0);
    __m256i h0[MB], h1[MB];
    for (int m = 0; m < MB; ++m) h0[m] = h1[m] = _mm256_setzero_si256();
    for (int q = 0; q < 4; q += 2) {
      __m256i lo0, hi0, lo1, hi1;
      codes_avx2<BITS>(wb, q, lo0, hi0);
      codes_avx2<BITS>(wb, q + 1, lo1, hi1);
      for (int m = 0; m < MB; ++m) {
        const int8_t* aq = a.q + (m0 + m) * a.kp + b * QK;
        const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, _mm256_set1_epi32(quad(aq + q * 4))),
                                           _mm256_maddubs_epi16(lo1, _mm256_set1_epi32(quad(aq + q * 4 + 4))));
        const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, _mm256_set1_epi32(quad(aq + q * 4 + 16))),
                                           _mm256_maddubs_epi16(hi1, _mm256_set1_epi32(quad(aq + q * 4 + 20))));
        h0[m] = _mm256_add_epi32(h0[m], _mm256_madd_epi16(l, ones));
        h1[m] = _mm256_add_epi32(h1[m], _mm256_madd_epi16(u, ones));
      }
    }
    const float* sc = p.scales + (t * p.kb + b) * SC + h * 8;
    const float* mn = MIN ? p.mins + (t * p.kb + b) * TILE + h * 8 : nullptr;
    for (int m = 0; m < MB; ++m) {
      const int64_t r = (m0 + m) * a.kb + b;
      __m256 part;
      if constexpr (BITS == 6) {
        const __m256i c0 = _mm256_sub_epi32(h0[m], _mm256_set1_epi32(32 * p.half_sums[2 * r]));
        const __m256i c1 = _mm256_sub_epi32(h1[m], _mm256_set1_epi32(32 * p.half_sums[2 * r + 1]));
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_loadu_ps(sc + TILE),
                               _mm256_mul_ps(_mm256_cvtepi32_ps(c0), _mm256_loadu_ps(sc)));
      } else {
        part = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(h0[m], h1[m])), _mm256_loadu_ps(sc));
      }
      acc[m] = _mm256_fmadd_ps(part, _mm256_set1_ps(a.d[r]), acc[m]);
      if constexpr (MIN) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(mn), _mm256_set1_ps(a.d[r] * (float)a.s[r]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[m]);
    float* dst = y + (m0 + m) * p.out_features;
    for (int j = 0; j < nvalid; ++j) dst[j] = out[j] + (bias ? bias[j] : 0.0f);
  }
}

// One activation row, the whole 16-row tile in one pass over K: half_avx2<BITS, 1, MIN>'s per-row arithmetic
// (the same exact integer sums, then the same float operations in the same order), each activation quad
// broadcast once for 16 rows, each block prefetched once, the two halves' float chains interleaved.
template <int BITS, bool MIN>
__attribute__((target("avx2,fma")))
void tile1_avx2(const BitsRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
                const float* bias) {
  constexpr int SC = BITS == 6 ? 2 * TILE : TILE;
  const uint8_t* w = p.w + t * p.kb * p.block_bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < p.kb; ++b) {
    const uint8_t* wb = w + b * p.block_bytes;
    for (int64_t line = 0; line < 64 * BITS; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + 2048 + line), _MM_HINT_T0);
    const int8_t* aq = a.q + m0 * a.kp + b * QK;
    __m256i h0[2], h1[2];
    for (int r = 0; r < 2; ++r) h0[r] = h1[r] = _mm256_setzero_si256();
    for (int q = 0; q < 4; q += 2) {
      const __m256i a0 = _mm256_set1_epi32(quad(aq + q * 4)), a1 = _mm256_set1_epi32(quad(aq + q * 4 + 4));
      const __m256i a2 = _mm256_set1_epi32(quad(aq + q * 4 + 16)), a3 = _mm256_set1_epi32(quad(aq + q * 4 + 20));
      for (int r = 0; r < 2; ++r) {
        __m256i lo0, hi0, lo1, hi1;
        codes_avx2<BITS>(wb + r * 32, q, lo0, hi0);
        codes_avx2<BITS>(wb + r * 32, q + 1, lo1, hi1);
        const __m256i l = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, a0), _mm256_maddubs_epi16(lo1, a1));
        const __m256i u = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, a2), _mm256_maddubs_epi16(hi1, a3));
        h0[r] = _mm256_add_epi32(h0[r], _mm256_madd_epi16(l, ones));
        h1[r] = _mm256_add_epi32(h1[r], _mm256_madd_epi16(u, ones));
      }
    }
    const int64_t row = m0 * a.kb + b;
    const __m256 d = _mm256_set1_ps(a.d[row]);
    for (int r = 0; r < 2; ++r) {
      const float* sc = p.scales + (t * p.kb + b) * SC + r * 8;
      __m256 part;
      if constexpr (BITS == 6) {
        const __m256i c0 = _mm256_sub_epi32(h0[r], _mm256_set1_epi32(32 * p.half_sums[2 * row]));
        const __m256i c1 = _mm256_sub_epi32(h1[r], _mm256_set1_epi32(32 * p.half_sums[2 * row + 1]));
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), _mm256_loadu_ps(sc + TILE),
                               _mm256_mul_ps(_mm256_cvtepi32_ps(c0), _mm256_loadu_ps(sc)));
      } else {
        part = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(h0[r], h1[r])), _mm256_loadu_ps(sc));
      }
      acc[r] = _mm256_fmadd_ps(part, d, acc[r]);
      if constexpr (MIN)
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(p.mins + (t * p.kb + b) * TILE + r * 8),
                                 _mm256_set1_ps(a.d[row] * (float)a.s[row]), acc[r]);
    }
  }
  alignas(32) float out[TILE];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  float* dst = y + m0 * p.out_features;
  for (int j = 0; j < nvalid; ++j) dst[j] = out[j] + (bias ? bias[j] : 0.0f);
}

template <int BITS, int MB, bool MIN>
void tile(const BitsRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, float* y, int nvalid,
          const float* bias) {
  if (ringserve_cpu::isa_is_avx512()) {
    tile_vnni<BITS, MB, MIN>(p, t, a, m0, y, nvalid, bias);
    return;
  }
  if constexpr (MB == 1) {
    tile1_avx2<BITS, MIN>(p, t, a, m0, y, nvalid, bias);
    return;
  }
  for (int h = 0; h < 2 && h * 8 < nvalid; ++h)
    half_avx2<BITS, MB, MIN>(p, t, h, a, m0, y + h * 8, std::min(8, nvalid - h * 8), bias ? bias + h * 8 : nullptr);
}

template <int BITS, bool MIN>
void tile_rows(const BitsRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, int mb, float* y,
               int nvalid, const float* bias) {
  switch (mb) {
    case 1: tile<BITS, 1, MIN>(p, t, a, m0, y, nvalid, bias); break;
    case 2: tile<BITS, 2, MIN>(p, t, a, m0, y, nvalid, bias); break;
    case 3: tile<BITS, 3, MIN>(p, t, a, m0, y, nvalid, bias); break;
    default: tile<BITS, 4, MIN>(p, t, a, m0, y, nvalid, bias); break;
  }
}

template <int BITS>
void run_tile(const BitsRef& p, int64_t t, const ringserve_cpu::QuantRows& a, int64_t m0, int mb, float* y,
              int nvalid, const float* bias) {
  if (p.mins) tile_rows<BITS, true>(p, t, a, m0, mb, y, nvalid, bias);
  else tile_rows<BITS, false>(p, t, a, m0, mb, y, nvalid, bias);
}

// y[M, N] = x[M, K] W^T (+ bias) for a weight in the q4_k/q5_k/q6_k form above (`bits` 4, 5 or 6).
at::Tensor kbit_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(bits >= 4 && bits <= 6, "bits must be 4, 5 or 6");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const int64_t kb = (k + QK - 1) / QK, tiles = (out_features + TILE - 1) / TILE, block_bytes = 64 * bits;
  const int64_t per_block = bits == 6 ? 2 * TILE : TILE;
  TORCH_CHECK(qweight.is_contiguous() && qweight.scalar_type() == at::kByte && qweight.numel() == tiles * kb * block_bytes,
              "qweight does not match out_features, K and bits");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == tiles * kb * per_block,
              "bad scales");
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_min || (mins->is_contiguous() && mins->scalar_type() == at::kFloat && mins->numel() == tiles * kb * TILE),
              "bad mins");
  const at::Tensor bias_c = bias.has_value() && bias->defined() ? bias->contiguous().to(at::kFloat) : at::Tensor();
  TORCH_CHECK(!bias_c.defined() || bias_c.numel() == out_features, "bias must have out_features values");
  at::Tensor y = at::empty({m, out_features}, xc.options());
  if (m == 0 || out_features == 0) return y;
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> da;
  thread_local std::vector<int32_t> sa, sh;
  const int64_t kp = kb * QK;
  if ((int64_t)qa.size() < m * kp) qa.resize(m * kp);
  if ((int64_t)da.size() < m * kb) da.resize(m * kb), sa.resize(m * kb), sh.resize(2 * m * kb);
  const float* xp = xc.data_ptr<float>();
  // the calling thread's scratch: a worker thread naming `qa` would reach its own (empty) thread_local
  int8_t* qp = qa.data();
  float* dp = da.data();
  int32_t* sp = sa.data();
  int32_t* hp = sh.data();
  at::parallel_for(0, m, m * k >= (1 << 16) ? 1 : m, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      ringserve_cpu::quantize_row_blocks(xp + r * k, k, 0, kb, qp + r * kp, dp + r * kb, sp + r * kb);
      if (bits == 6)
        for (int64_t h = 0; h < 2 * kb; ++h) {
          int32_t s = 0;
          for (int j = 0; j < QK / 2; ++j) s += qp[r * kp + h * (QK / 2) + j];
          hp[r * 2 * kb + h] = s;
        }
    }
  });
  const ringserve_cpu::QuantRows a{qp, dp, sp, kp, kb};
  const BitsRef p{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), has_min ? mins->data_ptr<float>() : nullptr,
                  hp, out_features, kb, block_bytes};
  const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int nvalid = (int)std::min<int64_t>(TILE, out_features - t * TILE);
      const float* bt = bp ? bp + t * TILE : nullptr;
      for (int64_t m0 = 0; m0 < m; m0 += MAXMB) {
        const int mb = (int)std::min<int64_t>(MAXMB, m - m0);
        if (bits == 4) run_tile<4>(p, t, a, m0, mb, yp + t * TILE, nvalid, bt);
        else if (bits == 5) run_tile<5>(p, t, a, m0, mb, yp + t * TILE, nvalid, bt);
        else run_tile<6>(p, t, a, m0, mb, yp + t * TILE, nvalid, bt);
      }
    }
  });
  return y;
}

}  // namespace

// The op's schema and fake are defined in kernels/cpu/__init__.py (which registers the torch fallback instead
// when this library cannot be built).
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("kbit_linear", &kbit_linear); }
