// Paged decode attention for the CPU: one query token per request attends to its keys and values where they
// lie in the KV pool, addressed through the request-to-token table. No gather: the torch path copies every
// request's K and V of every layer into a padded batch first, which dominates a step at long contexts.
//
// out[b, h] = softmax_j(cap(scale * q[b, h] . K[s_j, h / rep])) @ V[s_j, h / rep],   s_j = table[rows[b], j],
// kv_lens[b] - window <= j < kv_lens[b] (a sliding window: only the last `window` keys are read; 0 = all), and
// cap(x) = soft_cap * tanh(x / soft_cap) (logit soft-capping; 0 = none).
//
// One work item is a (request, KV head) pair: its `rep` query heads (GQA) share each K and V row loaded. Two
// passes over the keys: the scores of all rep heads into a per-thread buffer (eight keys at a time), then the
// softmax weights and the weighted sum of V rows (accumulated in registers, up to four heads per pass). The
// scoring pass prefetches the K and V rows of the keys 16 ahead (scattered slots defeat the hardware
// prefetcher). float32 only; AVX2 + FMA vector loops for head_dim a multiple of 8 (every Llama), scalar loops
// otherwise. Compiled with per-function target attributes, as qgemm.cpp.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_attention.h"
#include "simd.h"

namespace {

using ringserve_cpu::exp_avx2;
using ringserve_cpu::hsum_avx2;

constexpr int64_t kPrefetchKeys = 16;  // how many keys ahead the loops prefetch K and V rows

// The sums of eight vectors, as one vector: lane t holds the sum of a[t]'s lanes.
__attribute__((target("avx2,fma")))
inline __m256 hsum8_avx2(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[t] = cap * tanh(s[t] / cap) for t < n, tanh from exp(-2|x|) (no overflow): (1 - e) / (1 + e), signed.
__attribute__((target("avx2,fma")))
void soft_cap_avx2(float* s, int64_t n, float cap) {
  const __m256 cap_v = _mm256_set1_ps(cap), inv_cap = _mm256_set1_ps(1.0f / cap), one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f), minus_two = _mm256_set1_ps(-2.0f);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), inv_cap);
    const __m256 e = exp_avx2(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, x)));  // exp(-2|x|)
    const __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(s + t, _mm256_mul_ps(cap_v, _mm256_or_ps(th, _mm256_and_ps(sign, x))));
  }
  for (; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// out[r][i0 .. i0+16) = sum_j p[r][j] * V[slots[j]][i0 .. i0+16) for RB heads at once: 2*RB accumulators
// stay in registers over all n rows (one pass over V per 16 columns and RB heads).
template <int RB>
__attribute__((target("avx2,fma")))
inline void weighted_v_avx2(const float* v, int64_t kv_stride, const int64_t* slots, int64_t n, const float* p,
                            int64_t p_stride, int i0, float* out, int64_t out_stride) {
  __m256 acc[RB][2];
  for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v + slots[j] * kv_stride + i0;
    if (j + kPrefetchKeys < n)
      _mm_prefetch(reinterpret_cast<const char*>(v + slots[j + kPrefetchKeys] * kv_stride + i0), _MM_HINT_T0);
    const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 w = _mm256_set1_ps(p[r * p_stride + j]);
      acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(out + r * out_stride + i0, acc[r][0]);
    _mm256_storeu_ps(out + r * out_stride + i0 + 8, acc[r][1]);
  }
}

