// Weight multiplies straight from GGUF's quantized blocks, float32 activations, on the CPU.
//
// A quantized weight stays in the file's own block format, [N rows][K / W blocks], each
// block W weights of one row, W = 32:
//   Q4_0: f16 d, 16 bytes of nibbles                     w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles              w = d * q + m
//   Q5_0: f16 d, 4 bytes of high bits, 16 of nibbles     w = d * (q - 16)
//   Q5_1: f16 d, f16 m, 4 bytes of high bits, 16 nibbles w = d * q + m
//   Q8_0: f16 d, 32 int8                                 w = d * q
//   F16, BF16: 32 two-byte floats (a row is just its K values; 32 is the kernels' unit)
// (byte j of the nibbles holds weight j in its low half and weight j + 16 in its high
// half; bit j of the high bits, a little-endian uint32, is weight j's fifth bit), or W = 256
// (the K-quants: a superblock of 8 units of 32 weights):
//   Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
//   Q5_K: as Q4_K, then 32 bytes of high bits, then the 128 bytes of nibbles
//         w = (d * sc) * q - (dmin * m), sc and m unit u's
//   Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d
//         w = (d * sc) * (q - 32), one scale per 16 weights
// (unit u of Q4_K/Q5_K: the low (u even) or high (u odd) nibbles of bytes 32 (u / 2) ..
// +31, Q5_K's fifth bit bit u of the 32 high-bit bytes; unit u = 4 g + v of Q6_K: the
// nibbles of bytes 64 g + 32 (v % 2) .. +31, low for v < 2, and bits 2 v, 2 v + 1 of high
// bytes 32 g .. +31; that is how gguf-py's reshapes lay them out).
// Every weight is dequantized to float32 exactly as gguf-py computes it (and so
// transformers, the reference): a product of an f16 scale (11 significant bits) and a
// quant (at most 8) is exact in float32, as are the K-quants' d * sc (6 or 8 bits) and
// that times q (at most 24 bits in all), so only the one addition of Q4_1, Q5_1, Q4_K and
// Q5_K rounds, fused or not, as it does there. Only the order of the dot product's
// additions differs from a float32 matmul over those values.
//
// quant_linear: out[M, N] = x[M, K] @ W^T. The rows of W are split among threads. Up to
// kRegisterRows rows of x each block is dequantized in registers and used at once against
// every row (at one row, batch-1 decode, each weight byte is read once: the memory-bound
// gemv). Above it, a thread dequantizes kTileN weight rows into a buffer that stays in L1
// and runs every row of x against them through a register-tiled micro-kernel. For many
// rows the caller dequantizes the whole weight (dequantize) and uses the float32 GEMM.
//
// The vectors are the build's native width (vec.h: one library per instruction set): 16
// floats on AVX-512, 8 on AVX2, so a block is 2 or 4 vectors, and the tiles are shaped for
// each register file (32 zmm registers, or 16 ymm). On AVX-512 the arithmetic, and so every
// bit, is what this file computed before it had an AVX2 path. One exception to "only the
// order of additions differs": AVX2's one-row kernel for Q4_0 and Q4_K (row_factored)
// multiplies each unit's scale and offset once into sums, not into every weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "rows.h"
#include "vec.h"

namespace {

constexpr int64_t kBlock = 32;

using nanoserve::load;
using nanoserve::store;
using nanoserve::vfloat;
using nanoserve::vint;
constexpr int kW = nanoserve::kLanes;  // floats per vector
typedef vfloat vf;
#ifdef NANOSERVE_AVX512
// Tiles: 4 rows of x against 4 weight rows, 16 accumulators of the 32 registers.
constexpr int kTileM = 4, kTileN = 4;
#else
// 4 rows of x against 3 weight rows: 12 accumulators, 3 weights and one x in 16 registers
// (4 x 4 would need 16 accumulators alone and spill).
constexpr int kTileM = 4, kTileN = 3;
#endif
constexpr int kPer = kBlock / kW;  // vectors per block of 32 weights

// The inner helpers must inline into the dot loops: left as calls (GCC does that to the
// AVX2 dequantizers), every block's weights and accumulators go through the stack, and a
// 3-row dot ran at half the speed of a 2-row one.
#define NS_INLINE inline __attribute__((always_inline))

// Up to this many rows of x the weights are dequantized in registers (gemv: 6-16 ms for the
// 30 layers at 1-8 rows, against 9-20 ms for the other way), above it kTileN weight rows at
// a time into L1 for the micro-kernel (36 against 39 ms at 16 rows, 57 against 80 at 32,
// 109 against 164 at 64; AVX-512).
constexpr int64_t kRegisterRows = 8;  // quant.py's REGISTER_ROWS (the cost model's bands)

// How far ahead of the block it multiplies the register kernel asks for the weights' bytes.
constexpr int64_t kPrefetchBytes = 1024;

NS_INLINE float vsum(vf v) {
#if defined(NANOSERVE_AVX512)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(NANOSERVE_AVX2)
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
#else
  float s = 0.0f;
  for (int l = 0; l < kW; ++l) s += v[l];
  return s;
#endif
}

// IEEE half -> float, exactly (normal, subnormal, zero, inf, nan).
NS_INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(NANOSERVE_AVX512) || defined(NANOSERVE_AVX2)
  return _cvtsh_ss(h);  // F16C
#else
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
#endif
}

