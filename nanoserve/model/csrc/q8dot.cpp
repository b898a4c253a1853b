// Batch-1 decode with 8-bit activations, opt-in (`--int8-activations`, model/int8.py).
//
// The default kernels (quant.cpp) turn every 4-bit weight into its float32 value and
// multiply it by a float32 activation: per 16 weights a widening, a lookup and a fused
// multiply-add, which on a Zen 4 core is instruction-bound below the memory's speed. This
// path does what llama.cpp does at batch 1: it rounds the one row of x to int8, one scale
// per 32 values (the largest magnitude maps to 127, as llama.cpp's Q8_0), and multiplies
// the weights' raw quants by those int8s in integer dot products, four byte products summed
// into each 32-bit lane (AVX-512 VNNI's or AVX-VNNI's vpdpbusd where the CPU has it; else
// AVX2's vpmaddubsw and vpmaddwd, the same sums). Each unit's scale is applied once, to its
// integer sums (d * sc * dx); each offset (Q4_0's -8 d, Q4_1's m, the K-quants' mins, Q6_K's
// -32 d sc) once, to the exact float32 sum of the activations it multiplies, so only the
// quants' products see rounded activations (llama.cpp rounds those sums too).
//
// The integer sums do not depend on how they are formed (no product or pair overflows 16
// bits: at most 2 * 128 * 127), so VNNI changes no bit. The float work is the same 256-bit
// code in the AVX2 and AVX-512 builds, and so are its bits, but for Q4_K: the AVX-512 build
// takes its two units of 32 bytes in one 512-bit register (two threads from DRAM, 36 MB:
// 25.5 against 29.3 GB/s), which orders the additions otherwise. A weight is read once, its
// rows split among threads.
//
// Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K (the synthetic Q4_0 and Q4_K_M files,
// SmolLM2's Q4_1 and Q8_0 head, Gemma's). Q5_K, F16 and BF16 keep the exact path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec.h"

#if defined(NANOSERVE_AVX512) || defined(NANOSERVE_AVX2)

namespace {

#define Q8_INLINE inline __attribute__((always_inline))

constexpr int64_t kUnit = 32;  // activations per int8 scale, and weights per unit
constexpr int64_t kPrefetch = 1024;

Q8_INLINE float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

Q8_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

Q8_INLINE float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// Each 32-bit lane of the result: the sum of four products of u's bytes (unsigned) by s's
// (signed). Vnni: one vpdpbusd, written as assembly so that the library's compiler flags
// need not claim VNNI (the caller checks the CPU's flags): the EVEX form (AVX512-VNNI with
// VL) in the AVX-512 build, the VEX form (AVX-VNNI) in the AVX2 build.
#if defined(NANOSERVE_AVX512)
template <bool Vnni>
Q8_INLINE __m512i dot4(__m512i u, __m512i s) {
  if constexpr (Vnni) {
    __m512i acc = _mm512_setzero_si512();
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
}
#endif

template <bool Vnni>
Q8_INLINE __m256i dot4(__m256i u, __m256i s) {
  if constexpr (Vnni) {
    __m256i acc = _mm256_setzero_si256();
#if defined(NANOSERVE_AVX512)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#else
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
#endif
    return acc;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

Q8_INLINE __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
Q8_INLINE __m256i high4(__m256i v) { return low4(_mm256_srli_epi16(v, 4)); }

// A 32-weight block's 16 bytes of nibbles as its 32 quants in weight order: the low halves
// (weights 0-15), then the high halves (16-31).
Q8_INLINE __m256i nibbles32(const uint8_t* qs) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return low4(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)));
}

// One row of x as the kernels read it: int8 values, one scale per 32 (dx), and the exact
// float32 sums of each 16 and each 32 values (the offsets' multipliers).
struct Act8 {
  std::vector<int8_t> q;
  std::vector<float> dx, sum16, sum32;