// One (request, KV head): q [rep][d] (rows `q_stride` apart), K/V rows at `kv + slot * kv_stride`, out like q.
// Scores eight keys at a time (eight independent FMA chains per head, one transposing reduction), then the
// soft cap (when `soft_cap` > 0), the softmax, then the weighted V rows for up to four heads per pass. d is a
// multiple of 8. With `stats`, the
// weights stay unnormalized and each head's max score and sum of weights go to stats[2r], stats[2r + 1].
__attribute__((target("avx2,fma")))
void head_group_avx2(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride,
                     const int64_t* slots, int64_t n, int rep, int d, float scale, float soft_cap, float* out,
                     float* scores, float* stats) {
  const __m256 scale_v = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* kr[8];
    for (int t = 0; t < 8; ++t) kr[t] = k + slots[j + t] * kv_stride;
    // The slots are scattered, so no hardware prefetcher sees the next rows coming: ask for the K rows
    // kPrefetchKeys ahead into L1, and their V rows into L2 for the second pass.
    for (int64_t t = j + kPrefetchKeys; t < std::min(n, j + kPrefetchKeys + 8); ++t) {
      const char* kp = reinterpret_cast<const char*>(k + slots[t] * kv_stride);
      const char* vp = reinterpret_cast<const char*>(v + slots[t] * kv_stride);
      for (int b = 0; b < d * 4; b += 64) {
        _mm_prefetch(kp + b, _MM_HINT_T0);
        _mm_prefetch(vp + b, _MM_HINT_T1);
      }
    }
    for (int r = 0; r < rep; ++r) {
      const float* qr = q + r * q_stride;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qr + i);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t] + i), acc[t]);
      }
      _mm256_storeu_ps(scores + r * n + j, _mm256_mul_ps(hsum8_avx2(acc), scale_v));
    }
  }
  for (; j < n; ++j) {
    const float* kr = k + slots[j] * kv_stride;
    for (int r = 0; r < rep; ++r) {
      const float* qr = q + r * q_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), _mm256_loadu_ps(kr + i), acc);
      scores[r * n + j] = hsum_avx2(acc) * scale;
    }
  }
  for (int r = 0; r < rep; ++r) {
    float* sr = scores + r * n;
    if (soft_cap > 0.0f) soft_cap_avx2(sr, n, soft_cap);
    float m = -INFINITY;
    for (int64_t t = 0; t < n; ++t) m = std::max(m, sr[t]);
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sr + t), mv));
      _mm256_storeu_ps(sr + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum_avx2(sum);
    for (; t < n; ++t) {
      sr[t] = std::exp(sr[t] - m);
      total += sr[t];
    }
    if (stats) {
      stats[2 * r] = m;
      stats[2 * r + 1] = total;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(sr + t, _mm256_mul_ps(_mm256_loadu_ps(sr + t), inv));
    for (; t < n; ++t) sr[t] *= 1.0f / total;
  }
  for (int i0 = 0; i0 < d; i0 += 16) {
    if (i0 + 16 > d) {  // d % 16 == 8: the last 8 columns, one head at a time
      for (int r = 0; r < rep; ++r) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; ++t)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[r * n + t]), _mm256_loadu_ps(v + slots[t] * kv_stride + i0), acc);
        _mm256_storeu_ps(out + r * q_stride + i0, acc);
      }
      break;
    }
    int r = 0;
    for (; r + 4 <= rep; r += 4)
      weighted_v_avx2<4>(v, kv_stride, slots, n, scores + r * n, n, i0, out + r * q_stride, q_stride);
    switch (rep - r) {
      case 3: weighted_v_avx2<3>(v, kv_stride, slots, n, scores + r * n, n, i0, out + r * q_stride, q_stride); break;
      case 2: weighted_v_avx2<2>(v, kv_stride, slots, n, scores + r * n, n, i0, out + r * q_stride, q_stride); break;
      case 1: weighted_v_avx2<1>(v, kv_stride, slots, n, scores + r * n, n, i0, out + r * q_stride, q_stride); break;
      default: break;
    }
  }
}