// The 32 nibbles of a block as floats, in weight order: 0-15 are the low halves of the 16
// bytes, 16-31 the high halves. GCC scalarises a byte-to-float vector conversion, hence the
// intrinsics: a zero-extension and a conversion per vector.
NS_INLINE void nibbles(const uint8_t* qs, vf (&w)[kPer]) {
// Whole bytes are widened to 32 bits straight from memory (the load folds into the
// widening), then each byte's low half taken by a mask and its high half by a shift: on
// AVX2 two shuffles where splitting the nibbles first took six (batch-1 decode 6.4 against
// 8.0 ms a token, d and m below included).
#if defined(NANOSERVE_AVX512)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0] = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0f)));
  w[1] = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif defined(NANOSERVE_AVX2)
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i b1 =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0f);
  w[0] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));
  w[1] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));
  w[2] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
  w[3] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
#else
  for (int j = 0; j < kPer; ++j) {
    for (int l = 0; l < kW; ++l) {
      const int i = j * kW + l;
      w[j][l] = static_cast<float>(i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4);
    }
  }
#endif
}

NS_INLINE void int8s(const uint8_t* p, vf (&w)[kPer]) {
  const int8_t* q = reinterpret_cast<const int8_t*>(p);
  for (int j = 0; j < kPer; ++j) w[j] = nanoserve::int8_lanes(q + j * kW);
}

// kW bytes from p, each zero-extended to a 32-bit lane (the load folds into the widening).
NS_INLINE vint bytes(const uint8_t* p) {
#if defined(NANOSERVE_AVX512)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(NANOSERVE_AVX2)
  return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vint v;
  for (int l = 0; l < kW; ++l) v[l] = p[l];
  return v;
#endif
}

NS_INLINE vf to_float(vint v) { return __builtin_convertvector(v, vf); }

// 0, 1, ..., kW - 1: each lane's shift to its own bit of a broadcast word.
NS_INLINE vint lane_index() {
  vint v;
  for (int l = 0; l < kW; ++l) v[l] = l;
  return v;
}

// Two adjacent halves (d and m, or d and dmin) as broadcast vectors.
NS_INLINE void half_pair(const uint8_t* b, vf& d, vf& m) {
#if defined(NANOSERVE_AVX2) || defined(NANOSERVE_AVX512)
  // converted by one instruction
  uint32_t dm;
  std::memcpy(&dm, b, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
#if defined(NANOSERVE_AVX512)
  d = (vf)_mm512_broadcastss_ps(f), m = (vf)_mm512_broadcastss_ps(_mm_movehdup_ps(f));
#else
  d = (vf)_mm256_broadcastss_ps(f), m = (vf)_mm256_broadcastss_ps(_mm_movehdup_ps(f));
#endif
#else
  d = vf{} + half_to_float(b), m = vf{} + half_to_float(b + 2);
#endif
}

// Q5_0's and Q5_1's 32 quants (0..31) as floats: the nibbles as in Q4_0, and bit i of the
// little-endian word at qh as weight i's fifth bit.
NS_INLINE void five_bits(const uint8_t* qh, const uint8_t* qs, vf (&w)[kPer]) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < kPer; ++j) {
    const int i = j * kW;  // the vector's first weight
    const vint lo = i < 16 ? bytes(qs + i) & 0x0f : bytes(qs + i - 16) >> 4;
    const vint hi = ((vint{} + static_cast<int32_t>(h >> i)) >> lane_index()) & 1;
    w[j] = to_float(lo | (hi << 4));
  }
}

// A K-quant unit's 32 nibbles: the low (shift 0) or high (shift 4) halves of 32 bytes.
NS_INLINE vint nibble_run(const uint8_t* p, int j, int shift) {
  return (bytes(p + j * kW) >> shift) & 0x0f;
}

#if defined(NANOSERVE_AVX512)
// On AVX-512 a 4-bit quant becomes its weight through a table lookup in a register: the
// block's 16 possible weights are computed once (one multiply, or one fused multiply-add,
// over 0..15), and vpermps picks each lane's from its index. vpermps reads only the low 4
// bits of an index, so a byte widened to 32 bits indexes by its low nibble with no mask, and
// shifted right by 4 by its high one. Per 16 weights that is one lookup where the widening
// path took a mask, a conversion and a multiply-add (batch-1 decode of a 268 MB Q4_0 matrix,
// one thread: 8.2 against 10.6 GB/s). Each table entry is the product and the one rounding
// that gguf-py computes for that quant, so the weights are the same bits as before.
NS_INLINE __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// 16 bytes at p, each zero-extended to a 32-bit lane (the indices of the lookups).
NS_INLINE __m512i widen16(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

NS_INLINE vf lookup(__m512i index, __m512 table) {
  return (vf)_mm512_permutexvar_ps(index, table);
}

// A 5-bit quant: its low 4 bits index `lo` (weights of quants 0..15) or, where its mask
// bit (the fifth bit) is set, `hi` (quants 16..31).
NS_INLINE vf lookup5(__m512i index, __mmask16 fifth, __m512 lo, __m512 hi) {
  return (vf)_mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(index, lo), fifth, index, hi);
}
#endif

