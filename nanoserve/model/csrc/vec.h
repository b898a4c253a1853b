// Small SIMD helpers shared by nanoserve's CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace nanoserve {

// 16 floats as one value: GCC's vector extension, lowered to one AVX-512 register or two
// AVX2 ones, whatever -march=native offers. Written out because the compiler does not
// vectorize a float reduction on its own (it may not reorder the additions).
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
