// Batch-1 decode with 8-bit activations, opt-in (`--int8-activations`, model/int8.py).
//
// The default kernels (quant.cpp) turn every 4-bit weight into its float32 value and
// multiply it by a float32 activation: per 16 weights a widening, a lookup and a fused
// multiply-add, which on a Zen 4 core is instruction-bound below the memory's speed. This
// path does what llama.cpp does at batch 1: it rounds the one row of x to int8, one scale
// per 32 values (the largest magnitude maps to 127, as llama.cpp's Q8_0; per 256 for Q4_K
// and Q6_K, as its Q8_K), and multiplies the weights' raw quants by those int8s in integer
// dot products, four byte products summed into each 32-bit lane (AVX-512 VNNI's or
// AVX-VNNI's vpdpbusd where the CPU has it; else AVX2's vpmaddubsw and vpmaddwd, the same
// sums). Each unit's scale is applied once, to its integer sums (d * sc * dx); each offset
// (Q4_0's -8 d, Q4_1's m, Q4_K's mins) once, to the exact float32 sum of the activations it
// multiplies, so only the quants' products see rounded activations. Q6_K's offset (-32 d sc)
// is the exception: it goes into the integer sums, so that its weights meet the rounded
// activations whole (q6k_row says why).
//
// The integer sums do not depend on how they are formed (no product or pair overflows 16
// bits: at most 2 * 128 * 127; no superblock's sum overflows 32), so VNNI changes no bit.
// The float work is the same 256-bit code in the AVX2 and AVX-512 builds, and Q4_K's
// integer lanes hold the same sums in both (its kernel below), so the two builds give the
// same bits. A weight is read once, its rows taken by the threads in runs (rows.h).
//
// Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K (the synthetic Q4_0 and Q4_K_M files,
// SmolLM2's Q4_1 and Q8_0 head, Gemma's). Q5_K, F16 and BF16 keep the exact path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "rows.h"
#include "vec.h"

#if defined(NANOSERVE_AVX512) || defined(NANOSERVE_AVX2)

namespace {

#define Q8_INLINE inline __attribute__((always_inline))

constexpr int64_t kUnit = 32;  // activations per int8 scale, and weights per unit
// Bytes ahead each block's prefetch reaches: at two threads from DRAM, 2 KB left a 1B
// model's projections 2-4% faster than 1 KB (1-16 KB tried, in one process alternating).
constexpr int64_t kPrefetch = 2048;

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

// acc plus, in each 32-bit lane, the sum of four products of u's bytes (unsigned) by s's
// (signed): one vpdpbusd, written as assembly so that the library's compiler flags need not
// claim VNNI (the caller checks the CPU's flags): the EVEX form (AVX512-VNNI with VL) in the
// AVX-512 build, the VEX form (AVX-VNNI) in the AVX2 build. VNNI only.
Q8_INLINE __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(NANOSERVE_AVX512)
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
#else
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
#endif
  return acc;
}

// Those sums alone: dot4_acc from zero with VNNI, else vpmaddubsw and vpmaddwd (the same).
template <bool Vnni>
Q8_INLINE __m256i dot4(__m256i u, __m256i s) {
  if constexpr (Vnni) {
    return dot4_acc(_mm256_setzero_si256(), u, s);
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// acc plus each 32-bit lane's two products of p's 16-bit integers by s's: VNNI's vpdpwssd
// (the same EVEX or VEX choice as above), else vpmaddwd and an add; the same sums.
template <bool Vnni>
Q8_INLINE __m256i dot2(__m256i acc, __m256i p, __m256i s) {
  if constexpr (Vnni) {
#if defined(NANOSERVE_AVX512)
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(p), "v"(s));
#else
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(p), "x"(s));
#endif
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
  }
}

#if defined(NANOSERVE_AVX512)
template <bool Vnni>
Q8_INLINE __m512i dot2(__m512i acc, __m512i p, __m512i s) {
  if constexpr (Vnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(p), "v"(s));
    return acc;
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, s));
  }
}
#endif

Q8_INLINE __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
Q8_INLINE __m256i high4(__m256i v) { return low4(_mm256_srli_epi16(v, 4)); }

