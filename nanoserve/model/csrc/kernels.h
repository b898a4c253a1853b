// nanoserve's CPU kernels as C++ functions, for kernels that call kernels (stack.cpp) without
// a round trip through Python and the dispatcher. Each is also a torch.ops.nanoserve op.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace nanoserve {

// layers.cpp
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out);
void add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                  double eps, const at::Tensor& out);
void rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& positions, const at::Tensor& slot_mapping,
                const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_out,
                const at::Tensor& k_out);
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out);
void gelu_tanh_mul(const at::Tensor& gate_up, const at::Tensor& out);
void norm_qk_heads(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                   int64_t heads, int64_t kv_heads, double eps);

// attention.cpp
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& rows,
                            const at::Tensor& block_tables, const at::Tensor& context_lens,
                            int64_t block_size, double scale, const at::Tensor& out,
                            int64_t window);  // 0: none; else each row's last `window` keys

// quant.cpp
void quant_linear(const at::Tensor& x, const at::Tensor& blocks, const std::string& format,
                  const at::Tensor& out);
void dequantize(const at::Tensor& blocks, const std::string& format, const at::Tensor& out);

// q8dot.cpp: one row of x rounded to int8 against a weight's blocks (`--int8-activations`)
bool q8_format(const std::string& format);
void q8_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& format,
             bool vnni, const at::Tensor& out);

// panels.cpp
void panel_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                  const std::optional<at::Tensor>& offsets, const at::Tensor& out);

}  // namespace nanoserve
