// Weight multiplies straight from GGUF's quantized blocks, float32 activations, on the CPU.
//
// A quantized weight stays in the file's own block format, [N rows][K / 32 blocks], each
// block 32 weights of one row:
//   Q4_0: f16 d, 16 bytes of nibbles           w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles    w = d * q + m
//   Q8_0: f16 d, 32 int8                       w = d * q
// (byte j of the nibbles holds weight j in its low half and weight j + 16 in its high
// half). Every weight is dequantized to float32 exactly as gguf-py computes it (and so
// transformers, the reference): a product of an f16 scale (11 significant bits) and a
// quant (at most 8) is exact in float32, so only Q4_1's one addition rounds, fused or not,
// as it does there. Only the order of the dot product's additions differs from a float32
// matmul over those values.
//
// quant_linear: out[M, N] = x[M, K] @ W^T. The rows of W are split among threads; each
// thread dequantizes four rows at a time into a small buffer that stays in L1 and runs
// every row of x against them. At one row of x (batch-1 decode) that reads each weight byte
// once: the memory-bound gemv. For many rows the caller dequantizes the whole weight
// (dequantize) and uses the packed float32 GEMM instead, which wins there.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define NANOSERVE_AVX512 1
#endif

namespace {

using nanoserve::hsum;
using nanoserve::kLanes;
using nanoserve::load;
using nanoserve::store;
using nanoserve::v16;

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t s8x16 __attribute__((vector_size(16)));

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 4;  // weight rows dequantized together
// Up to this many rows of x the weights are dequantized in registers (gemv: 6-16 ms for the
// 30 layers at 1-8 rows, against 9-20 ms for the other way), above it four
// weight rows at a time into L1 for a 4x4 float32 micro-kernel (36 against 39 ms at 16
// rows, 57 against 80 at 32, 109 against 164 at 64).
constexpr int64_t kRegisterRows = 8;  // quant.py's REGISTER_ROWS (the cost model's bands)

// IEEE half -> float, exactly (normal, subnormal, zero, inf, nan).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef NANOSERVE_AVX512
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 32 nibbles of a block as floats: weights 0-15 (low halves), 16-31 (high halves).
inline void nibbles(const uint8_t* qs, v16& lo, v16& hi) {
#ifdef NANOSERVE_AVX512
  // GCC scalarises a byte-to-float vector conversion; these are two instructions each.
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  lo = (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
  hi = (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
#else
  u8x16 q;
  std::memcpy(&q, qs, 16);
  lo = __builtin_convertvector(q & 0x0f, v16);
  hi = __builtin_convertvector(q >> 4, v16);
#endif
}

inline v16 int8s(const uint8_t* p) {
#ifdef NANOSERVE_AVX512
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
#else
  s8x16 q;
  std::memcpy(&q, p, 16);
  return __builtin_convertvector(q, v16);
#endif
}

inline float sum16(v16 v) {
#ifdef NANOSERVE_AVX512
  return _mm512_reduce_add_ps((__m512)v);
#else
  return hsum(v);
#endif
}

// Each format: dequant(block, w0, w1) gives the block's 32 weights as two vectors.
struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static void dequant(const uint8_t* b, v16& w0, v16& w1) {
    const v16 d = v16{} + half_to_float(b);
    nibbles(b + 2, w0, w1);
    w0 = d * (w0 - 8.0f);  // q - 8 is exact; one rounding, as the reference
    w1 = d * (w1 - 8.0f);
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static void dequant(const uint8_t* b, v16& w0, v16& w1) {
    const v16 d = v16{} + half_to_float(b), m = v16{} + half_to_float(b + 2);
    nibbles(b + 4, w0, w1);
    w0 = d * w0 + m;
    w1 = d * w1 + m;
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static void dequant(const uint8_t* b, v16& w0, v16& w1) {
    const v16 d = v16{} + half_to_float(b);
    w0 = int8s(b + 2) * d;
    w1 = int8s(b + 18) * d;
  }
};

template <class F>
void dequant_row(const uint8_t* row, int64_t blocks, float* w) {
  for (int64_t b = 0; b < blocks; ++b) {
    v16 w0, w1;
    F::dequant(row + b * F::kBytes, w0, w1);
    store(w + b * kBlock, w0);
    store(w + b * kBlock + 16, w1);
  }
}

// R rows of x (R <= 8) against weight row `row`, the weights dequantized in registers and
// used at once: nothing goes through memory but the blocks and x (which stays in L1).
template <class F, int R>
inline void rows_dot(const float* x, int64_t xs, const uint8_t* row, int64_t nb, float* out,
                     int64_t os) {
  v16 a[R][2] = {};
  for (int64_t b = 0; b < nb; ++b) {
    v16 w0, w1;
    F::dequant(row + b * F::kBytes, w0, w1);
    for (int r = 0; r < R; ++r) {
      a[r][0] += load(x + r * xs + b * kBlock) * w0;
      a[r][1] += load(x + r * xs + b * kBlock + 16) * w1;
    }
  }
  for (int r = 0; r < R; ++r) out[r * os] = sum16(a[r][0] + a[r][1]);
}

template <class F>
void rows_dot_any(int r, const float* x, int64_t xs, const uint8_t* row, int64_t nb,
                  float* out, int64_t os) {
  switch (r) {
    case 1: return rows_dot<F, 1>(x, xs, row, nb, out, os);
    case 2: return rows_dot<F, 2>(x, xs, row, nb, out, os);
    case 3: return rows_dot<F, 3>(x, xs, row, nb, out, os);
    case 4: return rows_dot<F, 4>(x, xs, row, nb, out, os);
    case 5: return rows_dot<F, 5>(x, xs, row, nb, out, os);
    case 6: return rows_dot<F, 6>(x, xs, row, nb, out, os);
    case 7: return rows_dot<F, 7>(x, xs, row, nb, out, os);
    default: return rows_dot<F, 8>(x, xs, row, nb, out, os);
  }
}

// Every row of x against every weight row, eight rows of x at a time (16 accumulators,
// two weight vectors: 18 of the 32 vector registers). Each block is dequantized once per
// eight rows of x; at one row (batch-1 decode) each weight byte is read once.
template <class F>
void gemv(const float* x, int64_t M, int64_t xs, const uint8_t* blocks, int64_t nb,
          int64_t N, float* out, int64_t os) {
  const int64_t row_bytes = nb * F::kBytes;
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < M; r += 8) {
        rows_dot_any<F>(static_cast<int>(std::min<int64_t>(8, M - r)), x + r * xs, xs,
                        blocks + n * row_bytes, nb, out + r * os + n, os);
      }
    }
  });
}

