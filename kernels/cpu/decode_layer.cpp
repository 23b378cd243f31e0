// One whole decoder layer of a decode step on the CPU, in one parallel region: RMSNorm, the fused QKV
// projection, rotary embedding, the KV write, paged attention, the output projection and residual, RMSNorm,
// gate/up, SiLU-and-multiply, down and residual. Every row is one request's single new token.
//
// Why one op: at batch 1 a compiled step of SmolLM2-135M ran ~300 ops (four linears, four fused element-wise
// kernels, a KV write and attention per layer), each a Python call from Inductor's wrapper and a fork and join
// of the OpenMP team; together ~2.5 ms of an 8 ms step whose weights stream in ~4 ms. Here a layer is one call
// and one team, its phases separated by barriers, and the small element-wise work runs beside the data it
// needs. The linears are qgemm.cpp's tiles (weights packed in groups of 32, activations quantized per block of
// 32) and attention is paged_attention.cpp's routine, so the arithmetic is theirs; the torch reference of the
// whole layer is `reference_decode_layer` in kernels/cpu/decode_layer.py.
//
// Work split per phase: output tiles of a linear, (request, KV head) pairs for rotary and the KV write, parts
// of their keys for attention (combined like split-K flash decoding), 32-value blocks for SiLU and the
// activation quantization, rows for the norms and residuals.
// Padding rows of a graph batch all write the pool's scratch slot; only padding rows read it.

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "paged_attention.h"
#include "qgemm.h"
#include "simd.h"

namespace {

using ringserve_cpu::kQK;
using ringserve_cpu::PackedRef;
using ringserve_cpu::QuantRows;

// One linear's input rows, quantized per block of 32.
struct QuantBuffer {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  int64_t k = 0, kb = 0, kp = 0;

  QuantBuffer(int64_t m, int64_t k_) : k(k_), kb((k_ + kQK - 1) / kQK), kp(kb * kQK) {
    q.resize(m * kp);
    d.resize(m * kb);
    s.resize(m * kb);
  }
  QuantRows rows() const { return QuantRows{q.data(), d.data(), s.data(), kp, kb}; }
  // Blocks [b0, b1) of row r, from x (the row's K values).
  void quantize(const float* x, int64_t r, int64_t b0, int64_t b1) {
    ringserve_cpu::quantize_row_blocks(x, k, b0, b1, q.data() + r * kp, d.data() + r * kb, s.data() + r * kb);
  }
};

// [b, e): this thread's share of n items, contiguous.
inline void share(int64_t n, int tid, int nth, int64_t& b, int64_t& e) {
  b = n * tid / nth;
  e = n * (tid + 1) / nth;
}

// y = w * (x * rsqrt(mean(x^2) + eps)), as the model's RMSNorm (float32).
void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// out = x * cos + rotate_half(x) * sin over one head of d values, rotate_half([x1, x2]) = [-x2, x1].
void rotary(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// out[i] = silu(gate[i]) * up[i] for i < n; silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|).
__attribute__((target("avx2,fma")))
void silu_mul_avx2(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = ringserve_cpu::exp_avx2(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 sig = _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), g);  // g < 0: e / (1 + e)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// Attention over keys [begin, end) of one (request, KV head); `count` parts cover its keys.
struct KeyPart {
  int64_t row, head, begin, end, count;
};

constexpr int64_t kSplitBelowPairs = 16;  // (request, KV head) pairs under which keys are split
constexpr int64_t kKeysPerPart = 96;      // at least this many keys per part

// The `count` parts starting at parts[first] into the normalized output of their heads: each part holds
// exp(score - its max)-weighted sums of V rows, its max and its sum of weights per head.
void combine(int64_t first, const std::vector<KeyPart>& parts, const float* part_out, const float* part_stats,
             int rep, int64_t d, int64_t h, float* attn) {
  const KeyPart& p0 = parts[first];
  float* out = attn + (p0.row * h + p0.head * rep) * d;
  for (int r = 0; r < rep; ++r) {
    float mx = -INFINITY;
    for (int64_t i = first; i < first + p0.count; ++i) mx = std::max(mx, part_stats[i * 2 * rep + 2 * r]);
    float total = 0.0f;
    float* o = out + r * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t i = first; i < first + p0.count; ++i) {
      const float w = std::exp(part_stats[i * 2 * rep + 2 * r] - mx);
      total += w * part_stats[i * 2 * rep + 2 * r + 1];
      const float* po = part_out + (i * rep + r) * d;
      for (int64_t j = 0; j < d; ++j) o[j] += w * po[j];
    }
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < d; ++j) o[j] *= inv;
  }
}