// A 32-weight block's 16 bytes of nibbles as its 32 quants in weight order: the low halves
// (weights 0-15), then the high halves (16-31).
Q8_INLINE __m256i nibbles32(const uint8_t* qs) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return low4(_mm256_srlv_epi64(both, _mm256_set_epi64x(4, 4, 0, 0)));
}

Q8_INLINE int32_t hsum_i32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
  return _mm_cvtsi128_si32(h);
}

// One row of x as the kernels read it: int8 values, one scale per `group` values (dx: 32
// for the one-unit formats, as llama.cpp's Q8_0; 256 for Q4_K and Q6_K, as its Q8_K), the
// exact float32 sums of each 32 values (the offsets' multipliers) and, where asked (Q6_K),
// the int8 values' sums of each 16 (its offsets'). The
// layout is the order the kernel reads the int8 values in: kPairs (Q4_K on AVX-512) stores
// each superblock's eight units of 32 in the order 0, 2, 1, 3, 4, 6, 5, 7, the order in which
// 64 bytes of Q4_K quants hold them; kSplit (Q4_0, Q4_1) stores each whole group of eight
// units as four 64-byte runs, run k: the first halves of units k and k + 4, then their second
// halves, the order in which one register holds two blocks' nibbles (`split_dot`); units
// after the last whole group stay in place.
enum class Layout { kNatural, kPairs, kSplit };

struct Act8 {
  std::vector<int8_t> q;
  std::vector<float> dx, sum32;
  std::vector<int16_t> qsum16;  // at most 16 * 127 in magnitude

  Act8(const float* x, int64_t K, int64_t group, Layout layout, bool qsums)
      : q(K), dx(K / group), sum32(K / kUnit), qsum16(qsums ? K / 16 : 0) {
    const int64_t split_units = layout == Layout::kSplit ? K / kUnit / 8 * 8 : 0;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / group; ++g) {
      const float* xg = x + g * group;
      __m256 m = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8) {
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xg + i)));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      dx[g] = amax / 127.0f;
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      for (int64_t u = 0; u < group / kUnit; ++u) {
        const int64_t b = g * (group / kUnit) + u;  // the unit of 32
        const float* xb = x + b * kUnit;
        __m256 v[4];
        __m256i r[4];
        for (int i = 0; i < 4; ++i) {
          v[i] = _mm256_loadu_ps(xb + 8 * i);
          r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest, ties even
        }
        // int32 -> int8, in order: the packs work within 128-bit lanes, hence the permute.
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        const __m256i ordered = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (b < split_units) {  // run b % 4 of its group; the second 16 bytes for b % 8 >= 4
          int8_t* run = q.data() + (b & ~int64_t{7}) * kUnit + (b & 3) * 64 + (b & 4) * 4;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(run), _mm256_castsi256_si128(ordered));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(run + 32), _mm256_extracti128_si256(ordered, 1));
        } else {
          const int64_t slot =
              layout == Layout::kPairs ? (b & ~int64_t{3}) | ((b & 1) << 1) | ((b >> 1) & 1) : b;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + slot * kUnit), ordered);
        }
        // two halves' sums, then theirs: the order (and so the bits) the offsets always had
        sum32[b] = hsum8(_mm256_add_ps(v[0], v[1])) + hsum8(_mm256_add_ps(v[2], v[3]));
        if (qsums) {
          qsum16[2 * b] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(r[0], r[1])));
          qsum16[2 * b + 1] = static_cast<int16_t>(hsum_i32(_mm256_add_epi32(r[2], r[3])));
        }
      }
    }
  }
};

Q8_INLINE int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- The one-unit formats: blocks of 32 weights, a float16 d (and m) each ----
//
// Each block's integer dot is formed as one 256-bit vector of partial sums; eight blocks'
// vectors are then summed lane-wise into one vector of eight dots (tree8), converted once
// and scaled by eight blocks' d * dx in one multiply-add. Block by block, each dot's
// horizontal sum, its conversion and its scalar scale were most of the work (one thread, in
// cache, Q4_0: 13 -> 20 GB/s). Q4_0 and Q4_1 form two blocks' dots in one vector
// (split_dot, tree4). A row's last nb % 8 blocks go one at a time.