// What a block's dequant needs from it once, not once per unit: nothing for the formats of
// one 32-weight unit; for the K-quants, each unit's multipliers, taken out of the
// superblock's packed scales once (they were taken out once per unit and per row of x:
// batch-1 decode of Q4_K 6.4 against 7.8 GB/s, one thread, AVX-512, lookups included).
struct NoScales {};

// Tells the compiler that a block's multipliers, once stored, are to be read back from
// memory: each unit then broadcasts its own with a load (vbroadcastss from memory), where GCC
// otherwise keeps the vector in a register and picks each one out with a vpermd (batch-1
// decode, one thread, AVX-512, weights in cache: Q4_K 8.0 against 9.0 GB/s, Q6_K 8.0
// against 9.5).
template <class T>
NS_INLINE void from_memory(T& scales) {
  asm volatile("" : "+m"(scales));
}

// Q4_K's and Q5_K's v[u] = d * sc_u and v[8 + u] = dmin * m_u (exact products, as gguf-py).
struct KScales {
  alignas(64) float v[16];
};

NS_INLINE KScales k_scales(const uint8_t* b) {
  uint8_t sm[16];
  nanoserve::unpack_k_scales(b + 4, sm);
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  KScales k;
#if defined(NANOSERVE_AVX512)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm))));
  const __m512 by = _mm512_insertf32x8(_mm512_set1_ps(d), _mm256_set1_ps(dmin), 1);
  _mm512_store_ps(k.v, _mm512_mul_ps(f, by));
  from_memory(k);
#elif defined(NANOSERVE_AVX2)
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm));
  _mm256_store_ps(k.v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p)), _mm256_set1_ps(d)));
  _mm256_store_ps(k.v + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(p, 8))),
                                         _mm256_set1_ps(dmin)));
  from_memory(k);
#else
  for (int i = 0; i < 8; ++i) {
    k.v[i] = d * static_cast<float>(sm[i]);
    k.v[8 + i] = dmin * static_cast<float>(sm[8 + i]);
  }
#endif
  return k;
}

// Q6_K's ds[i] = d * scale_i of its 16 groups of 16 weights (exact), and -32 times it.
struct Q6Scales {
  alignas(64) float ds[16];
  alignas(64) float neg32ds[16];
};

NS_INLINE Q6Scales q6_scales(const uint8_t* b) {
  const float d = half_to_float(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  Q6Scales s;
#if defined(NANOSERVE_AVX512)
  const __m512 ds = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))),
      _mm512_set1_ps(d));
  _mm512_store_ps(s.ds, ds);
  _mm512_store_ps(s.neg32ds, _mm512_mul_ps(ds, _mm512_set1_ps(-32.0f)));
  from_memory(s);
#elif defined(NANOSERVE_AVX2)
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
  for (int h = 0; h < 2; ++h) {
    const __m256 ds = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(p, 8) : p)),
                                    _mm256_set1_ps(d));
    _mm256_store_ps(s.ds + 8 * h, ds);
    _mm256_store_ps(s.neg32ds + 8 * h, _mm256_mul_ps(ds, _mm256_set1_ps(-32.0f)));
  }
  from_memory(s);
#else
  for (int i = 0; i < 16; ++i) {
    s.ds[i] = d * static_cast<float>(sc[i]);
    s.neg32ds[i] = -32.0f * s.ds[i];
  }
#endif
  return s;
}

// A unit's weights as scale * q + offset, for the factored batch-1 kernel (row_factored).
struct Affine {
  float scale, offset;
};

// The formats of one unit: no scales to take out first.
struct OneUnit {
  using Scales = NoScales;
  NS_INLINE static NoScales scales(const uint8_t*) { return {}; }
};

// Each format: kBytes per block of kUnits * 32 weights; scales(block) takes out what its
// units share, once, and dequant(block, u, scales, w) gives unit u's 32 weights as kPer
// vectors (u is 0 where a block is one unit). The dot loops run u as a constant (unrolled),
// so a K-quant's branches on it go away. On AVX2, Q4_0 and Q4_K also give a unit's raw
// quants and its scale and offset (quants, affine) for the one-row kernel, row_factored.
struct Q4_0 : OneUnit {
  static constexpr int64_t kBytes = 18, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
#if defined(NANOSERVE_AVX512)
    // d * (q - 8) for q = 0..15: exact products
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(half_to_float(b)),
                                   _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
    const __m512i q = widen16(b + 2);
    w[0] = lookup(q, t), w[1] = lookup(_mm512_srli_epi32(q, 4), t);
#else
    const vf d = vf{} + half_to_float(b), d8 = d * 8.0f;
    nibbles(b + 2, w);
    // d * q - 8 d: both products exact, and so their difference d * (q - 8) (one fused
    // multiply-add, where (q - 8) * d took a subtraction and a multiply)
    for (int j = 0; j < kPer; ++j) w[j] = d * w[j] - d8;
#endif
  }