PackedRef linear(at::TensorList qweights, at::TensorList scales, const c10::List<std::optional<at::Tensor>>& mins,
                 const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef bits,
                 at::IntArrayRef out_features, size_t i, int64_t in_features, int64_t want_out) {
  TORCH_CHECK(out_features[i] == want_out, "decode_layer: linear ", i, " has ", out_features[i],
              " outputs, the layer's shapes need ", want_out);
  const std::optional<at::Tensor> bias = biases.get(i);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = *bias;
  return ringserve_cpu::packed_ref(qweights[i], scales[i], mins.get(i), b, out_features[i], in_features, bits[i]);
}

// x [M, C]; cos, sin [M, D]; norms [C]; four linears (qkv, o, gate_up, down) as packed tensors; pools
// [L, S, Hkv, D]; out_slots, rows, kv_lens [M] int64; table [R, W] int64; attention's scale, sliding window
// (0 = none) and logit soft cap (0 = none). Returns the layer's output [M, C] and writes the rows' keys and
// values at out_slots of `layer`.
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& norm1,
                        const at::Tensor& norm2, double eps, at::TensorList qweights, at::TensorList scales,
                        const c10::List<std::optional<at::Tensor>>& mins,
                        const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef bits,
                        at::IntArrayRef out_features, at::Tensor& k_pool, at::Tensor& v_pool, int64_t layer,
                        const at::Tensor& out_slots, const at::Tensor& table, const at::Tensor& rows,
                        const at::Tensor& kv_lens, int64_t num_heads, double scale, int64_t window,
                        double soft_cap) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decode_layer: x must be [M, C] float32");
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "decode_layer: contiguous float32 pools [L, S, Hkv, D] expected");
  const int64_t m = x.size(0), c = x.size(1), slots_n = k_pool.size(1), hkv = k_pool.size(2), d = k_pool.size(3);
  const int64_t h = num_heads;
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "decode_layer: layer ", layer, " outside the pool");
  TORCH_CHECK(h > 0 && h % hkv == 0 && d % 2 == 0, "decode_layer: heads or head_dim do not fit the pool");
  TORCH_CHECK(window >= 0 && soft_cap >= 0.0, "decode_layer: window and soft_cap must not be negative");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({m, d}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decode_layer: cos and sin must be [M, head_dim] contiguous float32");
  TORCH_CHECK(norm1.numel() == c && norm2.numel() == c && norm1.is_contiguous() && norm2.is_contiguous() &&
                  norm1.scalar_type() == at::kFloat && norm2.scalar_type() == at::kFloat,
              "decode_layer: norm weights must be [C] float32");
  TORCH_CHECK(qweights.size() == 4 && scales.size() == 4 && mins.size() == 4 && biases.size() == 4 &&
                  bits.size() == 4 && out_features.size() == 4, "decode_layer: four linears expected");
  TORCH_CHECK(out_features[2] % 2 == 0, "decode_layer: gate_up must have an even number of outputs");
  const int64_t inner = out_features[2] / 2;
  const PackedRef w_qkv = linear(qweights, scales, mins, biases, bits, out_features, 0, c, (h + 2 * hkv) * d);
  const PackedRef w_o = linear(qweights, scales, mins, biases, bits, out_features, 1, h * d, c);
  const PackedRef w_gu = linear(qweights, scales, mins, biases, bits, out_features, 2, c, 2 * inner);
  const PackedRef w_down = linear(qweights, scales, mins, biases, bits, out_features, 3, inner, c);
  for (const at::Tensor* t : {&out_slots, &rows, &kv_lens})
    TORCH_CHECK(t->dim() == 1 && t->numel() == m && t->scalar_type() == at::kLong && t->is_contiguous(),
                "decode_layer: out_slots, rows and kv_lens must be [M] contiguous int64");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.stride(1) == 1,
              "decode_layer: table must be [R, W] int64 with contiguous rows");
  const int64_t* slot_p = out_slots.data_ptr<int64_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* len_p = kv_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < slots_n, "decode_layer: slot ", slot_p[r], " outside the pool");
    TORCH_CHECK(row_p[r] >= 0 && row_p[r] < table.size(0), "decode_layer: table row ", row_p[r], " outside the table");
    TORCH_CHECK(len_p[r] >= 1 && len_p[r] <= table.size(1), "decode_layer: kv_len ", len_p[r], " outside [1, ",
                table.size(1), "]");
  }

  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({m, c}, xc.options());
  if (m == 0) return out;
  const int rep = (int)(h / hkv);
  const int64_t q_width = (h + 2 * hkv) * d, kv_stride = hkv * d;
  std::vector<float> normed(m * c), qkv(m * q_width), q(m * h * d), attn(m * h * d), proj(m * c), gate_up(m * 2 * inner),
      act(m * inner);
  QuantBuffer in_c(m, c), in_o(m, h * d), in_inner(m, inner);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  const float* n1 = norm1.data_ptr<float>();
  const float* n2 = norm2.data_ptr<float>();
  float* kl = k_pool.data_ptr<float>() + layer * slots_n * kv_stride;
  float* vl = v_pool.data_ptr<float>() + layer * slots_n * kv_stride;
  const int64_t* table_p = table.data_ptr<int64_t>();
  const int64_t table_stride = table.stride(0);
  const float eps_f = (float)eps, scale_f = (float)scale, cap_f = (float)soft_cap;

  // Small batches split each request's keys into parts, so that a few (request, KV head) pairs still fill every
  // thread (batch 1 of SmolLM2: three KV heads on two threads). The split depends on the batch and the
  // lengths only, never on the thread count: any count gives the same output bit for bit. With a sliding window
  // a row's keys are only its last `window` ones.
  std::vector<KeyPart> parts;
  std::vector<int64_t> splits;  // index of the first part of each (request, KV head) split in more than one
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < hkv; ++g) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, len_p[r] - window) : 0, n = len_p[r] - first;
      const int64_t count = m * hkv < kSplitBelowPairs ? std::max<int64_t>(1, n / kKeysPerPart) : 1;
      if (count > 1) splits.push_back((int64_t)parts.size());
      for (int64_t i = 0; i < count; ++i)
        parts.push_back(KeyPart{r, g, first + n * i / count, first + n * (i + 1) / count, count});
    }
  std::vector<float> part_out(parts.size() * rep * d), part_stats(parts.size() * 2 * rep);

  at::internal::lazy_init_num_threads();
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    int64_t b, e;
    thread_local std::vector<float> scores;

    share(m, tid, nth, b, e);  // input norm, quantized for the QKV projection
    for (int64_t r = b; r < e; ++r) {
      std::memcpy(op + r * c, xp + r * c, sizeof(float) * c);
      rms_norm(op + r * c, n1, c, eps_f, normed.data() + r * c);
      in_c.quantize(normed.data() + r * c, r, 0, in_c.kb);
    }
