// Weight-only quantized GEMV/GEMM for the CPU, in llama.cpp's scheme: weights in groups of 32 along K
// (int8 "q8_0", or 4-bit "q4_0"/"q4_1" with an fp16 scale per group, q4_1 also an fp16 min), activations
// quantized on each call to int8 per block of 32 with an fp32 scale, so the inner loop is int8 x int8 dot
// products accumulated in int32 and rescaled once per block.
//
// Packed layout (made by kernels/cpu/packing.py, the same on every ISA): output rows in tiles of 16, and
// for each tile and K block the 16 rows' weights interleaved four K values at a time, so one 64-byte vector
// holds 4 consecutive K of 16 rows. The kernel broadcasts 4 activation bytes into every 32-bit lane and one
// dot-product instruction advances 16 output rows at once: no horizontal sums, and each weight vector
// loaded is reused for every activation row of a register block (up to 4 rows).
//   q8_0: [tiles][K blocks][8 quads][16 rows][4] bytes, each q + 128 (unsigned, see the VNNI path)
//   q4_x: [tiles][K blocks][4 vectors][16 rows][4] bytes; low nibbles are quads 0-3, high nibbles 4-7
//   scales (and mins): fp16 [tiles][K blocks][16]
//
// Two ISA paths, chosen at run time (compiled with per-function target attributes, so one build serves any
// x86-64 host): AVX-512 VNNI (vpdpbusd: u8 x s8 -> i32, 4 products per lane in one instruction) and AVX2
// (vpmaddubsw u8 x s8 -> saturating i16 pairs, then vpmaddwd to i32), for hosts without VNNI (AMD Zen 2/3).
// At one activation row (a decode step at batch 1) AVX2 runs the whole 16-row tile in one pass over K
// (tile1_avx2; kquant.cpp and kbits.cpp likewise), with the multi-row kernel's per-row arithmetic: every path,
// row count and register block gives a row the same bits (tests/kernels/test_kernels_one_row.py).

// Only the headers the kernels need (not torch/extension.h, which takes 4x longer to compile): the ops are
// registered with the dispatcher, and Python calls them through torch.ops, no pybind module.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "qgemm.h"

namespace {

using ringserve_cpu::PackedRef;
using ringserve_cpu::QuantRows;
constexpr int QK = ringserve_cpu::kQK;
constexpr int TILE = ringserve_cpu::kTile;
constexpr int MAXMB = 4;  // activation rows per register block

enum Kind { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
enum Isa { ISA_NONE = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2 };

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c"))
    return ISA_AVX512VNNI;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ISA_AVX2;
  return ISA_NONE;
}

const int kBestIsa = detect_isa();
int g_isa = kBestIsa;

__attribute__((target("avx2,fma")))
void quantize_block_avx2(const float* x, int8_t* q, float* d, int32_t* s) {
  // Same arithmetic as the torch reference: d = amax / 127, q = round_half_even(x * (1 / d)).
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = _mm_cvtss_f32(m4) / 127.0f;
  const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
  const __m256 mul = _mm256_set1_ps(inv);
  __m256i i32[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], mul), _MM_FROUND_TO_NEAREST_INT |
                                                                             _MM_FROUND_NO_EXC));
    sum = _mm256_add_epi32(sum, i32[i]);
  }
  // packs work within 128-bit lanes; the permute restores element order
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *d = scale;
  *s = _mm_cvtsi128_si32(s4);
}

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* s) {
  const int64_t kb = (k + QK - 1) / QK, kp = kb * QK;
  at::parallel_for(0, m, m * k >= (1 << 16) ? 1 : m, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      ringserve_cpu::quantize_row_blocks(x + r * k, k, 0, kb, q + r * kp, d + r * kb, s + r * kb);
  });
}

inline int32_t quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A thread streams its tiles' weights, contiguous, once per call. The hardware prefetcher stops at every 4 KB
// page boundary, and at batch 1 every load waits on memory: asking for the lines 2 KB ahead made the step's
// linears ~1.09x faster (two threads, Intel Xeon with AVX-512 VNNI, 2026-12-03; 1-4 KB measured alike).
// Past a tile's end it reaches into the thread's next tile (or, at its last, a little of the next thread's).
constexpr int64_t kPrefetchBytes = 2048;

template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t line = 0; line < BYTES; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
}