// Sums lane-wise: lane i of the result is the sum of r[i]'s eight lanes.
Q8_INLINE __m256i tree8(const __m256i (&r)[8]) {
  __m256i a[4];
  for (int k = 0; k < 4; ++k) {
    a[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]),
                            _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]));
  }
  // Lanes of b0: partial sums of r0-r3, twice (each 128-bit half); b1: r4-r7.
  const __m256i b0 = _mm256_add_epi32(_mm256_unpacklo_epi64(a[0], a[1]), _mm256_unpackhi_epi64(a[0], a[1]));
  const __m256i b1 = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2], a[3]), _mm256_unpackhi_epi64(a[2], a[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                          _mm256_permute2x128_si256(b0, b1, 0x31));
}

// What a one-unit block's offset multiplies: nothing (Q8_0), its d (Q4_0, Q5_0: w = d (q - c))
// or its m (Q4_1, Q5_1: w = d q + m).
enum class Offset { kNone, kD, kM };

struct Q4_0 {
  static constexpr int64_t kBytes = 18;
  static constexpr int64_t kNibbles = 2;  // where the 16 bytes of nibbles start
  static constexpr float kOffset = -8.0f;
  static constexpr Offset kBy = Offset::kD;
  static Q8_INLINE __m256i quants(const uint8_t* b) { return nibbles32(b + kNibbles); }
};

struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static constexpr int64_t kNibbles = 4;
  static constexpr float kOffset = 1.0f;
  static constexpr Offset kBy = Offset::kM;
  static Q8_INLINE __m256i quants(const uint8_t* b) { return nibbles32(b + kNibbles); }
};

// The formats whose eight-block groups read two blocks a register (Act8's kSplit): their
// quants are nibbles alone (Q5's fifth bits would need spreading to match).
template <class F>
constexpr bool kSplit = std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>;

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
  static constexpr int64_t kBytes = 22;
  static constexpr float kOffset = -16.0f;
  static constexpr Offset kBy = Offset::kD;
  static Q8_INLINE __m256i quants(const uint8_t* b) {
    return _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2));
  }
};

struct Q5_1 {
  static constexpr int64_t kBytes = 24;
  static constexpr float kOffset = 1.0f;
  static constexpr Offset kBy = Offset::kM;
  static Q8_INLINE __m256i quants(const uint8_t* b) {
    return _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4));
  }
};

struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static constexpr float kOffset = 0.0f;
  static constexpr Offset kBy = Offset::kNone;
};

// A block's 32 quants times its 32 activations, as eight lanes of partial sums.
template <class F, bool V>
Q8_INLINE __m256i unit_dot(const uint8_t* b, const int8_t* a) {
  if constexpr (std::is_same_v<F, Q8_0>) {
    // Signed by signed: |q| (unsigned; -128 becomes 128) by a with q's sign.
    const __m256i q = load256(b + 2);
    return dot4<V>(_mm256_abs_epi8(q), _mm256_sign_epi8(load256(a), q));
  } else {
    return dot4<V>(F::quants(b), load256(a));
  }
}

