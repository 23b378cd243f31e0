// The paged decode attention kernel's inner routine (paged_attention.cpp), for other kernels to call from
// inside their own parallel regions (decode_layer.cpp).
#pragma once

#include <cstdint>

namespace ringserve_cpu {

// One request's `rep` query heads that share one KV head: q [rep][d] (rows `q_stride` apart) attends to the K/V
// rows at `k + slots[j] * kv_stride`, `v + slots[j] * kv_stride` for j < n; out like q. `scores` holds rep * n
// floats of scratch. Scores are `scale` * q . k, then soft_cap * tanh(score / soft_cap) when `soft_cap` > 0. AVX2 +
// FMA when the CPU has them and d is a multiple of 8, scalar loops otherwise. A sliding window is the caller's:
// it passes only the window's slots.
// With `stats` (2 * rep floats) it attends to a part of the keys: `out` is left unnormalized, the sum of
// exp(score - max) weighted V rows, and stats[2r], stats[2r + 1] get head r's max score and sum of weights, so
// parts over disjoint keys combine into the softmax over all of them.
void attend_head_group(const float* q, int64_t q_stride, const float* k, const float* v, int64_t kv_stride,
                       const int64_t* slots, int64_t n, int rep, int d, float scale, float soft_cap, float* out,
                       float* scores, float* stats = nullptr);

}  // namespace ringserve_cpu
