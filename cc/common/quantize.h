// Quantize-on-write for the FP8 and NVFP4 caches (MSA.md section 4); shared by the CPU write_kv handler
// and the CUDA write_kv kernel so both produce the same bytes as jax_msa/kv_cache.py.
// Divisions are IEEE (correctly rounded): never build this with fast-math.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#include "common/host_device.h"
#include "common/numeric.h"

namespace jax_msa {

// Two floats -> their float_to_e4m3_satfinite codes, lo's in the low byte. On sm_89+ one
// cvt.rn.satfinite.e4m3x2.f32 (ties to even, saturation to +-448, any NaN -> 0x7f: CUDA's own emulation of the
// instruction, cuda_fp8.hpp's __nv_cvt_float_to_fp8, maps NaN to the canonical 0x7f too) instead of the integer
// path's ~20 branchy instructions a value; tests/test_gpu_write_kv.py compares the kernel's bytes with the CPU
// handler's (ties, saturation, subnormals, NaN of either sign) and fails on any difference.
MSA_HD uint16_t float2_to_e4m3x2_satfinite(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));  // first source -> high byte
  return pair;
#else
  return uint16_t(float_to_e4m3_satfinite(lo) | (uint16_t(float_to_e4m3_satfinite(hi)) << 8));
#endif
}

// One E4M3 byte of a bf16-rounded value divided by the tensor scale (a NaN, of either sign, gives 0x7F).
MSA_HD uint8_t fp8_quantize(float x_bf16, float scale) { return float_to_e4m3_satfinite(x_bf16 / scale); }
// fp8_quantize of two values, the first in the low byte (one conversion instruction on sm_89+).
MSA_HD uint16_t fp8_quantize_pair(float x0_bf16, float x1_bf16, float scale) {
  return float2_to_e4m3x2_satfinite(x0_bf16 / scale, x1_bf16 / scale);
}

#if !defined(__CUDA_ARCH__)
// A double holding an exact real, rounded down / up to a float (host only: the GPU has directed-rounding instructions).
inline float round_down_to_float(double exact) {
  const float f = float(exact);
  return double(f) > exact ? std::nextafter(f, -HUGE_VALF) : f;
}
inline float round_up_to_float(double exact) {
  const float f = float(exact);
  return double(f) < exact ? std::nextafter(f, HUGE_VALF) : f;
}
#endif

// RD(a + b) and RU(a + b), the exact sum rounded down / up to a float. On the host the sum is taken in double, where
// it is exact for E2m1Bounds' operands (a = T * sf and b = ulp(T) / 2 * sf: exponents 24-25 apart, at most 7 and 4
// significant bits, so at most 32 bits in all), then rounded in the wanted direction.
MSA_HD float add_round_down(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rd(a, b);
#else
  return round_down_to_float(double(a) + double(b));
#endif
}
MSA_HD float add_round_up(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_ru(a, b);
#else
  return round_up_to_float(double(a) + double(b));
#endif
}

// RD(a * b + c) and RU(a * b + c), rounded once. On the host in double, exact for the operands used here:
// E2m1Bounds::of_numerator's (a = m u and b = n v with integers m, n < 2^24 and powers of two u, v; c = n u v / 2: the
// sum is n (2 m + 1) u v / 2, an integer below 2^49 times a power of two) and E2m1BoundsBf16x2::of's first step (a = T,
// b = sf, c = +-ulp(T) / 2 * sf: the product has at most 7 significant bits, the sum at most 33).
MSA_HD float mul_add_round_down(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rd(a, b, c);
#else
  return round_down_to_float(double(a) * double(b) + double(c));
#endif
}
MSA_HD float mul_add_round_up(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_ru(a, b, c);
#else
  return round_up_to_float(double(a) * double(b) + double(c));
#endif
}

// The largest float below a finite c > 0.
MSA_HD float float_below(float c) { return bits_to_float(float_to_bits(c) - 1u); }

