// Decode attention straight over the paged KV cache, float32 on the CPU.
//
// A decode row has one query per head and attends to its whole context (or, on a layer with
// a sliding window, the last `window` positions of it), which lies in the cache in blocks
// scattered over the pool. Done with stock PyTorch ops, each step gathers
// every row's blocks into a padded copy, masks the padding and calls SDPA: the copy is a
// read and a write of every context byte, and SDPA's flash kernel, built for long queries,
// runs slowly at one query. Here each (row, KV head) reads its keys and values once, in
// place, through the block table: scores, softmax and the weighted sum of values, with the
// G query heads that share the KV head computed together so that a key is loaded once for
// all of them. The work items are split over the intra-op threads.
//
// Summation order differs from SDPA's, so results agree to float32 rounding, not bit for
// bit; the engine's token-identity tests against the reference run on this kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using nanoserve::exp_nonpositive;
using nanoserve::hmax;
using nanoserve::hsum;
using nanoserve::kLanes;
using nanoserve::load;
using nanoserve::store;
using nanoserve::vfloat;

// s[i] = e^(s[i] - max s) / sum for i < n: a softmax in place. n is padded up to a multiple
// of kLanes by the caller, the padding being -inf (e^-inf becomes e^-87, a 1e-38 weight,
// and the padded values are never used).
inline void softmax(float* __restrict s, int64_t n) {
  vfloat m = load(s);
  for (int64_t i = kLanes; i < n; i += kLanes) {
    const vfloat x = load(s + i);
    m = x > m ? x : m;
  }
  const float max = hmax(m);
  vfloat sum = {};
  for (int64_t i = 0; i < n; i += kLanes) {
    const vfloat e = exp_nonpositive(load(s + i) - max);
    store(s + i, e);
    sum += e;
  }
  const float inv = 1.0f / hsum(sum);
  for (int64_t i = 0; i < n; i += kLanes) store(s + i, load(s + i) * inv);
}

// One (row, KV head): its `group` query heads against context positions [first, ctx),
// through the block table (first > 0 only where a sliding window binds; with first == 0 every
// loop runs exactly as without a window, so the result is bit for bit the same).
// kDim / kLanes vectors per head vector, known at compile time so that the loops unroll.
template <int64_t kDim>
void attend(const float* __restrict q, const float* __restrict k_cache,
            const float* __restrict v_cache, const int64_t* __restrict table, int64_t first,
            int64_t ctx, int64_t block_size, int64_t slot_stride, int64_t group, float scale,
            float* __restrict scores, float* __restrict out) {
  constexpr int64_t kVecs = kDim / kLanes;
  const int64_t len = ctx - first;                            // keys attended to
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;  // each group's scores row
  // Positions go block by block; a window's first block may be entered part way through.
  for (int64_t pos = first; pos < ctx;) {
    const int64_t off = pos % block_size, n = std::min(block_size - off, ctx - pos);
    const float* kb = k_cache + (table[pos / block_size] * block_size + off) * slot_stride;
    for (int64_t j = 0; j < n; ++j) {
      vfloat key[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) key[c] = load(kb + j * slot_stride + c * kLanes);
      for (int64_t g = 0; g < group; ++g) {
        vfloat acc = {};
        for (int64_t c = 0; c < kVecs; ++c) acc += load(q + g * kDim + c * kLanes) * key[c];
        scores[g * padded + pos - first + j] = hsum(acc) * scale;
      }
    }
    pos += n;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    for (int64_t i = len; i < padded; ++i) s[i] = -INFINITY;
    softmax(s, padded);
  }
  for (int64_t g = 0; g < group; ++g) {
    vfloat acc[kVecs] = {};
    const float* s = scores + g * padded;
    for (int64_t pos = first; pos < ctx;) {
      const int64_t off = pos % block_size, n = std::min(block_size - off, ctx - pos);
      const float* vb = v_cache + (table[pos / block_size] * block_size + off) * slot_stride;
      for (int64_t j = 0; j < n; ++j) {
        const float p = s[pos - first + j];
        for (int64_t c = 0; c < kVecs; ++c) acc[c] += p * load(vb + j * slot_stride + c * kLanes);
      }
      pos += n;
    }
    for (int64_t c = 0; c < kVecs; ++c) store(out + g * kDim + c * kLanes, acc[c]);
  }
}