#pragma omp barrier
    share(w_qkv.tiles, tid, nth, b, e);
    ringserve_cpu::linear_tiles(w_qkv, in_c.rows(), m, b, e, qkv.data());
#pragma omp barrier
    share(m * hkv, tid, nth, b, e);  // per (request, KV head): rotary and the KV write
    for (int64_t w = b; w < e; ++w) {
      const int64_t r = w / hkv, g = w % hkv;
      const float* row = qkv.data() + r * q_width;
      const float* cr = cos_p + r * d;
      const float* sr = sin_p + r * d;
      for (int64_t j = g * rep; j < (g + 1) * rep; ++j) rotary(row + j * d, cr, sr, d, q.data() + (r * h + j) * d);
      rotary(row + (h + g) * d, cr, sr, d, kl + slot_p[r] * kv_stride + g * d);
      std::memcpy(vl + slot_p[r] * kv_stride + g * d, row + (h + hkv + g) * d, sizeof(float) * d);
    }
#pragma omp barrier
    share((int64_t)parts.size(), tid, nth, b, e);  // attention, per (request, KV head, part of the keys)
    for (int64_t w = b; w < e; ++w) {
      const KeyPart& p = parts[w];
      const int64_t n = p.end - p.begin;
      if ((int64_t)scores.size() < rep * n) scores.resize(rep * n);
      const bool whole = p.count == 1;
      ringserve_cpu::attend_head_group(q.data() + (p.row * h + p.head * rep) * d, d, kl + p.head * d, vl + p.head * d,
                                       kv_stride, table_p + row_p[p.row] * table_stride + p.begin, n, rep, (int)d,
                                       scale_f, cap_f, whole ? attn.data() + (p.row * h + p.head * rep) * d
                                                      : part_out.data() + w * rep * d,
                                       scores.data(), whole ? nullptr : part_stats.data() + w * 2 * rep);
    }