// ---- AVX-512 VNNI: one 16-row tile x MB activation rows -----------------------------------------------
template <int KIND, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void tile_vnni(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const QuantRows& a, int64_t m0,
               float* y, int64_t ldy, int nvalid, const float* bias) {
  // Independent accumulator chains hide vpdpbusd's latency when few rows share each weight load.
  constexpr int CH = MB == 1 ? 4 : 2;
  constexpr int64_t BLOCK_BYTES = KIND == Q8_0 ? 512 : 256;
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.kb; ++b) {
    const uint8_t* wb = w + b * BLOCK_BYTES;
    prefetch_ahead<BLOCK_BYTES>(wb);
    __m512i ai[MB][CH];
    for (int m = 0; m < MB; ++m) {
      const int32_t sum = a.s[(m0 + m) * a.kb + b];
      // q8_0 stores q + 128 (vpdpbusd's unsigned operand), q4_0 nibbles are q + 8: start from the offset's
      // contribution, -offset * sum(activation q); q4_1's nibbles are unsigned by definition.
      const int32_t init = KIND == Q8_0 ? -128 * sum : KIND == Q4_0 ? -8 * sum : 0;
      ai[m][0] = _mm512_set1_epi32(init);
      for (int c = 1; c < CH; ++c) ai[m][c] = _mm512_setzero_si512();
    }
    if constexpr (KIND == Q8_0) {
      for (int qd = 0; qd < 8; ++qd) {
        const __m512i wv = _mm512_loadu_si512(wb + qd * 64);
        for (int m = 0; m < MB; ++m) {
          const __m512i av = _mm512_set1_epi32(quad(a.q + (m0 + m) * a.kp + b * QK + qd * 4));
          ai[m][qd % CH] = _mm512_dpbusd_epi32(ai[m][qd % CH], wv, av);
        }
      }
    } else {
      for (int p = 0; p < 4; ++p) {
        const __m512i raw = _mm512_loadu_si512(wb + p * 64);
        const __m512i lo = _mm512_and_si512(raw, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* aq = a.q + (m0 + m) * a.kp + b * QK;
          ai[m][p % CH] = _mm512_dpbusd_epi32(ai[m][p % CH], lo, _mm512_set1_epi32(quad(aq + p * 4)));
          ai[m][(p + 4) % CH] = _mm512_dpbusd_epi32(ai[m][(p + 4) % CH], hi,
                                                    _mm512_set1_epi32(quad(aq + (p + 4) * 4)));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * TILE)));
    __m512 mw;
    if constexpr (KIND == Q4_1)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b * TILE)));
    for (int m = 0; m < MB; ++m) {
      __m512i isum = ai[m][0];
      for (int c = 1; c < CH; ++c) isum = _mm512_add_epi32(isum, ai[m][c]);
      const float da = a.d[(m0 + m) * a.kb + b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[m]);
      if constexpr (KIND == Q4_1)  // the min times the block's activation sum
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(da * (float)a.s[(m0 + m) * a.kb + b]), acc[m]);
    }
  }
  const __mmask16 mask = nvalid >= TILE ? 0xffff : (__mmask16)((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy, mask, _mm512_add_ps(acc[m], bv));
}

