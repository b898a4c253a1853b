// The elementwise parts of a Llama layer, fused, float32 on the CPU.
//
// Written with stock PyTorch ops, a layer's RMS norms, rotary embedding, cache writes,
// residual adds and SiLU gate are about 30 small operators: at batch 1 each costs more in
// dispatch than in arithmetic (a third of a decode step went there), and at prefill sizes
// each is a pass over memory. Here each is one pass: one call, one read and one write.
// They compute what the reference computes, in float32, in a different order of rounding
// (sums of squares by lanes, fused multiply-adds).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "vec.h"

namespace {

using nanoserve::exp_nonpositive;
using nanoserve::hsum;
using nanoserve::kLanes;
using nanoserve::load;
using nanoserve::store;
using nanoserve::vfloat;

void check_rows(const at::Tensor& t, int64_t cols, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.scalar_type() == at::kFloat &&
                  t.stride(1) == 1,
              name, ": float32 [T, ", cols, "] with unit column stride");
}

// out = weight * x / sqrt(mean(x^2) + eps) over one row of `cols`; first x += delta when
// delta is given. out may be x itself (each value is read before it is written).
inline void norm_row(float* xr, const float* dr, const float* wp, int64_t cols, float eps,
                     float* orow) {
  vfloat squares = {};
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes) {
    vfloat v = load(xr + c);
    if (dr != nullptr) {
      v += load(dr + c);
      store(xr + c, v);
    }
    squares += v * v;
  }
  float tail = 0.0f;
  for (; c < cols; ++c) {
    if (dr != nullptr) xr[c] += dr[c];
    tail += xr[c] * xr[c];
  }
  const float mean = (hsum(squares) + tail) / static_cast<float>(cols);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (c = 0; c + kLanes <= cols; c += kLanes) {
    store(orow + c, load(wp + c) * (load(xr + c) * inv));
  }
  for (; c < cols; ++c) orow[c] = wp[c] * (xr[c] * inv);
}

// out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps); first x[t] += delta[t] when given.
void norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
               double eps, const at::Tensor& out) {
  const int64_t rows = x.size(0), cols = x.size(1);
  check_rows(x, cols, "x");
  check_rows(out, cols, "out");
  TORCH_CHECK(out.size(0) == rows && weight.numel() == cols && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "out and weight must match x");
  if (delta != nullptr) {
    check_rows(*delta, cols, "delta");
    TORCH_CHECK(delta->size(0) == rows, "delta must match x");
  }
  float* xp = x.data_ptr<float>();
  const float* dp = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = delta != nullptr ? delta->stride(0) : 0;
  const int64_t os = out.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      norm_row(xp + t * xs, dp != nullptr ? dp + t * ds : nullptr, wp, cols, feps, op + t * os);
    }
  });
}

}  // namespace

namespace nanoserve {

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  norm_rows(x, nullptr, weight, eps, out);
}

void add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, const at::Tensor& out) {
  norm_rows(x, &delta, weight, eps, out);
}

// The rotary embedding of q and k in the rotate-half layout (dimension i pairs with
// i + D/2), k and v written to their cache slots, q and k also written out for the step.
// qkv [T, (H + 2 KV) * D] is the fused projection's output; cos and sin [P, D] the tables
// for every position.
void rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& positions, const at::Tensor& slot_mapping,
                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_out,
                const at::Tensor& k_out) {
  TORCH_CHECK(q_out.dim() == 3 && k_out.dim() == 3 && k_cache.dim() == 3, "3-d q, k, cache");
  const int64_t tokens = qkv.size(0), heads = q_out.size(1), kv_heads = k_out.size(1);
  const int64_t dim = q_out.size(2), half = dim / 2;
  check_rows(qkv, (heads + 2 * kv_heads) * dim, "qkv");
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.size(0) == tokens &&
                  k_out.size(0) == tokens && k_out.size(2) == dim,
              "q_out [T, H, D] and k_out [T, KV, D], contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(1) == kv_heads &&
                  k_cache.size(2) == dim && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "caches [slots, KV, D], float32, contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(1) == dim && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "cos and sin [P, D], float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens,
              "positions and slot_mapping: [T] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of range");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(0), "slot out of range");
  }
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  const int64_t stride = qkv.stride(0), kv_width = kv_heads * dim;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = src + t * stride;
      const float* c = cp + pos[t] * dim;
      const float* s = sp + pos[t] * dim;
      // One head vector: out[i] = x[i] c[i] - x[i + D/2] s[i],
      //                  out[i + D/2] = x[i + D/2] c[i + D/2] + x[i] s[i + D/2].
      auto rotate = [&](const float* x, float* out) {
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const vfloat a = load(x + i), b = load(x + half + i);
          store(out + i, a * load(c + i) - b * load(s + i));
          store(out + half + i, b * load(c + half + i) + a * load(s + half + i));
        }
        for (; i < half; ++i) {
          const float a = x[i], b = x[half + i];
          out[i] = a * c[i] - b * s[i];
          out[half + i] = b * c[half + i] + a * s[half + i];
        }
      };
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, qo + (t * heads + h) * dim);
      float* kt = ko + t * kv_width;
      for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * dim, kt + h * dim);
      std::memcpy(kc + slots[t] * kv_width, kt, kv_width * sizeof(float));
      std::memcpy(vc + slots[t] * kv_width, row + (heads + kv_heads) * dim,
                  kv_width * sizeof(float));
    }
  });
}

