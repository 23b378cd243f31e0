// The quantized linear kernels of qgemm.cpp, for other kernels to call from inside their own parallel regions
// (decode_layer.cpp): activation quantization per block of 32, and the packed weight's output tiles.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace ringserve_cpu {

constexpr int kQK = 32;    // weights and activations per group
constexpr int kTile = 16;  // output rows per packed tile

// Activations of M rows quantized per block of 32: q (int8, K padded to whole blocks), d (fp32 scale),
// s (sum of the block's q, which the offset weights' correction and q4_1's min term need).
struct QuantRows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t kp, kb;
};

// A packed weight (kernels/cpu/packing.py) as raw pointers; `kind` 0 q8_0, 1 q4_0, 2 q4_1.
struct PackedRef {
  const uint8_t* w;
  const uint16_t* scales;
  const uint16_t* mins;  // q4_1 only
  const float* bias;     // or nullptr
  int64_t out_features, in_features, kb, tiles, block_bytes;
  int kind;
};

// Checks a packed weight's tensors against `out_features` x `in_features` and `bits` (8, or 4: q4_1 when `mins`
// is given); their storage must outlive the returned pointers. `bias` (float32, contiguous) may be undefined.
PackedRef packed_ref(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     const at::Tensor& bias, int64_t out_features, int64_t in_features, int64_t bits);

// Quantizes blocks [b0, b1) of one row x [k] (a last partial block zero-padded) into q/d/s, which point at
// the row's block 0. One thread.
void quantize_row_blocks(const float* x, int64_t k, int64_t b0, int64_t b1, int8_t* q, float* d, int32_t* s);

// Whether the kernels run their AVX-512 path (set_isa may force AVX2 on a host that has AVX-512 VNNI).
bool isa_is_avx512();

// y[M, out_features] (row stride out_features) for output tiles [t0, t1) of `w`, from M quantized rows. One
// thread; tiles are the unit to split across threads.
void linear_tiles(const PackedRef& w, const QuantRows& a, int64_t m, int64_t t0, int64_t t1, float* y);

}  // namespace ringserve_cpu