  explicit Act8(const float* x, int64_t K) : q(K), dx(K / kUnit), sum16(K / 16), sum32(K / kUnit) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / kUnit; ++b) {
      const float* xb = x + b * kUnit;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      dx[b] = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest, ties even
      // int32 -> int8, in order: the packs work within 128-bit lanes, hence the permute.
      const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * kUnit),
                          _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      sum16[2 * b] = hsum8(_mm256_add_ps(v[0], v[1]));
      sum16[2 * b + 1] = hsum8(_mm256_add_ps(v[2], v[3]));
      sum32[b] = sum16[2 * b] + sum16[2 * b + 1];
    }
  }
};

// A row's running sums: chains of the units' scaled integer sums (the next unit's
// multiply-add need not wait on the last: Q4_K 16.1 against 16.7 GB/s with four, one thread
// in cache), and the offsets' products, by lane or by block; on AVX-512 two 512-bit chains.
struct Sums {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  __m256 offv = _mm256_setzero_ps();
  float off = 0.0f;
#if defined(NANOSERVE_AVX512)
  __m512 wide[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#endif
};

// Each format: kBytes per block of kUnits * 32 weights; kOffset, the factor the offsets'
// sums take at the end (exact: a power of two, or 1); block(...) adds one block's products.
// `a`, `dx`, `s16`, `s32`: the block's activations, their scales and sums.
// A block of one unit: its 32 quants q (unsigned) times the activations a, scaled by d dx
// into the sums; its offset's factor o times the activations' exact sum.
template <bool V>
Q8_INLINE void one_unit(__m256i q, const int8_t* a, float d, float o, float dx, float sum,
                        Sums& s) {
  const __m256 p = _mm256_cvtepi32_ps(dot4<V>(q, load256(a)));
  s.acc[0] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx), s.acc[0]);
  s.off += o * sum;
}

struct Q4_0 {
  static constexpr int64_t kBytes = 18, kUnits = 1;
  static constexpr float kOffset = -8.0f;  // w = d (q - 8)
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float* s32, Sums& s) {
    const float d = half(b);
    one_unit<V>(nibbles32(b + 2), a, d, d, dx[0], s32[0], s);
  }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20, kUnits = 1;
  static constexpr float kOffset = 1.0f;  // w = d q + m
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float* s32, Sums& s) {
    one_unit<V>(nibbles32(b + 4), a, half(b), half(b + 2), dx[0], s32[0], s);
  }
};

// A 32-weight block's fifth bits (bit j of the little-endian word at qh: weight j's) as
// 0x10 or 0 in byte j: each byte takes its word's byte j / 8, keeps bit j % 8, and a compare
// makes that 0xff.
Q8_INLINE __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                          _mm256_set1_epi8(0x10));
}

struct Q5_0 {
  static constexpr int64_t kBytes = 22, kUnits = 1;
  static constexpr float kOffset = -16.0f;  // w = d (q - 16)
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float* s32, Sums& s) {
    const float d = half(b);
    one_unit<V>(_mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)), a, d, d, dx[0], s32[0], s);
  }
};

struct Q5_1 {
  static constexpr int64_t kBytes = 24, kUnits = 1;
  static constexpr float kOffset = 1.0f;  // w = d q + m
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float* s32, Sums& s) {
    one_unit<V>(_mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)), a, half(b), half(b + 2),
                dx[0], s32[0], s);
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34, kUnits = 1;
  static constexpr float kOffset = 0.0f;  // w = d q
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float*, Sums& s) {
    // Signed by signed: |q| (unsigned; -128 becomes 128) by a with q's sign.
    const __m256i q = load256(b + 2);
    const __m256 p = _mm256_cvtepi32_ps(dot4<V>(_mm256_abs_epi8(q), _mm256_sign_epi8(load256(a), q)));
    s.acc[0] = _mm256_fmadd_ps(p, _mm256_set1_ps(half(b) * dx[0]), s.acc[0]);
  }
};

// Eight floats of the unsigned bytes at p.
Q8_INLINE __m256 bytes8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