#if defined(NANOSERVE_AVX2)
  NS_INLINE static void quants(const uint8_t* b, int, vf (&q)[kPer]) { nibbles(b + 2, q); }
  NS_INLINE static Affine affine(const uint8_t* b, int, NoScales) {
    const float d = half_to_float(b);
    return {d, -8.0f * d};
  }
#endif
};

struct Q4_1 : OneUnit {
  static constexpr int64_t kBytes = 20, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
    vf d, m;
    half_pair(b, d, m);
#if defined(NANOSERVE_AVX512)
    const __m512 t = _mm512_fmadd_ps((__m512)d, iota16(), (__m512)m);  // d * q exact: one rounding
    const __m512i q = widen16(b + 4);
    w[0] = lookup(q, t), w[1] = lookup(_mm512_srli_epi32(q, 4), t);
#else
    nibbles(b + 4, w);
    for (int j = 0; j < kPer; ++j) w[j] = d * w[j] + m;
#endif
  }
};

struct Q5_0 : OneUnit {
  static constexpr int64_t kBytes = 22, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
#if defined(NANOSERVE_AVX512)
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    const __m512 hi = _mm512_mul_ps(d, iota16());  // d * (q - 16) for q = 16..31: exact
    const __m512 lo = _mm512_sub_ps(hi, _mm512_mul_ps(d, _mm512_set1_ps(16.0f)));  // exact too
    uint32_t h;
    std::memcpy(&h, b + 2, 4);
    const __m512i q = widen16(b + 6);
    w[0] = lookup5(q, static_cast<__mmask16>(h), lo, hi);
    w[1] = lookup5(_mm512_srli_epi32(q, 4), static_cast<__mmask16>(h >> 16), lo, hi);
#else
    const vf d = vf{} + half_to_float(b), d16 = d * 16.0f;
    five_bits(b + 2, b + 6, w);
    for (int j = 0; j < kPer; ++j) w[j] = d * w[j] - d16;  // exact, as Q4_0's
#endif
  }
};

struct Q5_1 : OneUnit {
  static constexpr int64_t kBytes = 24, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
    vf d, m;
    half_pair(b, d, m);
#if defined(NANOSERVE_AVX512)
    // d * q + m for q = 0..15 and 16..31: d * q exact, one rounding
    const __m512 lo = _mm512_fmadd_ps((__m512)d, iota16(), (__m512)m);
    const __m512 hi =
        _mm512_fmadd_ps((__m512)d, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), (__m512)m);
    uint32_t h;
    std::memcpy(&h, b + 4, 4);
    const __m512i q = widen16(b + 8);
    w[0] = lookup5(q, static_cast<__mmask16>(h), lo, hi);
    w[1] = lookup5(_mm512_srli_epi32(q, 4), static_cast<__mmask16>(h >> 16), lo, hi);
#else
    five_bits(b + 4, b + 8, w);
    for (int j = 0; j < kPer; ++j) w[j] = d * w[j] + m;  // d * q exact: one rounding
#endif
  }
};

struct Q8_0 : OneUnit {
  static constexpr int64_t kBytes = 34, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
    const vf d = vf{} + half_to_float(b);
    int8s(b + 2, w);
    for (int j = 0; j < kPer; ++j) w[j] = w[j] * d;
  }
};

struct Q4_K {
  static constexpr int64_t kBytes = 144, kUnits = 8;
  using Scales = KScales;
  NS_INLINE static KScales scales(const uint8_t* b) { return k_scales(b); }
  NS_INLINE static void dequant(const uint8_t* b, int u, const KScales& k, vf (&w)[kPer]) {
    const uint8_t* q = b + 16 + 32 * (u / 2);
#if defined(NANOSERVE_AVX512)
    const __m512 t = _mm512_fmsub_ps(_mm512_set1_ps(k.v[u]), iota16(), _mm512_set1_ps(k.v[8 + u]));
    for (int j = 0; j < kPer; ++j) {
      const __m512i i = widen16(q + j * kW);
      w[j] = lookup(u % 2 ? _mm512_srli_epi32(i, 4) : i, t);
    }
#else
    // gguf-py's (d * sc) and (dmin * m), both exact, then one rounding of the difference
    const vf ds = vf{} + k.v[u], dm = vf{} + k.v[8 + u];
    for (int j = 0; j < kPer; ++j) w[j] = ds * to_float(nibble_run(q, j, 4 * (u % 2))) - dm;
#endif
  }
#if defined(NANOSERVE_AVX2)
  NS_INLINE static void quants(const uint8_t* b, int u, vf (&q)[kPer]) {
    const uint8_t* p = b + 16 + 32 * (u / 2);
    for (int j = 0; j < kPer; ++j) q[j] = to_float(nibble_run(p, j, 4 * (u % 2)));
  }
  NS_INLINE static Affine affine(const uint8_t*, int u, const KScales& k) {
    return {k.v[u], -k.v[8 + u]};
  }
#endif
};