// The E2M1 code of fl(y / sf) (float_to_e2m1_satfinite's, ties to even) for a float y and an E4M3 block scale sf > 0,
// without the division: |y| is compared with seven bounds made once a group. float_to_e2m1_satfinite tests F = fl(y / sf)
// against the midpoints T between codes, F <= T for T = 0.25, 1.25, 2.5, 5 and F < T for T = 0.75, 1.75, 3.5. Each T
// has an even last mantissa bit and is not a power of two where the test is "<", so with h = ulp(T) / 2:
//   F <= T  iff  y / sf <= T + h  (the tie T + h rounds to the even T)  iff  |y| <= RD((T + h) * sf)
//   F <  T  iff  y / sf <  T - h  (the tie T - h rounds to the even T)  iff  |y| <  RU((T - h) * sf)
//                                                                     iff  |y| <= the float below RU((T - h) * sf)
// (a float is <= a real iff it is <= the real rounded down, < iff < the real rounded up). T * sf (at most 3 + 4
// significant bits) and h * sf (h a power of two) are exact floats, so one directed add makes each bound. The seven
// bounds increase, and code m is how many of them |y| exceeds (NaN exceeds all: code 7, as in float_to_e2m1_satfinite;
// so does infinity), found by a binary search: three compares, no branch. The sign is y's (that of fl(y / sf)).
struct E2m1Bounds {
  float bound[7];  // |y| <= bound[i] iff fl(|y| / sf) is at most the i-th midpoint's code, i
  MSA_HD explicit E2m1Bounds(float sf)
      : bound{add_round_down(0.25f * sf, 0x1p-26f * sf), float_below(add_round_up(0.75f * sf, -0x1p-25f * sf)),
              add_round_down(1.25f * sf, 0x1p-24f * sf), float_below(add_round_up(1.75f * sf, -0x1p-24f * sf)),
              add_round_down(2.5f * sf, 0x1p-23f * sf),  float_below(add_round_up(3.5f * sf, -0x1p-23f * sf)),
              add_round_down(5.0f * sf, 0x1p-22f * sf)} {}
  // The bounds on x whose codes are those of fl(x / g): code(x) of the result == code(fl(x / g)) of this, for every
  // float x, when divides_exactly(g). For a bound b and the real q = |x| / g: fl(q) <= b iff q < b + h, h half the gap
  // to the float above b (q = b + h exactly cannot happen: with b = m u, g = n v, m in [2^23, 2^24), n odd, u, v powers
  // of two, x = (b + h) g = n (2 m + 1) u v / 2 would need 25 or more significant bits). So fl(q) <= b iff |x| < (b +
  // h) g iff |x| <= RD(b g + h g), not a float either; h g is exact (h a power of two, h g >= 2^-35 2^-90 normal:
  // every bound is at least 2^-11), so one fma rounded down makes each bound. NaN and infinity still exceed all of
  // them; a finite x whose fl(x / g) overflows exceeds the last (at most 2240 g < 2^112); x's sign is fl(x / g)'s.
  MSA_HD static bool divides_exactly(float g) { return g >= 0x1p-90f && g <= 0x1p100f; }  // false for NaN
  MSA_HD E2m1Bounds of_numerator(float g) const {
    E2m1Bounds on_x = *this;
    for (int i = 0; i < 7; ++i) {
      const float b = bound[i];
      on_x.bound[i] = mul_add_round_down(b, g, (bits_to_float(float_to_bits(b) + 1u) - b) * 0.5f * g);
    }
    return on_x;
  }
  MSA_HD uint8_t code(float y) const {
    const float a = bits_to_float(float_to_bits(y) & 0x7fffffffu);
    const bool above_3 = !(a <= bound[3]);  // "!(<=)": true for NaN
    const bool above_1_or_5 = !(a <= (above_3 ? bound[5] : bound[1]));
    const float last = above_3 ? (above_1_or_5 ? bound[6] : bound[4]) : (above_1_or_5 ? bound[2] : bound[0]);
    const uint32_t m = (above_3 ? 4u : 0u) + (above_1_or_5 ? 2u : 0u) + (!(a <= last) ? 1u : 0u);
    if (m == 0) return 0;
    return uint8_t(((float_to_bits(y) >> 31) ? 0x8u : 0x0u) | m);
  }
};

// The block scale before its E4M3 rounding, max(amax_over_6 / global, 2^-9), for amax_over_6 = fl(max(amax, 1e-12) / 6).
MSA_HD float nvfp4_unrounded_scale(float amax_over_6, float global_scale) {
  const float s = amax_over_6 / global_scale;
  return s > 0.001953125f ? s : 0.001953125f;
}