struct Q4_K {
  static constexpr int64_t kBytes = 144, kUnits = 8;
  static constexpr float kOffset = -1.0f;  // w = (d sc) q - (dmin m)
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float*,
                              const float* s32, Sums& s) {
    uint8_t sm[16];
    nanoserve::unpack_k_scales(b + 4, sm);
    // unit u's d * sc_u * dx_u in lane u
    const __m256 scale = _mm256_mul_ps(_mm256_mul_ps(bytes8(sm), _mm256_set1_ps(half(b))),
                                       _mm256_loadu_ps(dx));
    s.offv = _mm256_fmadd_ps(_mm256_mul_ps(bytes8(sm + 8), _mm256_set1_ps(half(b + 2))),
                             _mm256_loadu_ps(s32), s.offv);
    const uint8_t* qs = b + 16;
#if defined(NANOSERVE_AVX512)
    // Units 2j and 2j + 1 in one register: the 32 bytes twice, the upper copy shifted.
    const __m512 scale16 = _mm512_castps256_ps512(scale);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_broadcast_i64x4(load256(qs + 32 * j));
      const __m512i q = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xffff0000u, v, 4),
                                         _mm512_set1_epi8(0x0f));
      const __m512 p = _mm512_cvtepi32_ps(dot4<V>(q, _mm512_loadu_si512(a + 64 * j)));
      const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1), 1);
      s.wide[j % 2] = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(pick, scale16), s.wide[j % 2]);
    }
#else
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // units 2j (low nibbles) and 2j + 1 (high) share 32 bytes
      const __m256i v = load256(qs + 32 * j);
      const __m256 lo = _mm256_cvtepi32_ps(dot4<V>(low4(v), load256(a + 64 * j)));
      const __m256 hi = _mm256_cvtepi32_ps(dot4<V>(high4(v), load256(a + 64 * j + 32)));
      s.acc[(2 * j) % 4] = _mm256_fmadd_ps(lo, _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(2 * j)), s.acc[(2 * j) % 4]);
      s.acc[(2 * j + 1) % 4] = _mm256_fmadd_ps(hi, _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(2 * j + 1)), s.acc[(2 * j + 1) % 4]);
    }
#endif
  }
};

struct Q6_K {
  static constexpr int64_t kBytes = 210, kUnits = 8;
  static constexpr float kOffset = -32.0f;  // w = (d sc) (q - 32), a scale per 16 weights
  template <bool V>
  static Q8_INLINE void block(const uint8_t* b, const int8_t* a, const float* dx, const float* s16,
                              const float*, Sums& s) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256 d = _mm256_set1_ps(half(b + 208));
    // The 16 groups' d * sc (exact), for the offsets; times their unit's dx for the sums.
    const __m256 g0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))))),
                 g1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)))));
    s.offv = _mm256_fmadd_ps(g0, _mm256_loadu_ps(s16), s.offv);
    s.offv = _mm256_fmadd_ps(g1, _mm256_loadu_ps(s16 + 8), s.offv);
    const __m256 dxv = _mm256_loadu_ps(dx);
    // group i's d * sc_i * dx of its unit (i / 2), groups 0-7 and 8-15
    const __m256 scale[2] = {
        _mm256_mul_ps(g0, _mm256_permutevar8x32_ps(dxv, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))),
        _mm256_mul_ps(g1, _mm256_permutevar8x32_ps(dxv, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)))};
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {  // unit u = 4 g + v: weights 32 u .. 32 u + 31
      const int g = u / 4, v = u % 4;
      const __m256i l = load256(ql + 64 * g + 32 * (v % 2));
      const __m256i h = load256(qh + 32 * g);
      // the 2 high bits, bits 2v and 2v + 1 of the high byte, moved to bits 4 and 5
      const __m256i hb = v <= 2 ? _mm256_slli_epi16(h, 4 - 2 * v) : _mm256_srli_epi16(h, 2);
      const __m256i q = _mm256_or_si256(v < 2 ? low4(l) : high4(l),
                                        _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
      const __m256 p = _mm256_cvtepi32_ps(dot4<V>(q, load256(a + 32 * u)));
      // lanes 0-3 hold weights 0-15 (group 2u), lanes 4-7 weights 16-31 (group 2u + 1)
      const __m256i pick = _mm256_setr_epi32(2 * v, 2 * v, 2 * v, 2 * v, 2 * v + 1, 2 * v + 1,
                                             2 * v + 1, 2 * v + 1);
      s.acc[u % 4] = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(scale[g], pick), s.acc[u % 4]);
    }
  }
};

