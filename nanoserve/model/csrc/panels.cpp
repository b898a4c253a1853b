// Quantized weights repacked for many rows of x at once: every projection and the LM head at
// 5 rows or more (model/panels.py has the thresholds and the figures).
//
// quant.cpp's tile kernel takes a GGUF row's blocks as they lie: each output is a dot product
// of a weight row with a row of x, kept as a vector of partial sums and reduced across its
// lanes at the end, and a tile's weights go through an L1 buffer first. On Gemma 3's head
// (262,144 x 640, Q8_0) at 16 rows that ran at 132 GFLOP/s, where float32 sgemm on a cached
// matrix runs at 190: the reductions and the buffer were a third of the work.
//
// Here a weight is laid out the other way round, once, at load (model/unpack.py takes any
// block format apart): 16 output rows side by side, a panel, [N / 16][K][16] int8 quants,
// and each group of 16 weights' scale and offset, [N / 16][K / 16][16] float32 (offsets
// absent for the symmetric formats). One k of a panel is then 16 outputs' weights in one
// vector (two on AVX2): dequantized in registers (a widening, a multiply by the group's
// scales, an add of its offsets) and multiplied by x[r][k] broadcast, for R rows of x at a
// time, R accumulators that are already the outputs: no reduction, no buffer. Each output
// is one chain of fused multiply-adds over k in order.
//
// The weights are exactly quant.cpp's (s * q exact in float32, then the one rounding of the
// offset's addition, as gguf-py), so only the order of the additions differs from the tile
// kernel's; a row's outputs do not depend on which rows share its step.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using nanoserve::load;
using nanoserve::store;
typedef nanoserve::vfloat vf;
constexpr int kW = nanoserve::kLanes;
constexpr int64_t kPanel = 16;  // outputs side by side in a panel
constexpr int64_t kGroup = 16;  // weights of one scale (and offset)
#define NS_INLINE inline __attribute__((always_inline))

// Rows of x per pass over a panel's vector: R accumulators, the weight vector, its scales
// and one broadcast x in the register file (32 zmm, 16 ymm).
#if defined(NANOSERVE_AVX512)
constexpr int kRows = 16;
#else
constexpr int kRows = 12;
#endif

// x with every k's value in one broadcast.
NS_INLINE vf splat(float v) {
#if defined(NANOSERVE_AVX512)
  return (vf)_mm512_set1_ps(v);
#elif defined(NANOSERVE_AVX2)
  return (vf)_mm256_set1_ps(v);
#else
  vf s;
  for (int l = 0; l < kW; ++l) s[l] = v;
  return s;
#endif
}

// out[r][0, kW) = x[r] . the kW weight rows of lanes [lane, lane + kW) of one panel, r < R;
// xt is the R rows of x transposed, [K][kRows] (one k's rows side by side: the broadcasts
// come from one pointer at fixed offsets). A weight is s * q + o of its group of 16: the
// product exact, so fused or not the one rounding is the addition's, as gguf-py's.
template <int R, bool kOffset>
void panel_rows(const float* xt, const int8_t* q, const float* s, const float* o, int64_t K,
                float* out, int64_t os) {
  vf a[R] = {};
  for (int64_t kg = 0; kg < K; kg += kGroup) {
    const vf d = load(s + kg / kGroup * kPanel);
    const vf m = kOffset ? load(o + kg / kGroup * kPanel) : vf{};
    const int8_t* qg = q + kg * kPanel;
    const float* xg = xt + kg * kRows;
#pragma GCC unroll 4
    for (int64_t k = 0; k < kGroup; ++k) {
      const vf q = nanoserve::int8_lanes(qg + k * kPanel);
      const vf w = kOffset ? q * d + m : q * d;
      for (int r = 0; r < R; ++r) a[r] += splat(xg[k * kRows + r]) * w;
    }
  }
  for (int r = 0; r < R; ++r) store(out + r * os, a[r]);
}

template <int R = kRows>
void panel_rows_any(int rows, const float* xt, const int8_t* q, const float* s, const float* o,
                    int64_t K, float* out, int64_t os) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows_any<R - 1>(rows, xt, q, s, o, K, out, os);
  }
  if (o != nullptr) return panel_rows<R, true>(xt, q, s, o, K, out, os);
  panel_rows<R, false>(xt, q, s, o, K, out, os);
}

}  // namespace

namespace nanoserve {

// out[M, N] = x[M, K] @ W^T, W given as its panels: q [N / 16, K, 16] int8, scales and
// offsets (none: zero) [N / 16, K / 16, 16] float32. Panels are split among threads.
void panel_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                  const std::optional<at::Tensor>& offsets, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "panel_linear: x must be float32 [M, K] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), P = q.size(0), N = P * kPanel;
  TORCH_CHECK(K % kGroup == 0, "panel_linear: K = ", K, " is not a multiple of 16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.is_contiguous() &&
                  q.size(1) == K && q.size(2) == kPanel,
              "panel_linear: q must be contiguous int8 [N / 16, K, 16]");
  for (const at::Tensor* t : {&scales, offsets ? &*offsets : &scales}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == P && t->size(1) == K / kGroup && t->size(2) == kPanel,
                "panel_linear: scales and offsets must be contiguous float32 "
                "[N / 16, K / 16, 16]");
  }
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == M && out.size(1) == N,
              "panel_linear: out must be float32 [M, N]");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = offsets ? offsets->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0), groups = K / kGroup;
  // x transposed in blocks of kRows rows, [M / kRows][K][kRows]: read by every panel.
  const int64_t blocks = (M + kRows - 1) / kRows;
  std::vector<float> xt(blocks * K * kRows, 0.0f);
  for (int64_t r = 0; r < M; ++r) {
    float* dst = xt.data() + r / kRows * K * kRows + r % kRows;
    for (int64_t k = 0; k < K; ++k) dst[k * kRows] = xp[r * xs + k];
  }
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t lane = 0; lane < kPanel; lane += kW) {
        const int8_t* qv = qp + p * K * kPanel + lane;
        const float* sv = sp + p * groups * kPanel + lane;
        const float* mv = mp ? mp + p * groups * kPanel + lane : nullptr;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t r = b * kRows;
          panel_rows_any(static_cast<int>(std::min<int64_t>(kRows, M - r)),
                         xt.data() + b * K * kRows, qv, sv, mv, K,
                         op + r * os + p * kPanel + lane, os);
        }
      }
    }
  });
}

}  // namespace nanoserve

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def("panel_linear(Tensor x, Tensor q, Tensor scales, Tensor? offsets, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) {
  m.impl("panel_linear", &nanoserve::panel_linear);
}
