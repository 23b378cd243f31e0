// The CPU kernel of `ringserve::lora_shrink_expand` (schema, fake and torch reference: kernels/lora.py): the
// segmented low-rank (LoRA) matmul of a batch mixing adapters, BGMV as in Punica and S-LoRA. In place, each
// token t whose adapter holds slot s >= 0 gets, per fused part p of the linear, y[t, part p] += B_{p,s} (A_{p,s}
// x[t]); a base-model token (slot -1) is left as it is. Only the token's own slot is computed, where the dense
// masked form computed all S slots (and every part's B columns over every output row) for every token.
//
// Layout (actors/engine/lora/lora_linear.py): A [P*S*R, in] and B^T [P*S*R, out], the R rows of part p, slot s
// at (p*S + s)*R; part p's outputs are columns [off_p, off_p + rows_p) of y. B is stored transposed so that
// the expand step reads a slot's rank rows along the outputs, contiguously, and accumulates them without
// horizontal sums.
//
// How: tokens are sorted by slot (a counting sort), so a slot's tokens are read together and its A and B rows
// stay in cache while up to four tokens use every vector loaded. A task is a run of one slot's sorted tokens
// and one part: shrink u[t, p*R + r] = A[(p*S+s)*R + r] . x[t], then expand y[t, part p] += u[t, p] B_{p,s}^T,
// four tokens at a time; tasks are split across threads in one parallel region. float32 and bfloat16 (accumulated in float32); AVX-512 where
// the kernels' ISA is avx512vnni, else AVX2 + FMA, chosen per call as in f32_gemv.cpp. Steps with little work
// (a few decode tokens) run on the calling thread: two parallel regions would cost more than they save.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "qgemm.h"
#include "simd.h"

#define RS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define RS_AVX2 __attribute__((target("avx2,fma")))

