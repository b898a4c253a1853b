// Every decoder layer of a decode-only step in one call.
//
// With quantized weights a batch-1 decode step is about 5 ms of weight multiplies; driven
// from Python, its 30 layers' 300 kernel calls (norms, projections, rotary and cache write,
// attention, SiLU gate, residual adds) cost another 2 to 3 ms of interpreter and dispatcher
// time. This runs the same kernels, in the same order on the same buffers, from C++: the
// arithmetic, and so every logit bit, is what the per-layer path computes.
//
// Every architecture's layer is the Llama one with optional parts, each given per layer or
// absent (None): Qwen2's q/k/v bias, Qwen3's and Gemma 3's per-head q and k norms, Gemma's
// norms of the attention and MLP outputs, its tanh-GELU gate, its local RoPE table and
// sliding windows. A projection is one or more pieces, each in its own block format and
// writing its own columns (a GGUF fuses q in Q5_0 with v in Q8_0).

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

// The four projections of a layer, in the order of `counts`: qkv, o, gate_up, down.
constexpr int kProjections = 4;

// Each piece's panels (panels.cpp), None where it has none; all three lists empty where the
// step does not run on panels (the caller decides by its row count).
struct PanelLists {
  const OptionalTensors& q;
  const OptionalTensors& scales;
  const OptionalTensors& offsets;
};

// One projection: x [T, K] times each piece's panels, where given, or its blocks into its
// columns of out [T, N].
struct Pieces {
  at::TensorList blocks;
  const std::vector<std::string>& formats;
  PanelLists panels;
  std::vector<int64_t> first;  // index of each (layer, projection)'s first piece, and the end

  Pieces(at::TensorList b, const std::vector<std::string>& f, at::IntArrayRef counts,
         PanelLists pl)
      : blocks(b), formats(f), panels(pl) {
    first.push_back(0);
    for (const int64_t c : counts) first.push_back(first.back() + c);
    const size_t n = panels.q.empty() ? 0 : blocks.size();  // none: no panels at all
    TORCH_CHECK(first.back() == static_cast<int64_t>(blocks.size()) &&
                    blocks.size() == formats.size() && panels.q.size() == n &&
                    panels.scales.size() == n && panels.offsets.size() == n,
                "decode_stack: piece counts, blocks, formats and panels disagree");
  }

  void piece(int64_t p, const at::Tensor& x, const at::Tensor& out) const {
    const std::optional<at::Tensor> q =
        panels.q.empty() ? std::nullopt : panels.q.get(p);
    if (q.has_value()) {
      nanoserve::panel_linear(x, *q, *panels.scales.get(p), panels.offsets.get(p), out);
    } else {
      nanoserve::quant_linear(x, blocks[p], formats[p], out);
    }
  }

  // The output columns of (layer, projection): every piece's rows.
  int64_t columns(int64_t layer, int projection) const {
    const int64_t i = layer * kProjections + projection;
    int64_t n = 0;
    for (int64_t p = first[i]; p < first[i + 1]; ++p) n += blocks[p].size(0);
    return n;
  }

  void run(int64_t layer, int projection, const at::Tensor& x, const at::Tensor& out) const {
    const int64_t i = layer * kProjections + projection;
    if (first[i + 1] - first[i] == 1) {  // one format: straight into out
      piece(first[i], x, out);
      return;
    }
    int64_t col = 0;
    for (int64_t p = first[i]; p < first[i + 1]; ++p) {
      const int64_t n = blocks[p].size(0);
      piece(p, x, out.narrow(1, col, n));
      col += n;
    }
    TORCH_CHECK(col == out.size(1), "decode_stack: a projection's pieces miss its columns");
  }
};

// Entry i of a per-layer list of optional tensors; none where the list is empty.
std::optional<at::Tensor> get(const OptionalTensors& list, int64_t i) {
  if (list.empty()) return std::nullopt;
  return list.get(i);
}