// out[r][i] = x[r] . w[i] for r, i < 4; x rows `xs` apart, w rows K apart, out rows `os`.
inline void dot_4x4(const float* x, int64_t xs, const float* w, int64_t K, float* out,
                    int64_t os) {
  v16 a[4][4] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    const v16 w0 = load(w + k), w1 = load(w + K + k), w2 = load(w + 2 * K + k),
              w3 = load(w + 3 * K + k);
    for (int r = 0; r < 4; ++r) {
      const v16 xv = load(x + r * xs + k);
      a[r][0] += xv * w0;
      a[r][1] += xv * w1;
      a[r][2] += xv * w2;
      a[r][3] += xv * w3;
    }
  }
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 4; ++i) out[r * os + i] = sum16(a[r][i]);
  }
}

template <class F>
void linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = K / kBlock;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0), row_bytes = nb * F::kBytes;
  if (M <= kRegisterRows) return gemv<F>(xp, M, xs, bp, nb, N, op, os);
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kTile * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, rows = std::min(kTile, N - n0);
      for (int64_t i = 0; i < rows; ++i) {
        dequant_row<F>(bp + (n0 + i) * row_bytes, nb, buf.data() + i * K);
      }
      const float* w = buf.data();
      int64_t r = 0;
      if (rows == kTile) {
        // Four rows of x against the four weight rows: 16 accumulators, 8 loads per 16
        // multiply-adds (one row of x at a time would load as often as it multiplies).
        for (; r + 4 <= M; r += 4) dot_4x4(xp + r * xs, xs, w, K, op + r * os + n0, os);
      }
      for (; r < M; ++r) {
        const float* xr = xp + r * xs;
        for (int64_t i = 0; i < rows; ++i) {
          const float* wi = w + i * K;
          v16 a = {};
          for (int64_t k = 0; k < K; k += kLanes) a += load(xr + k) * load(wi + k);
          op[r * os + n0 + i] = sum16(a);
        }
      }
    }
  });
}

template <class F>
void dequant_all(const at::Tensor& blocks, const at::Tensor& out) {
  const int64_t N = blocks.size(0), K = out.size(1), nb = K / kBlock;
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant_row<F>(bp + n * nb * F::kBytes, nb, op + n * os);
  });
}

int64_t block_bytes(const std::string& format) {
  if (format == "q4_0") return Q4_0::kBytes;
  if (format == "q4_1") return Q4_1::kBytes;
  if (format == "q8_0") return Q8_0::kBytes;
  TORCH_CHECK(false, "quant: unknown block format ", format, " (q4_0, q4_1, q8_0)");
}

void check_blocks(const at::Tensor& blocks, int64_t K, const std::string& format) {
  TORCH_CHECK(K % kBlock == 0, "quant: K = ", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) == K / kBlock * block_bytes(format),
              "quant: blocks must be contiguous uint8 [N, K / 32 * ", block_bytes(format), "]");
}

}  // namespace

namespace nanoserve {

void quant_linear(const at::Tensor& x, const at::Tensor& blocks, const std::string& format,
                  const at::Tensor& out) {
  const int64_t K = x.size(1);
  check_blocks(blocks, K, format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with unit column stride");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == blocks.size(0),
              "quant_linear: out must be float32 [M, N]");
  if (format == "q4_0") {
    linear<Q4_0>(x, blocks, out);
  } else if (format == "q4_1") {
    linear<Q4_1>(x, blocks, out);
  } else {
    linear<Q8_0>(x, blocks, out);
  }
}

void dequantize(const at::Tensor& blocks, const std::string& format, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == blocks.size(0),
              "dequantize: out must be float32 [N, K]");
  check_blocks(blocks, out.size(1), format);
  if (format == "q4_0") {
    dequant_all<Q4_0>(blocks, out);
  } else if (format == "q4_1") {
    dequant_all<Q4_1>(blocks, out);
  } else {
    dequant_all<Q8_0>(blocks, out);
  }
}

}  // namespace nanoserve

TORCH_LIBRARY_FRAGMENT(nanoserve, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, str format, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor blocks, str format, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, m) {
  m.impl("quant_linear", &nanoserve::quant_linear);
  m.impl("dequantize", &nanoserve::dequantize);
}
