// Small SIMD helpers shared by nanoserve's CPU kernels, and the instruction set this copy of
// them is built for.
//
// nanoserve builds its kernels once per instruction set (model/native.py): `avx512`
// (AVX-512 F/BW/DQ/VL with FMA and F16C), `avx2` (AVX2, FMA, F16C) and `generic` (the
// compiler's baseline for the machine), each into its own library whose ops live under
// `torch.ops.nanoserve_<isa>`; the one the CPU can run is picked at run time. The compiler
// flags of each build define the macros below, so one source serves all three.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__FMA__) && defined(__F16C__)
#define NANOSERVE_AVX512 1
#define NANOSERVE_ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define NANOSERVE_AVX2 1
#define NANOSERVE_ISA_NAME "avx2"
#else
#define NANOSERVE_ISA_NAME "generic"
#endif

#if defined(NANOSERVE_AVX512) || defined(NANOSERVE_AVX2)
#include <immintrin.h>
#endif

// The torch.ops namespace of this build: nanoserve_avx512, nanoserve_avx2, nanoserve_generic.
#ifndef NANOSERVE_NS
#error "build with -DNANOSERVE_NS=nanoserve_<isa> (model/native.py does)"
#endif

namespace nanoserve {

// kLanes floats as one value, the build's native register width: 16 (one AVX-512
// register), or 8 (one AVX2 register; the generic build lowers it however the machine
// can). GCC's vector extension, written out because the compiler does not vectorize a float
// reduction on its own (it may not reorder the additions). A 16-float vector on AVX2, as
// these kernels used before they had an AVX2 build, lowered badly there: SiLU took 9x and
// decode attention 3x the time they take on AVX-512.
#ifdef NANOSERVE_AVX512
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));

// Forced inline, as every helper of the hot loops must be: GCC left some of the AVX2 ones
// as calls, and each block's vectors then went through the stack.
inline __attribute__((always_inline)) vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline __attribute__((always_inline)) void store(float* p, vfloat v) {
  std::memcpy(p, &v, sizeof v);
}

// kLanes int8 values at p as floats (exact): a sign extension and a conversion. GCC
// scalarises a byte-to-float vector conversion, hence the intrinsics.
inline __attribute__((always_inline)) vfloat int8_lanes(const int8_t* p) {
#if defined(NANOSERVE_AVX512)
  return (vfloat)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(NANOSERVE_AVX2)
  return (vfloat)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat w;
  for (int64_t l = 0; l < kLanes; ++l) w[l] = static_cast<float>(p[l]);
  return w;
#endif
}

// The K-quants' (Q4_K, Q5_K) 6-bit scales and mins of a superblock's eight units, as
// scales of units 0-7 in bytes 0-7 and their mins in bytes 8-15, from the 12 packed bytes:
// units 0-3 in the low 6 bits of bytes u and u + 4; units 4-7 four bits from byte u + 4 (low
// half the scale, high half the min) and two from the top of bytes u - 4 and u. Four bytes
// at a time.
inline __attribute__((always_inline)) void unpack_k_scales(const uint8_t* s,
                                                           uint8_t (&out)[16]) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t packed[4] = {
      w[0] & 0x3f3f3f3fu, (w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u),
      w[1] & 0x3f3f3f3fu, ((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u)};
  std::memcpy(out, packed, 16);
}

inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

inline float hmax(vfloat v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// e^x for x <= 0, as softmax needs after subtracting the maximum, kLanes at a time.
// x = n ln2 + r with |r| <= ln2/2; e^r by its Taylor series to r^7 (the next term is below
// 6e-9 relative, under float32 rounding); 2^n put straight into the exponent bits.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f;  // keeps 2^n a normal float
  x = x < lo ? lo : x;
  // n = round(x / ln2): adding and taking away 1.5 * 2^23 rounds to an integer.
  const vfloat magic = vfloat{} + 12582912.0f;
  const vfloat n = (x * 1.44269504088896341f + magic) - magic;
  // ln2 split in two so that n * ln2_hi is exact.
  const vfloat r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace nanoserve