template <class F, bool V>
float row_dot(const Act8& x, const uint8_t* row, int64_t nb) {
  Sums s;
#pragma GCC unroll 2
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* block = row + i * F::kBytes;
    for (int64_t l = 0; l < F::kBytes; l += 64) __builtin_prefetch(block + kPrefetch + l);
    const int64_t u = i * F::kUnits;  // the block's first unit of 32 activations
    F::template block<V>(block, x.q.data() + u * kUnit, x.dx.data() + u,
                         x.sum16.data() + 2 * u, x.sum32.data() + u, s);
    // Blocks of one unit add into acc[0]: alternate the two chains (unrolled, no moves).
    if constexpr (F::kUnits == 1) std::swap(s.acc[0], s.acc[1]);
  }
  __m256 acc = _mm256_add_ps(_mm256_add_ps(s.acc[0], s.acc[1]), _mm256_add_ps(s.acc[2], s.acc[3]));
#if defined(NANOSERVE_AVX512)
  const __m512 w = _mm512_add_ps(s.wide[0], s.wide[1]);
  acc = _mm256_add_ps(acc, _mm256_add_ps(_mm512_castps512_ps256(w), _mm512_extractf32x8_ps(w, 1)));
#endif
  return hsum8(acc) + F::kOffset * (hsum8(s.offv) + s.off);
}

template <class F, bool V>
void gemv8(const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* out) {
  const Act8 act(x, K);
  const int64_t nb = K / (kUnit * F::kUnits), row_bytes = nb * F::kBytes;
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) out[n] = row_dot<F, V>(act, blocks + n * row_bytes, nb);
  });
}

template <class F>
void gemv8_any(bool vnni, const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* out) {
  if (vnni) return gemv8<F, true>(x, K, blocks, N, out);
  gemv8<F, false>(x, K, blocks, N, out);
}

}  // namespace

namespace nanoserve {

bool q8_format(const std::string& format) {
  return format == "q4_0" || format == "q4_1" || format == "q5_0" || format == "q5_1" ||
         format == "q8_0" || format == "q4_k" || format == "q6_k";
}

void q8_gemv(const at::Tensor& x, const at::Tensor& blocks, const std::string& format,
             bool vnni, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "q8_gemv: one float32 row of x, unit column strides");
  const int64_t K = x.size(1), N = blocks.size(0);
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (format == "q4_0") return gemv8_any<Q4_0>(vnni, xp, K, bp, N, op);
  if (format == "q4_1") return gemv8_any<Q4_1>(vnni, xp, K, bp, N, op);
  if (format == "q5_0") return gemv8_any<Q5_0>(vnni, xp, K, bp, N, op);
  if (format == "q5_1") return gemv8_any<Q5_1>(vnni, xp, K, bp, N, op);
  if (format == "q8_0") return gemv8_any<Q8_0>(vnni, xp, K, bp, N, op);
  if (format == "q4_k") return gemv8_any<Q4_K>(vnni, xp, K, bp, N, op);
  if (format == "q6_k") return gemv8_any<Q6_K>(vnni, xp, K, bp, N, op);
  TORCH_CHECK(false, "q8_gemv: no 8-bit-activation kernel for ", format);
}

}  // namespace nanoserve

#else  // the generic build: no 8-bit path (model/int8.py never asks it for one)

namespace nanoserve {

bool q8_format(const std::string&) { return false; }

void q8_gemv(const at::Tensor&, const at::Tensor&, const std::string& format, bool,
             const at::Tensor&) {
  TORCH_CHECK(false, "q8_gemv: the generic build has no 8-bit-activation kernels (", format, ")");
}

}  // namespace nanoserve

#endif