#pragma omp barrier
    share((int64_t)splits.size(), tid, nth, b, e);  // the parts of a split (request, KV head) combined
    for (int64_t w = b; w < e; ++w) combine(splits[w], parts, part_out.data(), part_stats.data(), rep, d, h,
                                            attn.data());
#pragma omp barrier
    share(m * in_o.kb, tid, nth, b, e);  // the attention output quantized, block by block
    for (int64_t w = b; w < e; ++w) {
      const int64_t r = w / in_o.kb, blk = w % in_o.kb;
      in_o.quantize(attn.data() + r * h * d, r, blk, blk + 1);
    }
#pragma omp barrier
    share(w_o.tiles, tid, nth, b, e);
    ringserve_cpu::linear_tiles(w_o, in_o.rows(), m, b, e, proj.data());
#pragma omp barrier
    share(m, tid, nth, b, e);  // residual, post-attention norm, quantized for gate/up
    for (int64_t r = b; r < e; ++r) {
      for (int64_t i = 0; i < c; ++i) op[r * c + i] += proj[r * c + i];
      rms_norm(op + r * c, n2, c, eps_f, normed.data() + r * c);
      in_c.quantize(normed.data() + r * c, r, 0, in_c.kb);
    }
#pragma omp barrier
    share(w_gu.tiles, tid, nth, b, e);
    ringserve_cpu::linear_tiles(w_gu, in_c.rows(), m, b, e, gate_up.data());
#pragma omp barrier
    share(m * in_inner.kb, tid, nth, b, e);  // SiLU(gate) * up, quantized for down, block by block
    for (int64_t w = b; w < e; ++w) {
      const int64_t r = w / in_inner.kb, blk = w % in_inner.kb;
      const int64_t i0 = blk * kQK, n = std::min<int64_t>(kQK, inner - i0);
      const float* gu = gate_up.data() + r * 2 * inner;
      silu_mul_avx2(gu + i0, gu + inner + i0, n, act.data() + r * inner + i0);
      in_inner.quantize(act.data() + r * inner, r, blk, blk + 1);
    }
#pragma omp barrier
    share(w_down.tiles, tid, nth, b, e);
    ringserve_cpu::linear_tiles(w_down, in_inner.rows(), m, b, e, proj.data());
#pragma omp barrier
    share(m, tid, nth, b, e);
    for (int64_t r = b; r < e; ++r)
      for (int64_t i = 0; i < c; ++i) op[r * c + i] += proj[r * c + i];
  }
  return out;
}

}  // namespace

// The schema and fake implementation are in kernels/cpu/__init__.py; the torch reference (registered instead
// when this library cannot be built) is in kernels/cpu/decode_layer.py.
TORCH_LIBRARY_IMPL(ringserve_cpu, CPU, m) { m.impl("decode_layer", &decode_layer); }