struct Q5_K {
  static constexpr int64_t kBytes = 176, kUnits = 8;
  using Scales = KScales;
  NS_INLINE static KScales scales(const uint8_t* b) { return k_scales(b); }
  NS_INLINE static void dequant(const uint8_t* b, int u, const KScales& k, vf (&w)[kPer]) {
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48 + 32 * (u / 2);
#if defined(NANOSERVE_AVX512)
    const __m512 ds = _mm512_set1_ps(k.v[u]), dm = _mm512_set1_ps(k.v[8 + u]);
    const __m512 lo = _mm512_fmsub_ps(ds, iota16(), dm);
    const __m512 hi = _mm512_fmsub_ps(ds, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), dm);
    for (int j = 0; j < kPer; ++j) {
      const __m512i i = widen16(q + j * kW);
      // weight i's fifth bit: bit u of high-bit byte i
      const __mmask16 fifth = _mm_test_epi8_mask(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + j * kW)),
          _mm_set1_epi8(static_cast<char>(1 << u)));
      w[j] = lookup5(u % 2 ? _mm512_srli_epi32(i, 4) : i, fifth, lo, hi);
    }
#else
    const vf ds = vf{} + k.v[u], dm = vf{} + k.v[8 + u];
    for (int j = 0; j < kPer; ++j) {
      const vint hi = ((bytes(qh + j * kW) >> u) & 1) << 4;
      w[j] = ds * to_float(nibble_run(q, j, 4 * (u % 2)) | hi) - dm;
    }
#endif
  }
};

struct Q6_K {
  static constexpr int64_t kBytes = 210, kUnits = 8;
  using Scales = Q6Scales;
  NS_INLINE static Q6Scales scales(const uint8_t* b) { return q6_scales(b); }
  NS_INLINE static void dequant(const uint8_t* b, int u, const Q6Scales& s, vf (&w)[kPer]) {
    const int g = u / 4, v = u % 4;
    const uint8_t* ql = b + 64 * g + 32 * (v % 2);
    const uint8_t* qh = b + 128 + 32 * g;
    for (int j = 0; j < kPer; ++j) {
      const int group = 2 * u + j * kW / 16;  // a scale covers 16 weights
#if defined(NANOSERVE_AVX512)
      // the nibble (low for v < 2) in bits 0-3, bits 2 v, 2 v + 1 of the high byte moved to
      // bits 4-5, by one bitwise select (vpternlogd 0xCA: mask ? a : b) and one mask
      const __m512i l = widen16(ql + j * kW), h = widen16(qh + j * kW);
      const __m512i lo = v < 2 ? l : _mm512_srli_epi32(l, 4);
      const __m512i hi = v < 2 ? _mm512_slli_epi32(h, 4 - 2 * v) : _mm512_srli_epi32(h, 2 * v - 4);
      const __m512i q = _mm512_and_si512(
          _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0f), lo, hi, 0xca), _mm512_set1_epi32(0x3f));
      // ds * q - 32 ds: both products exact, and so their difference, ds * (q - 32)
      w[j] = (vf)_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s.ds[group]),
                                 _mm512_set1_ps(s.neg32ds[group]));
#else
      // d * scale first (exact), as gguf-py; then ds * q - 32 ds, exact as above
      const vint hi = ((bytes(qh + j * kW) >> (2 * v)) & 3) << 4;
      w[j] = (vf{} + s.ds[group]) * to_float(nibble_run(ql, j, 4 * (v / 2)) | hi) +
             s.neg32ds[group];
#endif
    }
  }
};