// The first four bytes of eight blocks kBytes apart, one block's a 32-bit lane. Inserted
// one by one: written as _mm256_setr_epi32, GCC built it through the stack.
template <int64_t kBytes>
Q8_INLINE __m256i heads8(const uint8_t* b) {
  __m128i lo = _mm_cvtsi32_si128(load32(b)), hi = _mm_cvtsi32_si128(load32(b + 4 * kBytes));
  lo = _mm_insert_epi32(lo, load32(b + kBytes), 1);
  hi = _mm_insert_epi32(hi, load32(b + 5 * kBytes), 1);
  lo = _mm_insert_epi32(lo, load32(b + 2 * kBytes), 2);
  hi = _mm_insert_epi32(hi, load32(b + 6 * kBytes), 2);
  lo = _mm_insert_epi32(lo, load32(b + 3 * kBytes), 3);
  hi = _mm_insert_epi32(hi, load32(b + 7 * kBytes), 3);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// The float16 d of eight blocks kBytes apart (each block's first two bytes), in block order,
// for the formats without an m: assembled four to a 64-bit general-purpose register by
// loads, shifts and ors, then moved over two at a time. Through heads8's inserts, a 32-bit
// lane at a time, Q4_0's eight blocks took 20.1 cycles, now 16.3 (llvm-mca, Zen 3), and
// they stream 5-18% faster (one thread in L2, the two builds alternating in one process).
// The formats with an m keep heads8: for Q4_1, this twice (d, then m) gained as much on a
// quiet host and lost 5-9% on a busy one, where the added instructions count.
template <int64_t kBytes>
Q8_INLINE __m128i halves8(const uint8_t* b) {
  const auto four = [](const uint8_t* p) {
    uint16_t h[4];
    for (int k = 0; k < 4; ++k) std::memcpy(&h[k], p + k * kBytes, 2);
    return static_cast<int64_t>(h[0] | static_cast<uint64_t>(h[1]) << 16 |
                                static_cast<uint64_t>(h[2]) << 32 | static_cast<uint64_t>(h[3]) << 48);
  };
  return _mm_unpacklo_epi64(_mm_cvtsi64_si128(four(b)), _mm_cvtsi64_si128(four(b + 4 * kBytes)));
}

// Blocks k and k + 4 of an eight-block group at once: their 16 bytes of nibbles in one
// register (k's low 128 bits, k + 4's high), so one and, one shift and one more and unpack
// both, where one block alone took a broadcast, a shift and an and. `a`: Act8's run k (kSplit).
// Lanes 0-3: partial sums of block k's dot, lanes 4-7 of block k + 4's. Without VNNI the two
// halves' pair sums are added in 16 bits before widening: each is at most 2 * 15 * 127, so
// their sum fits.
template <class F, bool V>
Q8_INLINE __m256i split_dot(const uint8_t* b, const int8_t* a) {
  const __m128i* lo = reinterpret_cast<const __m128i*>(b + F::kNibbles);
  const __m128i* hi = reinterpret_cast<const __m128i*>(b + 4 * F::kBytes + F::kNibbles);
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(lo)), _mm_loadu_si128(hi), 1);
  const __m256i first = low4(v), second = high4(v);  // weights 0-15, then 16-31, of both
  if constexpr (V) {
    return dot4_acc(dot4<V>(first, load256(a)), second, load256(a + 32));
  } else {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, load256(a)),
                                           _mm256_maddubs_epi16(second, load256(a + 32)));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
}

// Lane i of the result: the sum of block i's partial sums, r[k] holding blocks k and k + 4
// (split_dot); the same sums tree8 gives, in the same lanes.
Q8_INLINE __m256i tree4(const __m256i (&r)[4]) {
  // Lanes of a: blocks 0, 1, 0, 1 | 4, 5, 4, 5; of c: 2, 3, 2, 3 | 6, 7, 6, 7.
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(r[0], r[1]), _mm256_unpackhi_epi32(r[0], r[1]));
  const __m256i c = _mm256_add_epi32(_mm256_unpacklo_epi32(r[2], r[3]), _mm256_unpackhi_epi32(r[2], r[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c));
}

template <class F, bool V>
Q8_INLINE __m256i group_dots(const Act8& x, const uint8_t* b, int64_t i) {
  if constexpr (kSplit<F>) {
    __m256i r[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) r[k] = split_dot<F, V>(b + k * F::kBytes, x.q.data() + i * kUnit + 64 * k);
    return tree4(r);
  } else {
    __m256i r[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) r[k] = unit_dot<F, V>(b + k * F::kBytes, x.q.data() + (i + k) * kUnit);
    return tree8(r);
  }
}