// ---- AVX2: the same tile as two 8-row halves ------------------------------------------------------------
template <int KIND, int MB>
__attribute__((target("avx2,fma,f16c")))
void half_avx2(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const QuantRows& a, int64_t m0,
               float* y, int64_t ldy, int nvalid, const float* bias) {
  constexpr int64_t BLOCK_BYTES = KIND == Q8_0 ? 512 : 256;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.kb; ++b) {
    const uint8_t* wb = w + b * BLOCK_BYTES;  // w already points at this half's 32 bytes of each vector
    prefetch_ahead<BLOCK_BYTES>(wb);  // the first half's pass brings the lines; the second finds them cached
    __m256i ai[MB];
    if constexpr (KIND == Q8_0) {
      __m256i even[MB], odd[MB];
      for (int m = 0; m < MB; ++m) even[m] = odd[m] = _mm256_setzero_si256();
      for (int qd = 0; qd < 8; ++qd) {
        // vpmaddubsw needs one unsigned operand and saturates at 16 bits: u8 (q + 128) x s8 could reach
        // 2 * 255 * 127. llama.cpp's sign trick instead: |w| x (a * sign(w)), at most 2 * 127 * 127.
        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + qd * 64)),
                                            flip);
        const __m256i wa = _mm256_abs_epi8(ws);
        for (int m = 0; m < MB; ++m) {
          const __m256i av = _mm256_set1_epi32(quad(a.q + (m0 + m) * a.kp + b * QK + qd * 4));
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(av, ws)), ones);
          if (qd % 2) odd[m] = _mm256_add_epi32(odd[m], p); else even[m] = _mm256_add_epi32(even[m], p);
        }
      }
      for (int m = 0; m < MB; ++m) ai[m] = _mm256_add_epi32(even[m], odd[m]);
    } else {
      // Nibbles (0..15) are already unsigned: pairs reach 2 * 15 * 127, so all 8 products of a block sum
      // in int16 (30,480 at most) before the one widening vpmaddwd.
      __m256i lo16[MB], hi16[MB];
      for (int m = 0; m < MB; ++m) lo16[m] = hi16[m] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* aq = a.q + (m0 + m) * a.kp + b * QK;
          lo16[m] = _mm256_add_epi16(lo16[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(aq + p * 4))));
          hi16[m] = _mm256_add_epi16(hi16[m],
                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(aq + (p + 4) * 4))));
        }
      }
      for (int m = 0; m < MB; ++m) {
        ai[m] = _mm256_madd_epi16(_mm256_add_epi16(lo16[m], hi16[m]), ones);
        if constexpr (KIND == Q4_0)
          ai[m] = _mm256_sub_epi32(ai[m], _mm256_set1_epi32(8 * a.s[(m0 + m) * a.kb + b]));
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * TILE)));
    __m256 mw;
    if constexpr (KIND == Q4_1) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b * TILE)));
    for (int m = 0; m < MB; ++m) {
      const float da = a.d[(m0 + m) * a.kb + b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[m]), _mm256_mul_ps(dw, _mm256_set1_ps(da)), acc[m]);
      if constexpr (KIND == Q4_1)
        acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(da * (float)a.s[(m0 + m) * a.kb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[m]);
    float* dst = y + (m0 + m) * ldy;
    for (int j = 0; j < nvalid; ++j) dst[j] = out[j] + (bias ? bias[j] : 0.0f);
  }
}

// ---- AVX2, one activation row: the whole 16-row tile in one pass -----------------------------------------
// The same per-row arithmetic as half_avx2<KIND, 1> (exact integer sums, then per block the same float
// operations in the same order on each output), so a row's result does not depend on how many rows share the
// call. One pass over K for both halves instead of two: each activation quad is broadcast once for 16 rows,
// each block's lines are prefetched once, and the halves' two float chains interleave (at one row the
// half-tile loop waited on its single chain of dependent FMAs).
template <int KIND>
__attribute__((target("avx2,fma,f16c")))
void tile1_avx2(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const QuantRows& a, int64_t m0,
                float* y, int nvalid, const float* bias) {
  constexpr int64_t BLOCK_BYTES = KIND == Q8_0 ? 512 : 256;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  const int8_t* aq_row = a.q + m0 * a.kp;
  const float* ad_row = a.d + m0 * a.kb;
  const int32_t* as_row = a.s + m0 * a.kb;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.kb; ++b) {
    const uint8_t* wb = w + b * BLOCK_BYTES;
    prefetch_ahead<BLOCK_BYTES>(wb);
    const int8_t* aq = aq_row + b * QK;
    __m256i i0, i1;  // the block's exact integer dot products, rows 0-7 and 8-15
    if constexpr (KIND == Q8_0) {
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int qd = 0; qd < 8; ++qd) {
        const __m256i av = _mm256_set1_epi32(quad(aq + qd * 4));
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + qd * 64)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + qd * 64 + 32)),
                                            flip);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(av, w0)),
                                                    ones));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(av, w1)),
                                                    ones));
      }
      i0 = s0, i1 = s1;
    } else {
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();  // int16 sums, as half_avx2's
      for (int p = 0; p < 4; ++p) {
        const __m256i alo = _mm256_set1_epi32(quad(aq + p * 4)), ahi = _mm256_set1_epi32(quad(aq + (p + 4) * 4));
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * 64 + 32));
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_and_si256(r0, low4), alo));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_and_si256(r1, low4), alo));
        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(r0, 4), low4), ahi));
        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(r1, 4), low4), ahi));
      }
      i0 = _mm256_madd_epi16(p0, ones), i1 = _mm256_madd_epi16(p1, ones);
      if constexpr (KIND == Q4_0) {
        const __m256i off = _mm256_set1_epi32(8 * as_row[b]);
        i0 = _mm256_sub_epi32(i0, off), i1 = _mm256_sub_epi32(i1, off);
      }
    }
    const float da = ad_row[b];
    const __m256 vda = _mm256_set1_ps(da);
    const __m256i sc16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * TILE));
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(sc16)), vda),
                           acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1),
                           _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(sc16, 1)), vda), acc1);
    if constexpr (KIND == Q4_1) {
      const __m256i mn16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b * TILE));
      const __m256 dm = _mm256_set1_ps(da * (float)as_row[b]);
      acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(mn16)), dm, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(mn16, 1)), dm, acc1);
    }
  }
  alignas(32) float out[TILE];
  _mm256_store_ps(out, acc0);
  _mm256_store_ps(out + 8, acc1);
  for (int j = 0; j < nvalid; ++j) y[j] = out[j] + (bias ? bias[j] : 0.0f);
}

