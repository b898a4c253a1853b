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

// 16 floats as one value: GCC's vector extension, lowered to one AVX-512 register, two
// AVX2 ones or four SSE ones, whatever the build's flags offer. The lane arithmetic is the
// same in every lowering. Written out because the compiler does not vectorize a float
// reduction on its own (it may not reorder the additions).
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline float hsum(v16 v) {
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

inline float hmax(v16 v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// e^x for x <= 0, as softmax needs after subtracting the maximum, 16 at a time.
// x = n ln2 + r with |r| <= ln2/2; e^r by its Taylor series to r^7 (the next term is below
// 6e-9 relative, under float32 rounding); 2^n put straight into the exponent bits.
inline v16 exp_nonpositive(v16 x) {
  const v16 lo = v16{} - 87.0f;  // keeps 2^n a normal float
  x = x < lo ? lo : x;
  // n = round(x / ln2): adding and taking away 1.5 * 2^23 rounds to an integer.
  const v16 magic = v16{} + 12582912.0f;
  const v16 n = (x * 1.44269504088896341f + magic) - magic;
  // ln2 split in two so that n * ln2_hi is exact.
  const v16 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  v16 p = v16{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace nanoserve