template <class F, bool V>
float one_unit_row(const Act8& x, const uint8_t* row, int64_t nb) {
  __m256 acc = _mm256_setzero_ps(), offv = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= nb; i += 8) {
    const uint8_t* b = row + i * F::kBytes;
    for (int64_t l = 0; l < 8 * F::kBytes; l += 64) __builtin_prefetch(b + kPrefetch + l);
    const __m256 dots = _mm256_cvtepi32_ps(group_dots<F, V>(x, b, i));
    const __m256 sum32 = _mm256_loadu_ps(x.sum32.data() + i);
    __m256 d;
    if constexpr (F::kBy == Offset::kM) {
      // The eight blocks' first four bytes: d and m as float16 pairs; d0-d7 to the low
      // 128 bits, m0-m7 to the high.
      const __m256i halves = _mm256_permute4x64_epi64(
          _mm256_shuffle_epi8(heads8<F::kBytes>(b),
                              _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                               0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)),
          0xd8);
      d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
      offv = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)), sum32, offv);
    } else {
      d = _mm256_cvtph_ps(halves8<F::kBytes>(b));
      if constexpr (F::kBy == Offset::kD) offv = _mm256_fmadd_ps(d, sum32, offv);
    }
    acc = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_loadu_ps(x.dx.data() + i)), acc);
  }
  float tail = 0.0f, tail_off = 0.0f;
  for (; i < nb; ++i) {
    const uint8_t* b = row + i * F::kBytes;
    const float d = half(b);
    tail += d * x.dx[i] * static_cast<float>(hsum_i32(unit_dot<F, V>(b, x.q.data() + i * kUnit)));
    if constexpr (F::kBy != Offset::kNone) tail_off += (F::kBy == Offset::kD ? d : half(b + 2)) * x.sum32[i];
  }
  return (hsum8(acc) + tail) + F::kOffset * (hsum8(offv) + tail_off);
}

// ---- The K-quants ----

// Q4_K: w = (d sc) q - (dmin m) for each unit of 32 weights, eight units a superblock. With x
// scaled once per superblock (Act8's group of 256, as llama.cpp's Q8_K), a superblock's
// products stay integers to its end: vpmaddubsw pairs the quants' products into 16 bits and
// vpmaddwd (or VNNI's vpdpwssd) multiplies those pairs by their unit's 6-bit scale into
// 32-bit sums, so a superblock costs one conversion and one multiply-add where each unit
// took its own (one thread, in cache: 18.6 -> 25 GB/s). Exact integers, and the same eight
// lanes on both builds (lane k: every unit's weights 4k..4k+3), so AVX2 and AVX-512 give the
// same bits. The offsets, as everywhere here, multiply the exact sums of x.
template <bool V>
float q4k_row(const Act8& x, const uint8_t* row, int64_t nb) {
  __m256 acc = _mm256_setzero_ps(), offv = _mm256_setzero_ps();
  // Walked by pointers (indexed, each superblock spent instructions on the offsets), with d
  // and dmin in one load and the scales in three: 17.9 -> 16.0 cycles a superblock
  // (llvm-mca, Zen 3, AVX2), 2-7% faster one thread in L2 (alternating in one process).
  const int8_t* a = x.q.data();
  const float *sum32 = x.sum32.data(), *dx = x.dx.data();
  for (const uint8_t* b = row; b < row + nb * 144; b += 144, a += 256, sum32 += 8, ++dx) {
    for (int64_t l = 0; l < 144; l += 64) __builtin_prefetch(b + kPrefetch + l);
    // d and dmin (lanes 0 and 1) in one load and one conversion: each float16 alone took a
    // vector insert.
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(load32(b)));
    // The eight 6-bit scales and mins, a byte each, unpacked in registers (as vec.h's
    // unpack_k_scales lays them out). Through a 16-byte array, each 8-byte read of what two
    // 4-byte writes made waited on store forwarding: two threads, weights in cache, 45 -> 53
    // GB/s on AVX-512, 42 -> 48 on AVX2. Three loads, not a memcpy: GCC stored that array to
    // the stack as well.
    const uint32_t w[3] = {static_cast<uint32_t>(load32(b + 4)), static_cast<uint32_t>(load32(b + 8)),
                           static_cast<uint32_t>(load32(b + 12))};
    const int64_t scales = static_cast<int64_t>(
        (w[0] & 0x3f3f3f3fu) |
        (static_cast<uint64_t>((w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u)) << 32));
    const int64_t mins = static_cast<int64_t>(
        (w[1] & 0x3f3f3f3fu) |
        (static_cast<uint64_t>(((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u)) << 32));
    const __m256 mins_f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins)));
    offv = _mm256_fmadd_ps(_mm256_mul_ps(mins_f, _mm256_broadcastss_ps(_mm_movehdup_ps(dm))),
                           _mm256_loadu_ps(sum32), offv);
    const uint8_t* qs = b + 16;