template <int KIND, int MB>
void tile(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const QuantRows& a, int64_t m0,
          float* y, int64_t ldy, int nvalid, const float* bias) {
  if (g_isa == ISA_AVX512VNNI) {
    tile_vnni<KIND, MB>(w, sc, mn, a, m0, y, ldy, nvalid, bias);
    return;
  }
  if constexpr (MB == 1) {
    tile1_avx2<KIND>(w, sc, mn, a, m0, y + m0 * ldy, nvalid, bias);
    return;
  }
  for (int h = 0; h < 2 && h * 8 < nvalid; ++h)
    half_avx2<KIND, MB>(w + h * 32, sc + h * 8, mn ? mn + h * 8 : nullptr, a, m0, y + h * 8, ldy,
                        std::min(8, nvalid - h * 8), bias ? bias + h * 8 : nullptr);
}

template <int KIND>
void tile_rows(const uint8_t* w, const uint16_t* sc, const uint16_t* mn, const QuantRows& a, int64_t m0,
               int mb, float* y, int64_t ldy, int nvalid, const float* bias) {
  switch (mb) {
    case 1: tile<KIND, 1>(w, sc, mn, a, m0, y, ldy, nvalid, bias); break;
    case 2: tile<KIND, 2>(w, sc, mn, a, m0, y, ldy, nvalid, bias); break;
    case 3: tile<KIND, 3>(w, sc, mn, a, m0, y, ldy, nvalid, bias); break;
    default: tile<KIND, 4>(w, sc, mn, a, m0, y, ldy, nvalid, bias); break;
  }
}

}  // namespace

ringserve_cpu::PackedRef ringserve_cpu::packed_ref(const at::Tensor& qweight, const at::Tensor& scales,
                                                   const std::optional<at::Tensor>& mins, const at::Tensor& bias,
                                                   int64_t out_features, int64_t in_features, int64_t bits) {
  TORCH_CHECK(g_isa != ISA_NONE, "ringserve qgemm: this CPU has neither AVX2 nor AVX-512 VNNI");
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
  const int64_t kb = (in_features + QK - 1) / QK, tiles = (out_features + TILE - 1) / TILE;
  const int64_t block_bytes = bits == 8 ? 512 : 256;
  TORCH_CHECK(qweight.is_contiguous() && qweight.numel() == tiles * kb * block_bytes &&
                  qweight.scalar_type() == at::kByte, "qweight does not match out_features and K");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == tiles * kb * TILE && scales.scalar_type() == at::kHalf,
              "bad scales");
  const bool has_min = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_min || (bits == 4 && mins->is_contiguous() && mins->numel() == scales.numel() &&
                           mins->scalar_type() == at::kHalf), "mins must be fp16 like scales, for 4 bits only");
  const bool has_bias = bias.defined();
  TORCH_CHECK(!has_bias || (bias.is_contiguous() && bias.scalar_type() == at::kFloat && bias.numel() == out_features),
              "bias must be out_features contiguous float32 values");
  return PackedRef{qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                   has_min ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr,
                   has_bias ? bias.data_ptr<float>() : nullptr, out_features, in_features, kb, tiles, block_bytes,
                   bits == 8 ? Q8_0 : has_min ? Q4_1 : Q4_0};
}

void ringserve_cpu::quantize_row_blocks(const float* x, int64_t k, int64_t b0, int64_t b1, int8_t* q, float* d,
                                        int32_t* s) {
  float tail[QK];
  for (int64_t b = b0; b < b1; ++b) {
    const float* src = x + b * QK;
    if ((b + 1) * QK > k) {  // K not a multiple of 32: the last block is zero-padded
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, src, sizeof(float) * (k - b * QK));
      src = tail;
    }
    quantize_block_avx2(src, q + b * QK, d + b, s + b);
  }
}