// The q and k heads of qkv [T, (H + 2 KV) * D] each RMS-normed over its D values, in place
// (Qwen3's and Gemma 3's q_norm and k_norm, before RoPE); v is left as it is. Per head the
// arithmetic of rms_norm on a [*, D] tensor.
void norm_qk_heads(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                   int64_t heads, int64_t kv_heads, double eps) {
  const int64_t dim = q_norm.numel(), tokens = qkv.size(0);
  check_rows(qkv, (heads + 2 * kv_heads) * dim, "qkv");
  TORCH_CHECK(k_norm.numel() == dim && q_norm.is_contiguous() && k_norm.is_contiguous() &&
                  q_norm.scalar_type() == at::kFloat && k_norm.scalar_type() == at::kFloat,
              "q_norm and k_norm: float32 [D]");
  float* base = qkv.data_ptr<float>();
  const float* qw = q_norm.data_ptr<float>();
  const float* kw = k_norm.data_ptr<float>();
  const int64_t stride = qkv.stride(0), normed = heads + kv_heads;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, tokens * normed, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / normed, h = i % normed;
      float* head = base + t * stride + h * dim;
      norm_row(head, nullptr, h < heads ? qw : kw, dim, feps, head);
    }
  });
}

// out = act(gate) * up for gate_up [T, 2 I] holding gate then up: `vec` is the activation
// kLanes at a time, `one` the same for the tail.
template <class Vec, class One>
void gate_rows(const at::Tensor& gate_up, const at::Tensor& out, Vec vec, One one) {
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  check_rows(gate_up, 2 * inter, "gate_up");
  check_rows(out, inter, "out");
  TORCH_CHECK(out.size(0) == rows, "out [T, I] for gate_up [T, 2 I]");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * gs;
      float* o = op + t * os;
      int64_t i = 0;
      for (; i + kLanes <= inter; i += kLanes) store(o + i, vec(load(g + i)) * load(g + inter + i));
      for (; i < inter; ++i) o[i] = one(g[i]) * g[inter + i];
    }
  });
}

// Gemma's GeGLU: gelu's tanh approximation, gelu(x) = x / 2 (1 + tanh(y)) with
// y = sqrt(2 / pi) (x + 0.044715 x^3). With e = e^-2|y| in (0, 1], 1 + tanh(y) is
// 2 / (1 + e) for y >= 0 and 2 e / (1 + e) below: no overflow, and no cancellation where
// tanh(y) nears -1 (the tail that 1 + tanh would round to zero).
void gelu_tanh_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  gate_rows(
      gate_up, out,
      [](vfloat x) {
        const vfloat y = kSqrt2OverPi * (x + kCubic * (x * x * x));
        const vfloat e = exp_nonpositive(-2.0f * (y < 0.0f ? -y : y));
        return 0.5f * x * ((y < 0.0f ? 2.0f * e : vfloat{} + 2.0f) / (1.0f + e));
      },
      [](float x) {
        const float y = kSqrt2OverPi * (x + kCubic * (x * x * x));
        const float e = std::exp(-2.0f * std::fabs(y));
        return 0.5f * x * ((y < 0.0f ? 2.0f * e : 2.0f) / (1.0f + e));
      });
}

// SiLU's gate: silu(x) = x / (1 + e^-x), from e^-|x| so that the exponential never
// overflows.
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  gate_rows(
      gate_up, out,
      [](vfloat x) {
        const vfloat e = exp_nonpositive(x < 0.0f ? x : -x);  // e^-|x|, in (0, 1]
        return (x < 0.0f ? x * e : x) / (1.0f + e);  // x e^x / (1 + e^x) when x < 0
      },
      [](float x) { return x / (1.0f + std::exp(-x)); });
}

}  // namespace nanoserve

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def(
      "rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) q_out, Tensor(d!) k_out) -> ()");
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("gelu_tanh_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def(
      "norm_qk_heads(Tensor(a!) qkv, Tensor q_norm, Tensor k_norm, int heads, int kv_heads, "
      "float eps) -> ()");
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) {
  m.impl("rms_norm", &nanoserve::rms_norm);
  m.impl("add_rms_norm", &nanoserve::add_rms_norm);
  m.impl("rope_store", &nanoserve::rope_store);
  m.impl("silu_mul", &nanoserve::silu_mul);
  m.impl("gelu_tanh_mul", &nanoserve::gelu_tanh_mul);
  m.impl("norm_qk_heads", &nanoserve::norm_qk_heads);
}