// x [T, hidden] is the residual stream (updated in place); returns the last layer's MLP
// output m (normed, where the model norms it), so that the caller adds it and runs the
// final norm on the rows it wants.
at::Tensor decode_stack(
    const at::Tensor& x, at::TensorList attn_norm, at::TensorList mlp_norm,
    const OptionalTensors& post_attn_norm, const OptionalTensors& post_mlp_norm,
    const OptionalTensors& qkv_bias, const OptionalTensors& q_norm,
    const OptionalTensors& k_norm, at::TensorList blocks, std::vector<std::string> formats,
    at::IntArrayRef counts, const OptionalTensors& panel_q, const OptionalTensors& panel_scales,
    const OptionalTensors& panel_offsets, const at::Tensor& cache,
    const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& local_cos,
    const std::optional<at::Tensor>& local_sin, at::IntArrayRef local_rope,
    at::IntArrayRef windows, const at::Tensor& positions, const at::Tensor& slot_mapping,
    const at::Tensor& rows, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
    double eps, bool gelu) {
  const int64_t layers = static_cast<int64_t>(attn_norm.size()), T = x.size(0);
  const int64_t hidden = x.size(1);
  auto per_layer = [&](size_t n) { return static_cast<int64_t>(n) == layers || n == 0; };
  TORCH_CHECK(layers > 0 && mlp_norm.size() == attn_norm.size() &&
                  static_cast<int64_t>(counts.size()) == kProjections * layers &&
                  static_cast<int64_t>(local_rope.size()) == layers &&
                  static_cast<int64_t>(windows.size()) == layers && per_layer(qkv_bias.size()) &&
                  per_layer(q_norm.size()) && q_norm.size() == k_norm.size() &&
                  per_layer(post_attn_norm.size()) && per_layer(post_mlp_norm.size()) &&
                  cache.dim() == 5 && cache.size(0) == layers,
              "decode_stack: one entry per layer in every list (or none), four piece counts "
              "a layer, and a [L, 2, slots, KV, D] cache");
  const Pieces proj(blocks, formats, counts,
                    PanelLists{panel_q, panel_scales, panel_offsets});
  const auto opts = x.options();
  const int64_t qkv_cols = (heads + 2 * kv_heads) * head_dim;
  at::Tensor h = at::empty({T, hidden}, opts);
  at::Tensor qkv_out = at::empty({T, qkv_cols}, opts);
  at::Tensor q = at::empty({T, heads, head_dim}, opts);
  at::Tensor k = at::empty({T, kv_heads, head_dim}, opts);
  at::Tensor att = at::empty({T, heads, head_dim}, opts);
  at::Tensor a = at::empty({T, hidden}, opts);
  at::Tensor m = at::empty({T, hidden}, opts);
  const at::Tensor gu = at::empty({T, proj.columns(0, 2)}, opts);
  const at::Tensor s = at::empty({T, gu.size(1) / 2}, opts);
  nanoserve::rms_norm(x, attn_norm[0], eps, h);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor k_cache = cache[i][0], v_cache = cache[i][1];
    proj.run(i, 0, h, qkv_out);
    if (const auto bias = get(qkv_bias, i)) qkv_out.add_(*bias);
    const auto qn = get(q_norm, i), kn = get(k_norm, i);
    if (qn && kn) nanoserve::norm_qk_heads(qkv_out, *qn, *kn, heads, kv_heads, eps);
    const bool local = local_rope[i] != 0;
    TORCH_CHECK(!local || (local_cos.has_value() && local_sin.has_value()),
                "decode_stack: a local-RoPE layer needs the local tables");
    nanoserve::rope_store(qkv_out, local ? *local_cos : cos, local ? *local_sin : sin,
                          positions, slot_mapping, k_cache, v_cache, q, k);
    nanoserve::paged_decode_attention(q, k_cache, v_cache, rows, block_tables, context_lens,
                                      block_size, scale, att, windows[i]);
    proj.run(i, 1, att.view({T, heads * head_dim}), a);
    if (const auto pn = get(post_attn_norm, i)) nanoserve::rms_norm(a, *pn, eps, a);
    nanoserve::add_rms_norm(x, a, mlp_norm[i], eps, h);  // x += a
    proj.run(i, 2, h, gu);
    if (gelu) {
      nanoserve::gelu_tanh_mul(gu, s);
    } else {
      nanoserve::silu_mul(gu, s);
    }
    proj.run(i, 3, s, m);
    if (const auto pn = get(post_mlp_norm, i)) nanoserve::rms_norm(m, *pn, eps, m);
    if (i + 1 < layers) nanoserve::add_rms_norm(x, m, attn_norm[i + 1], eps, h);
  }
  return m;
}

// The instruction set this library was built for: what model/native.py asked for, checked.
std::string isa() { return NANOSERVE_ISA_NAME; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def(
      "decode_stack(Tensor(a!) x, Tensor[] attn_norm, Tensor[] mlp_norm, "
      "Tensor?[] post_attn_norm, Tensor?[] post_mlp_norm, Tensor?[] qkv_bias, Tensor?[] q_norm, "
      "Tensor?[] k_norm, Tensor[] blocks, str[] formats, int[] counts, Tensor?[] panel_q, "
      "Tensor?[] panel_scales, Tensor?[] panel_offsets, Tensor(b!) cache, "
      "Tensor cos, Tensor sin, Tensor? local_cos, Tensor? local_sin, int[] local_rope, "
      "int[] windows, Tensor positions, Tensor slot_mapping, Tensor rows, Tensor block_tables, "
      "Tensor context_lens, int block_size, int heads, int kv_heads, int head_dim, float scale, "
      "float eps, bool gelu) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) { m.impl("decode_stack", &decode_stack); }
