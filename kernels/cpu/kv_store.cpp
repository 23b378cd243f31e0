// The CPU kernel of `ringserve::store_kv` (schema and torch implementation: kernels/attention/kv_store.py):
// copies a step's new keys and values `[T, Hkv, D]` into slots `slots` `[T]` of one layer of the pools
// `[L, S, Hkv, D]`, in place.
//
// A compiled decode graph calls the op once per layer. Its torch implementation runs in Python (two selects
// and two index_copy_ under the GIL): ~46 us a call, 1.4 ms of a 14 ms batch-1 step. Here a call is a few
// row copies: one memcpy of Hkv * D floats per token and pool, when each token's heads lie contiguously
// (what the graph passes: views into the fused QKV projection's output); other layouts and dtypes take the
// same index_copy_ from C++.

#include <ATen/core/Tensor.h>
#include <ATen/ops/index_copy.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// Whether `x` [T, Hkv, D] has each token's Hkv * D values contiguous, in the pool's dtype.
bool rows_contiguous(const at::Tensor& x, const at::Tensor& pool) {
  return x.dim() == 3 && x.scalar_type() == pool.scalar_type() && x.size(1) == pool.size(2) &&
         x.size(2) == pool.size(3) && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

void store_kv(at::Tensor& k_pool, at::Tensor& v_pool, int64_t layer, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "store_kv: pools [L, S, Hkv, D] expected");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "store_kv: layer ", layer, " outside [0, ", k_pool.size(0), ")");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "store_kv: int64 slots [T] expected");
  TORCH_CHECK(k.size(0) == slots.size(0) && v.size(0) == slots.size(0), "store_kv: one slot per token");
  const bool fast = k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous() &&
                    rows_contiguous(k, k_pool) && rows_contiguous(v, v_pool);
  if (!fast) {
    k_pool.select(0, layer).index_copy_(0, slots, k);
    v_pool.select(0, layer).index_copy_(0, slots, v);
    return;
  }
  const int64_t num_slots = k_pool.size(1), tokens = slots.size(0);
  const int64_t row = k_pool.size(2) * k_pool.size(3), bytes = row * (int64_t)k_pool.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "store_kv: slot ", sp[t], " outside [0, ", num_slots, ")");
  auto* kd = static_cast<char*>(k_pool.data_ptr()) + layer * num_slots * bytes;
  auto* vd = static_cast<char*>(v_pool.data_ptr()) + layer * num_slots * bytes;
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_step = k.stride(0) * (int64_t)k.element_size(), v_step = v.stride(0) * (int64_t)v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kd + sp[t] * bytes, ks + t * k_step, bytes);
    std::memcpy(vd + sp[t] * bytes, vs + t * v_step, bytes);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(ringserve, CPU, m) { m.impl("store_kv", &store_kv); }