namespace {

using bf16 = c10::BFloat16;

constexpr int kTokens = 4;            // tokens per micro-kernel call: every weight vector loaded is used 4 times
constexpr int64_t kMaxRun = 64;       // sorted tokens of one slot per task at most
constexpr int64_t kOutBlock = 64;     // outputs per expand call
constexpr int64_t kSerialMacs = 1 << 17;  // less work than this runs on the calling thread

inline float f32(float v) { return v; }
inline float f32(bf16 v) { return static_cast<float>(v); }

RS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
RS_AVX512 inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
RS_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
RS_AVX512 inline void store16(bf16* p, __m512 v) {  // rounded to nearest even, as c10::BFloat16(float)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

RS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
RS_AVX2 inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
RS_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
RS_AVX2 inline void store8(bf16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// us[m][n] = xs[m] . a[n*k .. n*k + k) for M tokens and N rows of A: one pass over k.
template <typename T, int M, int N>
RS_AVX512 void shrink_avx512(const T* const* xs, const T* a, int64_t k, float* const* us) {
  const int64_t kv = k / 16 * 16;
  __m512 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kv; i += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load16(xs[m] + i);
    for (int n = 0; n < N; ++n) {
      const __m512 wv = load16(a + n * k + i);
      for (int m = 0; m < M; ++m) acc[m][n] = _mm512_fmadd_ps(wv, xv[m], acc[m][n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = _mm512_reduce_add_ps(acc[m][n]);
      for (int64_t i = kv; i < k; ++i) s += f32(xs[m][i]) * f32(a[n * k + i]);
      us[m][n] = s;
    }
}

template <typename T, int M, int N>
RS_AVX2 void shrink_avx2(const T* const* xs, const T* a, int64_t k, float* const* us) {
  const int64_t kv = k / 8 * 8;
  __m256 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < kv; i += 8) {
    __m256 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = load8(xs[m] + i);
    for (int n = 0; n < N; ++n) {
      const __m256 wv = load8(a + n * k + i);
      for (int m = 0; m < M; ++m) acc[m][n] = _mm256_fmadd_ps(wv, xv[m], acc[m][n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float s = ringserve_cpu::hsum_avx2(acc[m][n]);
      for (int64_t i = kv; i < k; ++i) s += f32(xs[m][i]) * f32(a[n * k + i]);
      us[m][n] = s;
    }
}

// ys[m][j] += sum_r us[m][r] * b[r*ldb + j] for j in [0, V*16), M tokens.
template <typename T, int M, int V>
RS_AVX512 void expand_avx512(const float* const* us, const T* b, int64_t ldb, int64_t rank, T* const* ys) {
  __m512 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = load16(ys[m] + 16 * v);
  for (int64_t r = 0; r < rank; ++r) {
    __m512 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load16(b + r * ldb + 16 * v);
    for (int m = 0; m < M; ++m) {
      const __m512 u = _mm512_set1_ps(us[m][r]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(bv[v], u, acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) store16(ys[m] + 16 * v, acc[m][v]);
}

template <typename T, int M, int V>
RS_AVX2 void expand_avx2(const float* const* us, const T* b, int64_t ldb, int64_t rank, T* const* ys) {
  __m256 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = load8(ys[m] + 8 * v);
  for (int64_t r = 0; r < rank; ++r) {
    __m256 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load8(b + r * ldb + 8 * v);
    for (int m = 0; m < M; ++m) {
      const __m256 u = _mm256_set1_ps(us[m][r]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm256_fmadd_ps(bv[v], u, acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) store8(ys[m] + 8 * v, acc[m][v]);
}

// M tokens, `rows` rank rows of A from `a`: us[m][0 .. rows).
template <typename T, int M>
void shrink_rows(bool avx512, const T* const* xs, const T* a, int64_t k, int64_t rows, float* const* us) {
  float* out[M];
  int64_t r = 0;
  auto at = [&](int64_t r0) {
    for (int m = 0; m < M; ++m) out[m] = us[m] + r0;
  };
  if (avx512) {
    for (; r + 4 <= rows; r += 4) at(r), shrink_avx512<T, M, 4>(xs, a + r * k, k, out);
    for (; r < rows; ++r) at(r), shrink_avx512<T, M, 1>(xs, a + r * k, k, out);
  } else {
    for (; r + 2 <= rows; r += 2) at(r), shrink_avx2<T, M, 2>(xs, a + r * k, k, out);
    for (; r < rows; ++r) at(r), shrink_avx2<T, M, 1>(xs, a + r * k, k, out);
  }
}

// M tokens, outputs [0, n) of the block: whole vectors (several, then one), then a scalar tail.
template <typename T, int M>
void expand_outputs(bool avx512, const float* const* us, const T* b, int64_t ldb, int64_t rank, T* const* ys,
                    int64_t n) {
  T* y[M];
  int64_t j = 0;
  auto at = [&](int64_t j0) {
    for (int m = 0; m < M; ++m) y[m] = ys[m] + j0;
  };
  if (avx512) {
    for (; j + 64 <= n; j += 64) at(j), expand_avx512<T, M, 4>(us, b + j, ldb, rank, y);
    for (; j + 16 <= n; j += 16) at(j), expand_avx512<T, M, 1>(us, b + j, ldb, rank, y);
  } else {
    for (; j + 16 <= n; j += 16) at(j), expand_avx2<T, M, 2>(us, b + j, ldb, rank, y);
    for (; j + 8 <= n; j += 8) at(j), expand_avx2<T, M, 1>(us, b + j, ldb, rank, y);
  }
  for (; j < n; ++j)
    for (int m = 0; m < M; ++m) {
      float s = f32(ys[m][j]);
      for (int64_t r = 0; r < rank; ++r) s += us[m][r] * f32(b[r * ldb + j]);
      ys[m][j] = T(s);
    }
}

// A run of sorted tokens [begin, end) sharing one slot.
struct Run {
  int64_t slot, begin, end;
};

// Calls fn<M>(first) for the run's tokens in groups of up to kTokens, M the group's size.
template <typename Fn>
void in_groups(int64_t begin, int64_t end, Fn&& fn) {
  for (int64_t i = begin; i < end; i += kTokens) {
    switch (std::min<int64_t>(kTokens, end - i)) {
      case 1: fn(std::integral_constant<int, 1>(), i); break;
      case 2: fn(std::integral_constant<int, 2>(), i); break;
      case 3: fn(std::integral_constant<int, 3>(), i); break;
      default: fn(std::integral_constant<int, 4>(), i); break;
    }
  }
}

template <typename T>
void bgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const int64_t* ids,
          int64_t slots, int64_t rank, const std::vector<int64_t>& part_rows) {
  const int64_t tokens = x.size(0), k = x.size(1), n_out = y.size(1), parts = part_rows.size();
  // counting sort by slot (the base model's -1 first)
  std::vector<int64_t> count(slots + 2, 0), order(tokens);
  for (int64_t t = 0; t < tokens; ++t) ++count[ids[t] + 2];
  for (int64_t s = 1; s < slots + 2; ++s) count[s] += count[s - 1];
  for (int64_t t = 0; t < tokens; ++t) order[count[ids[t] + 1]++] = t;
  const int64_t adapter_tokens = tokens - count[0];
  const int64_t macs = adapter_tokens * rank * (parts * k + n_out);
  if (macs == 0) return;
  // runs of one slot's sorted tokens, short enough for every thread to get about two (run, part) tasks
  const int64_t threads = macs < kSerialMacs ? 1 : at::get_num_threads();
  const int64_t cap = std::clamp<int64_t>((adapter_tokens * parts / (2 * threads) + kTokens - 1) / kTokens * kTokens,
                                          kTokens, kMaxRun);
  std::vector<Run> runs;
  for (int64_t i = count[0]; i < tokens;) {
    int64_t j = i + 1;
    while (j < tokens && j - i < cap && ids[order[j]] == ids[order[i]]) ++j;
    runs.push_back({ids[order[i]], i, j});
    i = j;
  }
  std::vector<int64_t> offsets(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) offsets[p + 1] = offsets[p] + part_rows[p];
  const bool avx512 = ringserve_cpu::isa_is_avx512();
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<float> u(tokens * parts * rank);  // u[t, p*R + r]: each task writes its own tokens' part
  const int64_t width = parts * rank, tasks = runs.size() * parts;
  // one parallel region per call (each costs a wake-up of every thread); a task needs nothing of another
  at::parallel_for(0, tasks, threads == 1 ? tasks : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const Run& run = runs[task / parts];
      const int64_t p = task % parts, slot_rows = (p * slots + run.slot) * rank;
      in_groups(run.begin, run.end, [&](auto m_const, int64_t i) {
        constexpr int M = decltype(m_const)::value;
        const T* xs[M];
        float* us[M];
        T* ys[M];
        for (int m = 0; m < M; ++m) {
          const int64_t t = order[i + m];
          xs[m] = xp + t * k, us[m] = u.data() + t * width + p * rank, ys[m] = yp + t * n_out;
        }
        shrink_rows<T, M>(avx512, xs, ap + slot_rows * k, k, rank, us);
        const float* const* uc = us;
        for (int64_t o0 = offsets[p]; o0 < offsets[p + 1]; o0 += kOutBlock) {
          T* outs[M];
          for (int m = 0; m < M; ++m) outs[m] = ys[m] + o0;
          expand_outputs<T, M>(avx512, uc, bp + slot_rows * n_out + o0, n_out, rank, outs,
                               std::min(kOutBlock, offsets[p + 1] - o0));
        }
      });
    }
  });
}

void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
                        const at::Tensor& slot_ids, int64_t slots, int64_t rank, at::IntArrayRef part_rows) {
  const int64_t parts = part_rows.size();
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_shrink_expand: x [T, in] and y [T, out] expected, got ", x.sizes(), " and ", y.sizes());
  TORCH_CHECK(parts >= 1 && slots >= 1 && rank >= 1, "lora_shrink_expand: parts, slots and rank must be >= 1");
  TORCH_CHECK(a.dim() == 2 && a.size(0) == parts * slots * rank && a.size(1) == x.size(1),
              "lora_shrink_expand: A [P*S*R, in] = [", parts * slots * rank, ", ", x.size(1), "] expected, got ",
              a.sizes());
  TORCH_CHECK(b_t.dim() == 2 && b_t.size(0) == parts * slots * rank && b_t.size(1) == y.size(1),
              "lora_shrink_expand: B^T [P*S*R, out] = [", parts * slots * rank, ", ", y.size(1), "] expected, got ",
              b_t.sizes());
  int64_t rows = 0;
  for (int64_t r : part_rows) rows += r;
  TORCH_CHECK(rows == y.size(1), "lora_shrink_expand: part_rows sum to ", rows, ", y has ", y.size(1), " outputs");
  const auto dtype = y.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b_t.scalar_type() == dtype,
              "lora_shrink_expand: y, x, A and B^T of one dtype, float32 or bfloat16");
  TORCH_CHECK(slot_ids.dim() == 1 && slot_ids.scalar_type() == at::kLong && slot_ids.size(0) >= x.size(0),
              "lora_shrink_expand: int64 slot_ids with at least one entry per token expected");
  TORCH_CHECK(y.is_contiguous(), "lora_shrink_expand: y (written in place) must be contiguous");
  const at::Tensor xc = x.contiguous(), ac = a.contiguous(), bc = b_t.contiguous();
  const at::Tensor ic = slot_ids.contiguous();
  const int64_t* ids = ic.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(ids[t] >= -1 && ids[t] < slots, "lora_shrink_expand: slot ", ids[t], " of token ", t,
                " outside [-1, ", slots, ")");
  const std::vector<int64_t> rows_of(part_rows.begin(), part_rows.end());
  if (dtype == at::kFloat)
    bgmv<float>(y, xc, ac, bc, ids, slots, rank, rows_of);
  else
    bgmv<bf16>(y, xc, ac, bc, ids, slots, rank, rows_of);
}

}  // namespace

// The op's schema, fake and torch reference are in kernels/lora.py (the reference runs where this library is
// not loaded).
TORCH_LIBRARY_IMPL(ringserve, CPU, m) { m.impl("lora_shrink_expand", &lora_shrink_expand); }