// A row of K halves (GGUF's F16 tensors), 32 of them a unit.
struct F16 : OneUnit {
  static constexpr int64_t kBytes = 64, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
    for (int j = 0; j < kPer; ++j) {
      const uint8_t* p = b + 2 * j * kW;
#if defined(NANOSERVE_AVX512)
      w[j] = (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(NANOSERVE_AVX2)
      w[j] = (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
      for (int l = 0; l < kW; ++l) w[j][l] = half_to_float(p + 2 * l);
#endif
    }
  }
};

// A row of K bfloat16s: each the top half of a float32's bits.
struct BF16 : OneUnit {
  static constexpr int64_t kBytes = 64, kUnits = 1;
  NS_INLINE static void dequant(const uint8_t* b, int, NoScales, vf (&w)[kPer]) {
    for (int j = 0; j < kPer; ++j) {
      const uint8_t* p = b + 2 * j * kW;
#if defined(NANOSERVE_AVX512)
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      w[j] = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
#elif defined(NANOSERVE_AVX2)
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      w[j] = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#else
      for (int l = 0; l < kW; ++l) {
        uint16_t h;
        std::memcpy(&h, p + 2 * l, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&w[j][l], &bits, 4);
      }
#endif
    }
  }
};

// A row of `blocks` blocks dequantized into w.
template <class F>
void dequant_row(const uint8_t* row, int64_t blocks, float* w) {
  for (int64_t b = 0; b < blocks; ++b) {
    const typename F::Scales s = F::scales(row + b * F::kBytes);
#pragma GCC unroll 8
    for (int u = 0; u < F::kUnits; ++u) {
      vf v[kPer];
      F::dequant(row + b * F::kBytes, u, s, v);
      for (int j = 0; j < kPer; ++j) store(w + (b * F::kUnits + u) * kBlock + j * kW, v[j]);
    }
  }
}

// Asks for the cache lines of the block kPrefetchBytes ahead of `block`. The hardware
// prefetcher alone left each thread short of the bytes it could multiply (two threads, 256
// MB of weights, GB/s without and with: Q4_0 17.8 and 20.0, Q4_K 15.2 and 17.5); a
// prefetch cannot fault, so asking past the last row is harmless.
template <class F>
NS_INLINE void prefetch_ahead(const uint8_t* block) {
  for (int64_t l = 0; l < F::kBytes; l += 64) __builtin_prefetch(block + kPrefetchBytes + l);
}

// Independent accumulators per row of x in rows_dot: enough chains of fused multiply-adds
// to hide their latency, few enough that R rows' of them, and a block's kPer weight
// vectors, stay in registers. On AVX-512 always 2 (one per vector of a block). On AVX2,
// measured over SmolLM2's projections (scripts/bench_kernels.py): 4 at one row, 2 up to four
// (1 or 4 at two rows: twice the time), 1 above (2 at five and six rows: no faster).
template <int R>
constexpr int accumulators() {
  if constexpr (kPer == 2) return 2;
  return R == 1 ? 4 : R <= 4 ? 2 : 1;
}

// R rows of x (R <= 8) against weight row `row` (nb blocks), the weights dequantized in
// registers and used at once: nothing goes through memory but the blocks and x (which stays
// in L1). Each accumulator sums its units in order, however many units a block holds.
template <class F, int R>
NS_INLINE void rows_dot(const float* x, int64_t xs, const uint8_t* row, int64_t nb, float* out,
                        int64_t os) {
  constexpr int A = accumulators<R>();
  vf a[R][A] = {};
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<F>(row + b * F::kBytes);
    const typename F::Scales s = F::scales(row + b * F::kBytes);
#pragma GCC unroll 8
    for (int u = 0; u < F::kUnits; ++u) {
      vf w[kPer];
      F::dequant(row + b * F::kBytes, u, s, w);
      const float* xb = x + (b * F::kUnits + u) * kBlock;
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < kPer; ++j) a[r][j % A] += load(xb + r * xs + j * kW) * w[j];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vf s = a[r][0];
    for (int i = 1; i < A; ++i) s += a[r][i];
    out[r * os] = vsum(s);
  }
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

#if defined(NANOSERVE_AVX2)
// Formats whose units the batch-1 kernel on AVX2 takes as scale * q + offset.
template <class F>
concept Factored = requires(const uint8_t* b, vf (&q)[kPer], typename F::Scales s) {
  F::quants(b, 0, q);
  F::affine(b, 0, s);
};

// One row of x against one weight row, on AVX2, with each unit's scale applied once to
// the unit's dot product with its raw quants and its offset once to the unit's sum of x
// (xsum, one per unit): sum x (s q + o) = s (sum x q) + o (sum x). Per 8 weights that is a
// widening, a mask or shift, a conversion and one fused multiply-add, where dequantizing
// first took a second fused multiply-add (AVX2 has no lookup of 16 floats in one register,
// which AVX-512's kernels use instead): one thread, weights in cache, Q4_0 7.8 against 9.9
// GB/s, Q4_K 6.8 against 8.8. Q4_1 lost (8.3 against 7.7: its two halves a block) and
// keeps the dequantizing kernel. The rounding differs from the dequantized path's (the
// offset's product is rounded once per unit, not once per weight); only this one-row
// kernel takes it.
template <class F>
inline float row_factored(const float* x, const float* xsum, const uint8_t* row, int64_t nb) {
  vf acc[2] = {};  // one chain per unit parity: the next unit's multiply-add need not wait
  float offsets[2] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    prefetch_ahead<F>(block);
    const typename F::Scales s = F::scales(block);
#pragma GCC unroll 8
    for (int u = 0; u < F::kUnits; ++u) {
      vf q[kPer];
      F::quants(block, u, q);
      const float* xb = x + (b * F::kUnits + u) * kBlock;
      vf t = load(xb) * q[0];
      for (int j = 1; j < kPer; ++j) t += load(xb + j * kW) * q[j];
      const Affine a = F::affine(block, u, s);
      acc[u % 2] += t * a.scale;
      offsets[(b * F::kUnits + u) % 2] += a.offset * xsum[b * F::kUnits + u];
    }
  }
  return vsum(acc[0] + acc[1]) + (offsets[0] + offsets[1]);
}
#endif