// The E4M3 block scale of a group whose largest magnitude is amax (not NaN): e4m3_satfinite(max((max(amax, 1e-12) / 6)
// / global, 2^-9)).
MSA_HD uint8_t nvfp4_scale_code(float amax, float global_scale) {
  const float s = nvfp4_unrounded_scale((amax > 1e-12f ? amax : 1e-12f) / 6.0f, global_scale);
  return uint8_t(float2_to_e4m3x2_satfinite(s, 0.0f));  // one instruction on sm_89+
}

// One 16-value NVFP4 group: x holds bf16-rounded values. Writes 8 data bytes (low nibble = even index)
// and returns the E4M3 scale byte.
//   sf   = e4m3_satfinite(max((max(amax, 1e-12) / 6) / global, 2^-9))
//   code = e2m1_satfinite_rne((x / global) / sf)   (both divisions by comparisons with bounds on x: E2m1Bounds; the
//                                                   first stays a division for a global scale outside [2^-90, 2^100])
// A group holding a NaN (outside MSA.md's contract) reads back as 16 NaNs: scale byte 0x7F (E4M3 NaN), data bytes 0,
// whatever the NaNs' signs and payloads (docs/FORMATS.md; jax_msa/kv_cache.py does the same).
MSA_HD uint8_t nvfp4_quantize_group(const float* x, float global_scale, uint8_t* data) {
  float amax = 0.0f;
  bool has_nan = false;
  for (int i = 0; i < 16; ++i) {
    const float a = x[i] < 0.0f ? -x[i] : x[i];
    has_nan = has_nan || a != a;
    amax = a > amax ? a : amax;
  }
  if (has_nan) {
    for (int j = 0; j < 8; ++j) data[j] = 0;
    return 0x7f;
  }
  const uint8_t sf_code = nvfp4_scale_code(amax, global_scale);
  const E2m1Bounds bounds(e4m3_to_float(sf_code));
  if (E2m1Bounds::divides_exactly(global_scale)) {  // the first division too by the bounds: on x itself
    const E2m1Bounds on_x = bounds.of_numerator(global_scale);
    for (int j = 0; j < 8; ++j) data[j] = uint8_t(on_x.code(x[2 * j]) | (on_x.code(x[2 * j + 1]) << 4));
  } else {
    for (int j = 0; j < 8; ++j)
      data[j] = uint8_t(bounds.code(x[2 * j] / global_scale) | (bounds.code(x[2 * j + 1] / global_scale) << 4));
  }
  return sf_code;
}

// Two bf16 values in a word (the first in the low half), the layout the kernels load. On sm_90+ each primitive is one
// instruction (HSET2.BF16_V2, VIMNMX.U16x2, PRMT); elsewhere (the host, older GPUs) its definition.
// Per half: 0xffff where a > b or either is NaN (set.gtu), else 0.
MSA_HD uint32_t bf16x2_greater_mask(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("set.gtu.u32.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  uint32_t r = 0;
  for (int h = 0; h < 32; h += 16)
    if (!(bf16_bits_to_float(uint16_t(a >> h)) <= bf16_bits_to_float(uint16_t(b >> h)))) r |= 0xffffu << h;
  return r;
#endif
}
// Per half: the larger of two unsigned 16-bit integers.
MSA_HD uint32_t u16x2_max(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  const uint32_t lo = (a & 0xffffu) > (b & 0xffffu) ? (a & 0xffffu) : (b & 0xffffu);
  const uint32_t hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return lo | (hi << 16);
#endif
}
// Per bit: m's 1 bits pick a, its 0 bits b (one LOP3).
MSA_HD uint32_t select_bits(uint32_t m, uint32_t a, uint32_t b) { return (m & a) | (~m & b); }
// The low halves of a (low) and b (high) in one word.
MSA_HD uint32_t low_halves(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, 0x5410);
#else
  return (a & 0xffffu) | (b << 16);
#endif
}
// A float's high half (its bf16 rounded toward zero) in both halves.
MSA_HD uint32_t high_half_in_both(float f) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(float_to_bits(f), 0u, 0x3232);
#else
  const uint32_t h = float_to_bits(f) >> 16;
  return h | (h << 16);
