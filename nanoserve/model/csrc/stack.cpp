// Every decoder layer of a decode-only step in one call.
//
// With quantized weights a batch-1 decode step is about 5 ms of weight multiplies; driven
// from Python, its 30 layers' 300 kernel calls (norms, projections, rotary and cache write,
// attention, SiLU gate, residual adds) cost another 2 to 3 ms of interpreter and dispatcher
// time. This runs the same kernels, in the same order on the same buffers, from C++: the
// arithmetic, and so every logit bit, is what the per-layer path computes.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "kernels.h"
#include "vec.h"

namespace {

// x [T, hidden] is the residual stream (updated in place); returns the last layer's MLP
// output m, so that the caller adds it and runs the final norm on the rows it wants.
at::Tensor decode_stack(const at::Tensor& x, at::TensorList attn_norm, at::TensorList qkv,
                        at::TensorList o, at::TensorList mlp_norm, at::TensorList gate_up,
                        at::TensorList down, const std::string& format, const at::Tensor& cache,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                        const at::Tensor& slot_mapping, const at::Tensor& rows,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        double scale, double eps) {
  const int64_t layers = static_cast<int64_t>(qkv.size()), T = x.size(0), hidden = x.size(1);
  TORCH_CHECK(layers > 0 && attn_norm.size() == qkv.size() && o.size() == qkv.size() &&
                  mlp_norm.size() == qkv.size() && gate_up.size() == qkv.size() &&
                  down.size() == qkv.size() && cache.dim() == 5 && cache.size(0) == layers,
              "decode_stack: one entry per layer in every list, and a [L, 2, slots, KV, D] cache");
  const int64_t inter = gate_up[0].size(0) / 2;
  const auto opts = x.options();
  at::Tensor h = at::empty({T, hidden}, opts);
  at::Tensor qkv_out = at::empty({T, (heads + 2 * kv_heads) * head_dim}, opts);
  at::Tensor q = at::empty({T, heads, head_dim}, opts);
  at::Tensor k = at::empty({T, kv_heads, head_dim}, opts);
  at::Tensor att = at::empty({T, heads, head_dim}, opts);
  at::Tensor a = at::empty({T, hidden}, opts);
  at::Tensor gu = at::empty({T, 2 * inter}, opts);
  at::Tensor s = at::empty({T, inter}, opts);
  at::Tensor m = at::empty({T, hidden}, opts);
  nanoserve::rms_norm(x, attn_norm[0], eps, h);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor k_cache = cache[i][0], v_cache = cache[i][1];
    nanoserve::quant_linear(h, qkv[i], format, qkv_out);
    nanoserve::rope_store(qkv_out, cos, sin, positions, slot_mapping, k_cache, v_cache, q, k);
    nanoserve::paged_decode_attention(q, k_cache, v_cache, rows, block_tables, context_lens,
                                      block_size, scale, att, /*window=*/0);
    nanoserve::quant_linear(att.view({T, heads * head_dim}), o[i], format, a);
    nanoserve::add_rms_norm(x, a, mlp_norm[i], eps, h);  // x += a
    nanoserve::quant_linear(h, gate_up[i], format, gu);
    nanoserve::silu_mul(gu, s);
    nanoserve::quant_linear(s, down[i], format, m);
    if (i + 1 < layers) nanoserve::add_rms_norm(x, m, attn_norm[i + 1], eps, h);
  }
  return m;
}

// The instruction set this library was built for: what model/native.py asked for, checked.
std::string isa() { return NANOSERVE_ISA_NAME; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def(
      "decode_stack(Tensor(a!) x, Tensor[] attn_norm, Tensor[] qkv, Tensor[] o, "
      "Tensor[] mlp_norm, Tensor[] gate_up, Tensor[] down, str format, Tensor(b!) cache, "
      "Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, Tensor rows, "
      "Tensor block_tables, Tensor context_lens, int block_size, int heads, int kv_heads, "
      "int head_dim, float scale, float eps) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) { m.impl("decode_stack", &decode_stack); }