// Every row of x against every weight row, eight rows of x at a time. Each block is
// dequantized once per eight rows of x; at one row (batch-1 decode) each weight byte is
// read once.
template <class F>
void gemv(const float* x, int64_t M, int64_t xs, const uint8_t* blocks, int64_t nb,
          int64_t N, float* out, int64_t os) {
  const int64_t row_bytes = nb * F::kBytes;
#if defined(NANOSERVE_AVX2)
  if constexpr (Factored<F>) {
    if (M == 1) {
      const int64_t units = nb * F::kUnits;
      std::vector<float> xsum(units);
      for (int64_t i = 0; i < units; ++i) {
        vf v = load(x + i * kBlock);
        for (int j = 1; j < kPer; ++j) v += load(x + i * kBlock + j * kW);
        xsum[i] = vsum(v);
      }
      nanoserve::guided_rows(N, row_bytes, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          out[n] = row_factored<F>(x, xsum.data(), blocks + n * row_bytes, nb);
        }
      });
      return;
    }
  }
#endif
  nanoserve::guided_rows(N, row_bytes, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < M; r += 8) {
        rows_dot_any<F>(static_cast<int>(std::min<int64_t>(8, M - r)), x + r * xs, xs,
                        blocks + n * row_bytes, nb, out + r * os + n, os);
      }
    }
  });
}

// out[r][i] = x[r] . w[i] for r < TM, i < kTileN; x rows `xs` apart, w rows K apart, out
// rows `os`. TM + kTileN loads per TM * kTileN multiply-adds. Each out[r][i] is one chain
// of additions over k in order, whatever TM is: a row's values do not depend on whether it
// fell in a full tile or in the remainder (TM < kTileM), which runs the same kernel so that
// its kTileN chains still overlap (one dot at a time waited on its one chain: a 13th row
// cost as much as four more rows on AVX2).
template <int TM>
inline void dot_tile(const float* x, int64_t xs, const float* w, int64_t K, float* out,
                     int64_t os) {
  vf a[TM][kTileN] = {};
  for (int64_t k = 0; k < K; k += kW) {
    vf wv[kTileN];
    for (int i = 0; i < kTileN; ++i) wv[i] = load(w + i * K + k);
    for (int r = 0; r < TM; ++r) {
      const vf xv = load(x + r * xs + k);
      for (int i = 0; i < kTileN; ++i) a[r][i] += xv * wv[i];
    }
  }
  for (int r = 0; r < TM; ++r) {
    for (int i = 0; i < kTileN; ++i) out[r * os + i] = vsum(a[r][i]);
  }
}

inline void dot_tile_rows(int64_t rows, const float* x, int64_t xs, const float* w, int64_t K,
                          float* out, int64_t os) {
  static_assert(kTileM == 4, "the remainder cases below cover 1 to kTileM - 1 rows");
  switch (rows) {
    case 1: return dot_tile<1>(x, xs, w, K, out, os);
    case 2: return dot_tile<2>(x, xs, w, K, out, os);
    case 3: return dot_tile<3>(x, xs, w, K, out, os);
    default: return dot_tile<4>(x, xs, w, K, out, os);
  }
}

template <class F>
void linear(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  const int64_t nb = K / (kBlock * F::kUnits);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0), row_bytes = nb * F::kBytes;
  if (M <= kRegisterRows) return gemv<F>(xp, M, xs, bp, nb, N, op, os);
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kTileN * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileN, rows = std::min<int64_t>(kTileN, N - n0);
      for (int64_t i = 0; i < rows; ++i) {
        dequant_row<F>(bp + (n0 + i) * row_bytes, nb, buf.data() + i * K);
      }
      const float* w = buf.data();
      int64_t r = 0;
      if (rows == kTileN) {
        for (; r < M; r += kTileM) {
          dot_tile_rows(std::min<int64_t>(kTileM, M - r), xp + r * xs, xs, w, K,
                        op + r * os + n0, os);
        }
      }
      // A partial tile (N not a multiple of kTileN, its last rows) one dot at a time, each
      // summed in the micro-kernel's order.
      for (; r < M; ++r) {
        const float* xr = xp + r * xs;
        for (int64_t i = 0; i < rows; ++i) {
          const float* wi = w + i * K;
          vf a = {};
          for (int64_t k = 0; k < K; k += kW) a += load(xr + k) * load(wi + k);
          op[r * os + n0 + i] = vsum(a);
        }
      }
    }
  });
}

template <class F>
void dequant_all(const at::Tensor& blocks, const at::Tensor& out) {
  const int64_t N = blocks.size(0), K = out.size(1), nb = K / (kBlock * F::kUnits);
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequant_row<F>(bp + n * nb * F::kBytes, nb, op + n * os);
  });
}