#endif
}
// The E4M3 value of the code in pair's low byte (pair's bytes equal: then either byte's), as a float. On the GPU
// through f16 (exact: every E4M3 value is an f16), CUDA's conversion the decode's e4m3x2_to_f16x2 uses: one
// cvt.rn.f16x2.e4m3x2 on sm_89+, then one f16 -> f32 conversion.
MSA_HD float e4m3_pair_to_float(uint16_t pair) {
#if defined(__CUDA_ARCH__)
  __half_raw low;
  low.x = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3).x;
  return __half2float(__half(low));
#else
  return e4m3_to_float(uint8_t(pair));
#endif
}

// fl(max(a, 1e-12) / 6) for a finite bf16 value a >= 0, without the division: q = fl(m * fl(1/6)) is within an ulp
// of the quotient, the residual m - 6 q is exact (one fma), and one more fma corrects q. For a = infinity, the largest
// bf16's: above 2^124, so that its scale code, divided by any global scale of E2m1Bounds::divides_exactly's range, is
// infinity's (448, saturated). tests/cc/nvfp4_bf16x2_check.cc checks both against the division.
MSA_HD float bf16_amax_over_6(float a) {
  const float m = fminf(fmaxf(a, 1e-12f), 0x1.fep127f);
  const float q = m * (1.0f / 6.0f);
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(__fmaf_rn(-6.0f, q, m), 1.0f / 6.0f, q);
#else
  return std::fma(std::fma(-6.0f, q, m), 1.0f / 6.0f, q);
#endif
}

// E2m1Bounds::code of two bf16 values at once. For a bf16 x and a float b > 0, x <= b iff x <= RD_bf16(b) (the
// largest bf16 not above b, b's bits truncated), so the seven bounds rounded down to bf16 give the same codes, and
// two values share each compare and select. Magnitudes of bf16 without NaN compare as their bit patterns, so the
// packed compare of |x| with a bound is exact.
struct E2m1BoundsBf16x2 {
  uint32_t bound[7];  // RD_bf16 of E2m1Bounds::bound[i], in both halves
  E2m1BoundsBf16x2() = default;
  // The definition: from the float bounds.
  MSA_HD explicit E2m1BoundsBf16x2(const E2m1Bounds& b) {
    for (int i = 0; i < 7; ++i) bound[i] = high_half_in_both(b.bound[i]);  // the bounds are positive and finite
  }
  // The same bounds as E2m1BoundsBf16x2(E2m1Bounds(sf).of_numerator(g)) for a block scale sf (an E4M3 value > 0) and
  // a global scale g with E2m1Bounds::divides_exactly(g), in fewer instructions:
  // - E2m1Bounds(sf)'s RD(T sf + h sf) as one fma each (T sf and h sf are exact; the five products h sf shared);
  // - of_numerator's h_b g (h_b = ulp(b) / 2 = 2^(E(b) - 24)) by adding b's exponent, less 151, to g's bits: g and the
  //   product 2^(E(b) - 24) g (E(b) in [-11, 11], g in [2^-90, 2^100]) are normal floats, so that is exact.
  // tests/cc/nvfp4_bf16x2_check.cc compares every bound with the definition's.
  MSA_HD static E2m1BoundsBf16x2 of(float sf, float g) {
    const float h26 = sf * 0x1p-26f, h25 = sf * 0x1p-25f, h24 = sf * 0x1p-24f, h23 = sf * 0x1p-23f,
                h22 = sf * 0x1p-22f;
    const float b[7] = {mul_add_round_down(0.25f, sf, h26), float_below(mul_add_round_up(0.75f, sf, -h25)),
                        mul_add_round_down(1.25f, sf, h24), float_below(mul_add_round_up(1.75f, sf, -h24)),
                        mul_add_round_down(2.5f, sf, h23),  float_below(mul_add_round_up(3.5f, sf, -h23)),
                        mul_add_round_down(5.0f, sf, h22)};
    const uint32_t g_less_151 = float_to_bits(g) - (151u << 23);
    E2m1BoundsBf16x2 r;
    for (int i = 0; i < 7; ++i) {
      const float half_ulp_times_g = bits_to_float(g_less_151 + (float_to_bits(b[i]) & 0x7f800000u));
      r.bound[i] = high_half_in_both(mul_add_round_down(b[i], g, half_ulp_times_g));
    }
    return r;
  }
  // The codes of w's two values in bits 12-15 (the low half's) and 28-31: the search of E2m1Bounds::code on each half,
  // the sign bits where the code is not 0 then being w's own.
  MSA_HD uint32_t codes(uint32_t w) const {
    const uint32_t a = w & 0x7fff7fffu;
    const uint32_t above_3 = bf16x2_greater_mask(a, bound[3]);
    const uint32_t above_1_or_5 = bf16x2_greater_mask(a, select_bits(above_3, bound[5], bound[1]));
    const uint32_t last = select_bits(above_3, select_bits(above_1_or_5, bound[6], bound[4]),
                                      select_bits(above_1_or_5, bound[2], bound[0]));
    const uint32_t above_last = bf16x2_greater_mask(a, last);
    const uint32_t nonzero = bf16x2_greater_mask(a, bound[0]);  // code m > 0: the sign is kept
    // bit 14 of each half above_3, bit 12 above_last, the others above_1_or_5 (bit 13 the one kept)
    const uint32_t m = select_bits(0x10001000u, above_last, select_bits(0x40004000u, above_3, above_1_or_5));
    return (m & 0x70007000u) | (w & nonzero & 0x80008000u);
  }
  // The data bytes of two words' codes (codes(w0), codes(w1)): byte 0 holds w0's values (the low half's code in the
  // low nibble), byte 1 w1's, in the low 16 bits of the result (the rest is not defined).
  MSA_HD static uint32_t two_bytes(uint32_t c0, uint32_t c1) {
    const uint32_t t = (c0 >> 12) | (c1 >> 4);  // nibbles: c0 low, c1 low, c0 high, c1 high in bytes 0-3
    return t | (t >> 12);
  }
};

