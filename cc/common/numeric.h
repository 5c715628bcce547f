// Scalar conversions shared by the CPU handlers and the CUDA kernels: bf16, FP8 E4M3 and FP4 E2M1.
// Everything here is exact or correctly rounded (round to nearest, ties to even); no fast-math.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace jax_msa {

MSA_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

MSA_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// bf16 travels as its uint16 bit pattern (XLA FFI maps BF16 to uint16_t).
MSA_HD float bf16_bits_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round-to-nearest-even float -> bf16 bits; NaN stays NaN (quiet), infinities stay infinities.
MSA_HD uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

MSA_HD float round_to_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }

// N words of two bf16 each (the first in the low half) -> their 2 N values as floats, in order.
template <int N>
MSA_HD void bf16_pairs_to_float(const uint32_t (&w)[N], float (&x)[2 * N]) {
  for (int i = 0; i < N; ++i) {
    x[2 * i] = bf16_bits_to_float(uint16_t(w[i] & 0xffffu));
    x[2 * i + 1] = bf16_bits_to_float(uint16_t(w[i] >> 16));
  }
}

// FP8 E4M3 (fn variant: no infinities, S.1111.111 = NaN, max finite 448, bias 7, subnormals 2^-9 * m).
MSA_HD float e4m3_to_float(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {
    // subnormal: man * 2^-9, exact in float
    const float v = float(man) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// float -> E4M3 with round-to-nearest-even and saturation to +-448 (satfinite); NaN -> NaN (0x7f).
MSA_HD uint8_t float_to_e4m3_satfinite(float f) {
  const uint32_t u = float_to_bits(f);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;
  if (a >= 0x43e00000u) return uint8_t(sign | 0x7e);  // |f| >= 448 (and inf) -> 448
  const int exp = int(a >> 23) - 127;
  if (exp < -6) {
    // subnormal range of E4M3: value = m * 2^-9, m in [0, 8] (8 rolls into the smallest normal)
    // |f| * 2^9 rounded to nearest even integer; exact since |f| < 2^-6 and float has 24 bits.
    const float scaled = bits_to_float(a) * 512.0f;
    uint32_t m = uint32_t(scaled);
    const float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint8_t(sign | m);  // m == 8 encodes exp=1, man=0: the smallest normal, correct
  }
  // normal: keep 3 mantissa bits, RNE on the dropped 20 bits
  uint32_t man = a & 0x7fffffu;
  uint32_t e = uint32_t(exp + 7);
  uint32_t keep = man >> 20;
  const uint32_t rest = man & 0xfffffu;
  if (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) {
    ++keep;
    if (keep == 8u) {
      keep = 0;
      ++e;
    }
  }
  if (e > 15u || (e == 15u && keep == 7u)) return uint8_t(sign | 0x7e);
  return uint8_t(sign | (e << 3) | keep);
}

// FP4 E2M1 magnitudes indexed by the 3 low bits of a code; bit 3 is the sign.
MSA_HD float e2m1_to_float(uint8_t code) {
  const uint8_t m = code & 0x7u;
  // {0, 0.5, 1, 1.5, 2, 3, 4, 6}
  const float mag = m < 4 ? 0.5f * float(m) : (m < 6 ? float(m - 2) : float(2 * m - 8));
  return (code & 0x8u) ? -mag : mag;
}

// float -> E2M1 code, round to nearest even on the E2M1 grid, saturating at 6; a value that rounds to
// zero is stored as +0 (code 0), as the cache layout requires.
MSA_HD uint8_t float_to_e2m1_satfinite(float f) {
  const uint8_t sign = (float_to_bits(f) >> 31) ? 0x8u : 0x0u;
  const float a = f < 0.0f ? -f : f;
  uint8_t m;
  // Midpoints and their tie winners (even mantissa): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0,
  // 2.5->2.0, 3.5->4.0, 5.0->4.0.
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;  // includes +inf; NaN compares false everywhere above -> 7 as well
  if (m == 0) return 0;
  return uint8_t(sign | m);
}

}  // namespace jax_msa