// fn(F{}) for the format named `format`: every op's one list of formats.
template <class Fn>
void with_format(const std::string& format, Fn&& fn) {
  if (format == "q4_0") return fn(Q4_0{});
  if (format == "q4_1") return fn(Q4_1{});
  if (format == "q5_0") return fn(Q5_0{});
  if (format == "q5_1") return fn(Q5_1{});
  if (format == "q8_0") return fn(Q8_0{});
  if (format == "q4_k") return fn(Q4_K{});
  if (format == "q5_k") return fn(Q5_K{});
  if (format == "q6_k") return fn(Q6_K{});
  if (format == "f16") return fn(F16{});
  if (format == "bf16") return fn(BF16{});
  TORCH_CHECK(false, "quant: unknown block format ", format,
              " (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, f16, bf16)");
}

void check_blocks(const at::Tensor& blocks, int64_t K, const std::string& format) {
  with_format(format, [&](auto f) {
    using F = decltype(f);
    const int64_t per = kBlock * F::kUnits;  // weights per block
    TORCH_CHECK(K % per == 0, "quant: K = ", K, " is not a multiple of ", per, " (", format,
                ")");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
                    blocks.is_contiguous() && blocks.size(1) == K / per * F::kBytes,
                "quant: ", format, " blocks must be contiguous uint8 [N, K / ", per, " * ",
                F::kBytes, "]");
  });
}

}  // namespace

namespace nanoserve {

// A format may carry a suffix, "+q8" or "+q8v" (LlamaModel.use_act8 adds it under
// `--int8-activations`): at one row of x, a format q8dot.cpp has takes its 8-bit-activation
// kernel ("v": with VNNI's vpdpbusd); other row counts and formats ignore it.
void quant_linear(const at::Tensor& x, const at::Tensor& blocks, const std::string& spec,
                  const at::Tensor& out) {
  const size_t plus = spec.find('+');
  const std::string format = spec.substr(0, plus);
  const std::string suffix = plus == std::string::npos ? "" : spec.substr(plus);
  TORCH_CHECK(suffix.empty() || suffix == "+q8" || suffix == "+q8v", "quant: unknown suffix ",
              suffix, " of ", spec, " (+q8, +q8v)");
  const int64_t K = x.size(1);
  check_blocks(blocks, K, format);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be float32 [M, K] with unit column stride");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == blocks.size(0),
              "quant_linear: out must be float32 [M, N]");
  if (!suffix.empty() && x.size(0) == 1 && q8_format(format)) {
    return q8_gemv(x, blocks, format, suffix == "+q8v", out);
  }
  with_format(format, [&](auto f) { linear<decltype(f)>(x, blocks, out); });
}

void dequantize(const at::Tensor& blocks, const std::string& format, const at::Tensor& out) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == blocks.size(0),
              "dequantize: out must be float32 [N, K]");
  check_blocks(blocks, out.size(1), format);
  with_format(format, [&](auto f) { dequant_all<decltype(f)>(blocks, out); });
}

// The read-bandwidth yardstick (`nanoserve bench`): every byte of `buf` read once, with no
// writes, by the threads the kernels run on, split as the kernels split a weight (one
// contiguous run of bytes per thread). Returns a sum of the bytes taken as floats, so that
// the reads cannot be skipped; its value means nothing.
double stream_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "stream_read: buf must be contiguous uint8");
  const int64_t vectors = buf.numel() / static_cast<int64_t>(sizeof(vf));
  const uint8_t* p = buf.data_ptr<uint8_t>();
  std::atomic<double> total{0.0};
  at::parallel_for(0, vectors, 4096, [&](int64_t begin, int64_t end) {
    vf a[4] = {};  // four chains: loads, not additions, bound the loop
    int64_t i = begin;
    for (; i + 4 <= end; i += 4) {
      for (int k = 0; k < 4; ++k) a[k] += load(reinterpret_cast<const float*>(p) + (i + k) * kW);
    }
    for (; i < end; ++i) a[0] += load(reinterpret_cast<const float*>(p) + i * kW);
    double expected = total.load();
    const double mine = vsum(a[0] + a[1] + a[2] + a[3]);
    while (!total.compare_exchange_weak(expected, expected + mine)) {
    }
  });
  return total.load();
}

}  // namespace nanoserve

TORCH_LIBRARY_FRAGMENT(NANOSERVE_NS, m) {
  m.def("quant_linear(Tensor x, Tensor blocks, str format, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor blocks, str format, Tensor(a!) out) -> ()");
  m.def("stream_read(Tensor buf) -> float");
}

TORCH_LIBRARY_IMPL(NANOSERVE_NS, CPU, m) {
  m.impl("quant_linear", &nanoserve::quant_linear);
  m.impl("dequantize", &nanoserve::dequantize);
  m.impl("stream_read", &nanoserve::stream_read);
}