void head_group_scalar(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride,
                       const int64_t* slots, int64_t n, int rep, int d, float scale, float soft_cap, float* out,
                       float* scores, float* stats) {
  for (int r = 0; r < rep; ++r) {
    const float* qr = q + r * q_stride;
    float* sr = scores + r * n;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float* kr = k + slots[j] * kv_stride;
      float dot = 0.0f;
      for (int i = 0; i < d; ++i) dot += qr[i] * kr[i];
      sr[j] = soft_cap > 0.0f ? soft_cap * std::tanh(dot * scale / soft_cap) : dot * scale;
      m = std::max(m, sr[j]);
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += (sr[j] = std::exp(sr[j] - m));
    if (stats) {
      stats[2 * r] = m;
      stats[2 * r + 1] = total;
    }
    const float norm = stats ? 1.0f : total;
    float* o = out + r * q_stride;
    std::fill(o, o + d, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + slots[j] * kv_stride;
      const float p = sr[j] / norm;
      for (int i = 0; i < d; ++i) o[i] += p * vr[i];
    }
  }
}

const bool kHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}();

}  // namespace

void ringserve_cpu::attend_head_group(const float* q, int64_t q_stride, const float* k, const float* v,
                                      int64_t kv_stride, const int64_t* slots, int64_t n, int rep, int d, float scale,
                                      float soft_cap, float* out, float* scores, float* stats) {
  if (kHasAvx2 && d % 8 == 0)
    head_group_avx2(q, q_stride, k, v, kv_stride, slots, n, rep, d, scale, soft_cap, out, scores, stats);
  else
    head_group_scalar(q, q_stride, k, v, kv_stride, slots, n, rep, d, scale, soft_cap, out, scores, stats);
}

namespace {

// q [B, H, D]; k_layer, v_layer [S, Hkv, D] (one layer of the pool); table [R, W] int64; rows, kv_lens [B] int64;
// window: keys per query (0 = all); soft_cap: logit cap (0 = none).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_layer, const at::Tensor& v_layer,
                                  const at::Tensor& table, const at::Tensor& rows, const at::Tensor& kv_lens,
                                  double scale, int64_t window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && k_layer.dim() == 3 && v_layer.sizes() == k_layer.sizes(),
              "paged_decode_attention: q [B, H, D] and K/V [S, Hkv, D] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_layer.scalar_type() == at::kFloat &&
                  v_layer.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(table.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                  kv_lens.scalar_type() == at::kLong, "paged_decode_attention: int64 table, rows and kv_lens");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous() && table.stride(1) == 1,
              "paged_decode_attention: contiguous K/V and table rows expected");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hkv = k_layer.size(1);
  TORCH_CHECK(k_layer.size(2) == d && h % hkv == 0, "paged_decode_attention: heads or head_dim do not match");
  TORCH_CHECK(rows.numel() == b && kv_lens.numel() == b, "paged_decode_attention: one row and length per query");
  const at::Tensor qc = q.contiguous(), rc = rows.contiguous(), lc = kv_lens.contiguous();
  at::Tensor out = at::empty({b, h, d}, qc.options());
  const int rep = (int)(h / hkv);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_layer.data_ptr<float>();
  const float* vp = v_layer.data_ptr<float>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* rp = rc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t width = table.size(1), tstride = table.stride(0), kv_stride = hkv * d;
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width, "paged_decode_attention: kv_len ", lp[i], " outside [1, ", width, "]");
  TORCH_CHECK(window >= 0 && soft_cap >= 0.0, "paged_decode_attention: window and soft_cap must not be negative");
  at::parallel_for(0, b * hkv, 1, [&](int64_t w0, int64_t w1) {
    thread_local std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / hkv, g = w % hkv;
      const int64_t first = window > 0 ? std::max<int64_t>(0, lp[i] - window) : 0, n = lp[i] - first;
      if ((int64_t)scores.size() < rep * n) scores.resize(rep * n);
      const float* qg = qp + (i * h + g * rep) * d;
      float* og = op + (i * h + g * rep) * d;
      const int64_t* slots = tp + rp[i] * tstride + first;
      ringserve_cpu::attend_head_group(qg, d, kp + g * d, vp + g * d, kv_stride, slots, n, rep, (int)d, (float)scale,
                                       (float)soft_cap, og, scores.data());
    }
  });
  return out;
}

}  // namespace

// The schema and fake implementation are in kernels/cpu/attention.py, which registers the torch reference
// instead when this library cannot be built.
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