// nvfp4_quantize_group's bytes from the group as loaded: w[i] holds values 2i (low half) and 2i + 1 as bf16. The data
// bytes go to q (byte j of the group in byte j % 4 of q[j / 4]); returns the scale byte. The amax is the largest
// magnitude's bit pattern (a NaN's is larger than any other), its division by 6 bf16_amax_over_6, the codes two a
// compare (E2m1BoundsBf16x2); for a global scale outside divides_exactly's range the values go through
// nvfp4_quantize_group.
MSA_HD uint8_t nvfp4_quantize_group_bf16x2(const uint32_t (&w)[8], float global_scale, uint32_t (&q)[2]) {
  if (!E2m1Bounds::divides_exactly(global_scale)) {
    float x[16];
    bf16_pairs_to_float(w, x);
    uint8_t data[8];
    const uint8_t sf_code = nvfp4_quantize_group(x, global_scale, data);
    q[0] = q[1] = 0u;
    for (int j = 0; j < 8; ++j) q[j / 4] |= uint32_t(data[j]) << (8 * (j % 4));
    return sf_code;
  }
  uint32_t amax2 = 0u;
  for (int i = 0; i < 8; ++i) amax2 = u16x2_max(amax2, w[i] & 0x7fff7fffu);
  const uint32_t amax_bits = (amax2 & 0xffffu) > (amax2 >> 16) ? (amax2 & 0xffffu) : (amax2 >> 16);
  if (amax_bits > 0x7f80u) {  // a NaN
    q[0] = q[1] = 0u;
    return 0x7f;
  }
  // nvfp4_scale_code's steps, the code in both bytes of the pair
  const float s = nvfp4_unrounded_scale(bf16_amax_over_6(bf16_bits_to_float(uint16_t(amax_bits))), global_scale);
  const uint16_t sf_pair = float2_to_e4m3x2_satfinite(s, s);
  const E2m1BoundsBf16x2 on_x = E2m1BoundsBf16x2::of(e4m3_pair_to_float(sf_pair), global_scale);
  for (int k = 0; k < 2; ++k) {
    const uint32_t c0 = on_x.codes(w[4 * k]), c1 = on_x.codes(w[4 * k + 1]), c2 = on_x.codes(w[4 * k + 2]),
                   c3 = on_x.codes(w[4 * k + 3]);
    q[k] = low_halves(E2m1BoundsBf16x2::two_bytes(c0, c1), E2m1BoundsBf16x2::two_bytes(c2, c3));
  }
  return uint8_t(sf_pair);
}

}  // namespace jax_msa