void ringserve_cpu::linear_tiles(const PackedRef& p, const QuantRows& a, int64_t m, int64_t t0, int64_t t1, float* y) {
  // Each tile's weights stay in L1/L2 while they are reused for every activation row.
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* wt = p.w + t * p.kb * p.block_bytes;
    const uint16_t* st = p.scales + t * p.kb * TILE;
    const uint16_t* mt = p.mins ? p.mins + t * p.kb * TILE : nullptr;
    const int nvalid = (int)std::min<int64_t>(TILE, p.out_features - t * TILE);
    const float* bt = p.bias ? p.bias + t * TILE : nullptr;
    for (int64_t m0 = 0; m0 < m; m0 += MAXMB) {
      const int mb = (int)std::min<int64_t>(MAXMB, m - m0);
      float* yt = y + t * TILE;
      if (p.kind == Q8_0) tile_rows<Q8_0>(wt, st, mt, a, m0, mb, yt, p.out_features, nvalid, bt);
      else if (p.kind == Q4_0) tile_rows<Q4_0>(wt, st, mt, a, m0, mb, yt, p.out_features, nvalid, bt);
      else tile_rows<Q4_1>(wt, st, mt, a, m0, mb, yt, p.out_features, nvalid, bt);
    }
  }
}

namespace {

// y[M, N] = x[M, K] W^T (+ bias) with W packed as described at the top; `bits` is 8 (q8_0) or 4 (q4_0, or
// q4_1 when `mins` is given).
at::Tensor group_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  const at::Tensor bias_c = bias.has_value() && bias->defined() ? bias->contiguous().to(at::kFloat) : at::Tensor();
  const at::Tensor wc = qweight.contiguous(), sc = scales.contiguous();
  const std::optional<at::Tensor> mc = mins.has_value() && mins->defined() ? std::optional<at::Tensor>(mins->contiguous())
                                                                           : std::nullopt;
  const PackedRef p = ringserve_cpu::packed_ref(wc, sc, mc, bias_c, out_features, k, bits);
  at::Tensor y = at::empty({m, out_features}, xc.options());
  if (m == 0 || out_features == 0) return y;
  // The quantized activations live in per-thread scratch that only grows: no allocation per call.
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> da;
  thread_local std::vector<int32_t> sa;
  const int64_t kb = p.kb, kp = kb * QK;
  if ((int64_t)qa.size() < m * kp) qa.resize(m * kp);
  if ((int64_t)da.size() < m * kb) da.resize(m * kb), sa.resize(m * kb);
  quantize_rows(xc.data_ptr<float>(), m, k, qa.data(), da.data(), sa.data());
  const QuantRows a{qa.data(), da.data(), sa.data(), kp, kb};
  float* yp = y.data_ptr<float>();
  // Threads split the output tiles; each walks every activation row over its tiles.
  at::parallel_for(0, p.tiles, 1, [&](int64_t t0, int64_t t1) { ringserve_cpu::linear_tiles(p, a, m, t0, t1, yp); });
  return y;
}

}  // namespace

// The ISA path in use ("avx512vnni", "avx2" or "none").
std::string isa() { return g_isa == ISA_AVX512VNNI ? "avx512vnni" : g_isa == ISA_AVX2 ? "avx2" : "none"; }

bool ringserve_cpu::isa_is_avx512() { return g_isa == ISA_AVX512VNNI; }

// The best path this CPU supports, whatever set_isa chose.
std::string best_isa() { return kBestIsa == ISA_AVX512VNNI ? "avx512vnni" : kBestIsa == ISA_AVX2 ? "avx2" : "none"; }

// Force a path ("avx2" on a VNNI host, for tests and benchmarks); a path the CPU lacks is refused.
void set_isa(const std::string& name) {
  const int want = name == "avx512vnni" ? ISA_AVX512VNNI : name == "avx2" ? ISA_AVX2 : -1;
  TORCH_CHECK(want >= 0, "unknown ISA '", name, "'; choose avx512vnni or avx2");
  TORCH_CHECK(want <= kBestIsa, "this CPU does not support ", name);
  g_isa = want;
}

// The op's schema and fake implementation are defined in kernels/cpu/__init__.py, which registers the torch
// fallback instead when this library cannot be built.
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("group_linear", &group_linear); }

TORCH_LIBRARY(ringserve_qgemm, m) {
  m.def("isa", &isa);
  m.def("best_isa", &best_isa);
  m.def("set_isa", &set_isa);
}