#if defined(NANOSERVE_AVX512)
    // 64 bytes of quants: units 4h and 4h + 2 in their low nibbles, 4h + 1 and 4h + 3 in
    // their high ones; Act8 stored x's units in that order (pairs).
    const __m512i sc = _mm512_set1_epi64(scales);
    __m512i sums = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(qs + 64 * h);
      const __m512i m = _mm512_set1_epi8(0x0f);
      const __m512i lo = _mm512_maddubs_epi16(_mm512_and_si512(v, m), _mm512_loadu_si512(a + 128 * h));
      const __m512i hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), m),
                                              _mm512_loadu_si512(a + 128 * h + 64));
      // Unit u's scale as a 16-bit integer: byte u, then a zero byte (z). vpshufb picks
      // within each 128-bit lane, and each lane holds the eight scales.
      const char u0 = static_cast<char>(4 * h), u1 = static_cast<char>(4 * h + 1),
                 u2 = static_cast<char>(4 * h + 2), u3 = static_cast<char>(4 * h + 3),
                 z = static_cast<char>(0x80);
      const __m512i lo_sc = _mm512_set_epi8(
          z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2, z, u2,
          z, u2, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0, z, u0,
          z, u0, z, u0);
      const __m512i hi_sc = _mm512_set_epi8(
          z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3, z, u3,
          z, u3, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1, z, u1,
          z, u1, z, u1);
      sums = dot2<V>(sums, lo, _mm512_shuffle_epi8(sc, lo_sc));
      sums = dot2<V>(sums, hi, _mm512_shuffle_epi8(sc, hi_sc));
    }
    const __m256i total = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
#else
    const __m256i sc = _mm256_set1_epi64x(scales);
    __m256i total = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // units 2j (low nibbles) and 2j + 1 (high) share 32 bytes
      const __m256i v = load256(qs + 32 * j);
      const __m256i lo = _mm256_maddubs_epi16(low4(v), load256(a + 64 * j));
      const __m256i hi = _mm256_maddubs_epi16(high4(v), load256(a + 64 * j + 32));
      total = dot2<V>(total, lo, _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (2 * j)))));
      total = dot2<V>(total, hi, _mm256_shuffle_epi8(sc, _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (2 * j + 1)))));
    }
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                          _mm256_broadcastss_ps(_mm_mul_ss(dm, _mm_load_ss(dx))), acc);
  }
  return hsum8(acc) - hsum8(offv);
}

// Q6_K: w = (d sc) (q - 32), a signed 8-bit scale per 16 weights. As Q4_K, x is scaled
// once per superblock (llama.cpp's Q8_K), so the superblock's products stay integers to its
// end: vpmaddubsw pairs the 6-bit quants' products into 16 bits (at most 2 * 63 * 127),
// vpmaddwd (VNNI's vpdpwssd) multiplies each pair by its group's scale into 32-bit lanes,
// and the offset, -32 sc times each group's sum of int8 activations, starts those lanes
// (in all, at most 32 * 2 * 128 * 2032 + 8 * 2 * 16002 * 128 in a lane). A superblock costs
// one conversion and one multiply-add: with x scaled per unit of 32, each unit's dot was
// converted and multiplied by its two scales in floats, and the offsets took the exact sums
// of x. 27.9 -> 21.4 cycles a superblock (llvm-mca, Zen 3, AVX2); one thread, in L2, 18.0
// -> 24.5 GB/s (in one process, alternating).
//
// Why the offset takes the rounded activations: q - 32 is centred, and q alone is not, so
// rounding x under all of w errs less than rounding it under q and taking -32 exactly. Mean
// KL from the exact path in batch-1 decode (scripts/int8_kl.py --chunk 1), on SmolLM2
// requantized to Q6_K (its down projections; the rest Q8_0): over 1,000 tokens 0.0099 with
// x per 32, 0.0086 per 256 as here; over 400, 0.0336 per 256 with the offsets exact
// (models.md has Gemma's and the rest).
template <bool V>
float q6k_row(const Act8& x, const uint8_t* row, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  const int16_t* qs16 = x.qsum16.data();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + i * 210;
    for (int64_t l = 0; l < 210; l += 64) __builtin_prefetch(b + kPrefetch + l);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* a = x.q.data() + 256 * i;
    const float d = half(b + 208);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    // The scales as 16-bit integers, the even groups' in the low 128 bits and the odd
    // groups' in the high: unit u's two (groups 2u and 2u + 1, its weights 0-15 and 16-31)
    // are then one vpshufb of word u away, each in the half where vpmaddubsw left its pairs.
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
        sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
    // The offset, -32 sc times each group's sum of x's int8 values, in the same integers.
    const __m256i off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc), load256(qs16 + 16 * i));
    __m256i total = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), off), 5);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {  // unit u = 4 g + v: weights 32 u .. 32 u + 31
      const int g = u / 4, v = u % 4;
      const __m256i l = load256(ql + 64 * g + 32 * (v % 2));
      const __m256i h = load256(qh + 32 * g);
      // the 2 high bits, bits 2v and 2v + 1 of the high byte, moved to bits 4 and 5
      const __m256i hb = v <= 2 ? _mm256_slli_epi16(h, 4 - 2 * v) : _mm256_srli_epi16(h, 2);
      const __m256i q = _mm256_or_si256(v < 2 ? low4(l) : high4(l),
                                        _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
      const __m256i pick = _mm256_set1_epi16(static_cast<int16_t>((2 * u + 1) << 8 | 2 * u));
      total = dot2<V>(total, _mm256_maddubs_epi16(q, load256(a + 32 * u)),
                      _mm256_shuffle_epi8(sc16, pick));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * x.dx[i]), acc);
  }
  return hsum8(acc);
}