// The first position a row of context `ctx` attends to: query position ctx - 1 sees key j
// iff ctx - 1 - j < window, i.e. j >= ctx - window (window 0: no window, every position).
inline int64_t window_start(int64_t ctx, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
}

}  // namespace

namespace nanoserve {

void paged_decode_attention(
    const at::Tensor& q,             // [T, H, D]: every token of the step
    const at::Tensor& k_cache,       // [slots, KV, D]: one layer's keys
    const at::Tensor& v_cache,       // [slots, KV, D]
    const at::Tensor& rows,          // [R] int64: the flat token index of each decode row
    const at::Tensor& block_tables,  // [R, W] int64: each row's blocks, padded at the end
    const at::Tensor& context_lens,  // [R] int64: positions each row attends to (>= 1)
    int64_t block_size, double scale,
    const at::Tensor& out,  // [T, H, D]: only the decode rows' entries are written
    int64_t window) {       // 0, or a sliding window: each row sees its last `window` keys
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q and caches: 3-d");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  out.is_contiguous() && block_tables.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "index tensors: int64");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  TORCH_CHECK(window >= 0, "window: 0 (none) or a positive number of positions");
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && v_cache.sizes() == k_cache.sizes(), "cache shapes");
  TORCH_CHECK(heads % kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256,
              "head_dim 16, 32, 64, 128 or 256");
  const int64_t group = heads / kv_heads;
  const int64_t num_rows = rows.size(0), width = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == num_rows && context_lens.size(0) == num_rows,
              "one block table and context length per row");
  const int64_t slots = k_cache.size(0);
  const int64_t num_tokens = q.size(0);

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* row_ix = rows.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx_lens = context_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) {  // bounds, once, before any thread reads
    const int64_t ctx = ctx_lens[r];
    TORCH_CHECK(row_ix[r] >= 0 && row_ix[r] < num_tokens, "row index out of range");
    TORCH_CHECK(ctx >= 1 && ctx <= width * block_size, "context length out of range");
    for (int64_t b = window_start(ctx, window) / block_size;
         b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t blk = tables[r * width + b];
      TORCH_CHECK(blk >= 0 && (blk + 1) * block_size <= slots, "block id out of range");
    }
  }
  const float fscale = static_cast<float>(scale);
  const int64_t slot_stride = kv_heads * dim;  // floats from one slot to the next

  const auto run = dim == 16   ? &attend<16>
                   : dim == 32 ? &attend<32>
                   : dim == 64 ? &attend<64>
                   : dim == 128 ? &attend<128>
                                : &attend<256>;  // Gemma's
  int64_t longest = 0;
  for (int64_t r = 0; r < num_rows; ++r)
    longest = std::max(longest, ctx_lens[r] - window_start(ctx_lens[r], window));
  const int64_t scores_len = group * ((longest + kLanes - 1) / kLanes * kLanes);

  at::parallel_for(0, num_rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(scores_len);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t head = row_ix[r] * heads + h * group;  // the first of the group's heads
      // Head h's values in a slot start h * dim floats in: offset the cache pointers by
      // that, and every slot of head h is then a multiple of slot_stride away.
      run(qp + head * dim, kp + h * dim, vp + h * dim, tables + r * width,
          window_start(ctx_lens[r], window), ctx_lens[r], block_size, slot_stride, group, fscale, scores.data(), op + head * dim);
    }
  });
}

}  // namespace nanoserve

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor rows, "
      "Tensor block_tables, Tensor context_lens, int block_size, float scale, "
      "Tensor(a!) out, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) {
  m.impl("paged_decode_attention", &nanoserve::paged_decode_attention);
}