struct Q4_K {};
struct Q6_K {};

// Each format's x: its scale group, its unit order, and its row's dot.
template <class F>
constexpr int64_t kGroup = std::is_same_v<F, Q4_K> || std::is_same_v<F, Q6_K> ? 256 : kUnit;

template <class F, bool V>
float row_dot(const Act8& x, const uint8_t* row, int64_t K) {
  if constexpr (std::is_same_v<F, Q4_K>) {
    return q4k_row<V>(x, row, K / 256);
  } else if constexpr (std::is_same_v<F, Q6_K>) {
    return q6k_row<V>(x, row, K / 256);
  } else {
    return one_unit_row<F, V>(x, row, K / kUnit);
  }
}

template <class F>
int64_t row_bytes(int64_t K) {
  if constexpr (std::is_same_v<F, Q4_K>) return K / 256 * 144;
  else if constexpr (std::is_same_v<F, Q6_K>) return K / 256 * 210;
  else return K / kUnit * F::kBytes;
}

template <class F, bool V>
void gemv8(const float* x, int64_t K, const uint8_t* blocks, int64_t N, float* out) {
#if defined(NANOSERVE_AVX512)
  constexpr bool kPairs = std::is_same_v<F, Q4_K>;
#else
  constexpr bool kPairs = false;
#endif
  constexpr Layout kLayout = kPairs ? Layout::kPairs : kSplit<F> ? Layout::kSplit : Layout::kNatural;
  const Act8 act(x, K, kGroup<F>, kLayout, std::is_same_v<F, Q6_K>);
  const int64_t bytes = row_bytes<F>(K);
  // Each thread walks each run of rows it takes (rows.h) as two streams, the run's first and
  // second half a row each in turn, so that more lines are in flight: two threads on a 1B's
  // matrices from DRAM (Zen 3, in one process against one stream a thread, alternating)
  // streamed 5% faster (nine runs of 16 pairs, medians 0.99-1.07x), four streams 7% slower.
  // Each row's sum is the same either way.
  nanoserve::guided_rows(N, bytes, [&](int64_t begin, int64_t end) {
    const int64_t half = (end - begin) / 2;
    for (int64_t n = begin; n < begin + half; ++n) {
      out[n] = row_dot<F, V>(act, blocks + n * bytes, K);
      out[n + half] = row_dot<F, V>(act, blocks + (n + half) * bytes, K);
    }
    if ((end - begin) % 2) out[end - 1] = row_dot<F, V>(act, blocks + (end - 1) * bytes, K);
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
