// The packed NVFP4 quantizer the write_kv kernel runs (nvfp4_quantize_group_bf16x2, cc/common/quantize.h: two bf16
// values a compare) against the scalar one the CPU handler runs (nvfp4_quantize_group), on the host, where the
// packed primitives are their definitions (on sm_90+ they are single instructions: tests/test_gpu_write_kv.py compares
// the kernel's bytes with the CPU handler's for every bf16 value). Three parts:
// 0. its shortcuts against their definitions: E2m1BoundsBf16x2::of's bounds against those rounded down from
//    E2m1Bounds(sf).of_numerator(g) (every block scale, 27 global scales), bf16_amax_over_6 against the division for
//    every finite bf16 value >= 0;
// 1. E2m1BoundsBf16x2::codes against E2m1Bounds::code for every bf16 bit pattern (paired with its negation's
//    neighbour), every block scale and the 27 global scales;
// 2. whole groups (scale byte and data bytes): every bf16 bit pattern in groups of 16 consecutive ones, random groups
//    of random patterns, groups of one magnitude range, groups with a NaN or an infinity, for the same global scales
//    and two outside divides_exactly's range.
// Prints the counts; exits 1 on a mismatch. Built and run by tests/test_quantize_bounds.py.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "common/quantize.h"

using namespace jax_msa;

int main() {
  long mismatches = 0, checks = 0;
  std::mt19937_64 rng(7);
  std::vector<float> globals = {1.0f, 0.5f, 2.0f, 0.0371f, 3.0e-3f, 7.0f, 0.125f, 448.0f, 1.0f / 3.0f, 0x1p-90f,
                                0x1.000002p-90f, 0x1p100f, 0x1.fffffep99f, 1e-20f, 1e20f};
  std::uniform_real_distribution<float> log2_g(-90.0f, 100.0f);
  for (int i = 0; i < 12; ++i) globals.push_back(std::exp2(log2_g(rng)));

  // 0. the shortcuts
  long shortcut_checks = 0;
  for (float g : globals) {
    for (int code = 1; code < 127; ++code) {
      const float sf = e4m3_to_float(uint8_t(code));
      const E2m1BoundsBf16x2 want(E2m1Bounds(sf).of_numerator(g)), got = E2m1BoundsBf16x2::of(sf, g);
      for (int i = 0; i < 7; ++i) {
        ++shortcut_checks;
        if (want.bound[i] != got.bound[i] && mismatches++ < 10)
          printf("bound mismatch: g = %a, sf code %d, bound %d: %#x, definition %#x\n", g, code, i, got.bound[i],
                 want.bound[i]);
      }
    }
  }
  for (uint32_t v = 0; v < 0x7f80u; ++v) {  // every finite bf16 value >= 0
    const float a = bf16_bits_to_float(uint16_t(v));
    const float want = (a > 1e-12f ? a : 1e-12f) / 6.0f, got = bf16_amax_over_6(a);
    ++shortcut_checks;
    if (float_to_bits(want) != float_to_bits(got) && mismatches++ < 10)
      printf("amax / 6 mismatch: %#x: %a, division %a\n", v, got, want);
  }
  for (float g : globals) {  // infinity: a finite stand-in with infinity's scale code
    const float got = bf16_amax_over_6(HUGE_VALF);
    ++shortcut_checks;
    if (!(got > 0x1p124f && got < HUGE_VALF) || uint8_t(float2_to_e4m3x2_satfinite(got / g, 0.0f)) != 0x7e ||
        nvfp4_scale_code(HUGE_VALF, g) != 0x7e) {
      if (mismatches++ < 10) printf("amax / 6 of infinity: %a, g = %a\n", got, g);
    }
  }

  // 1. codes of every bf16 value, against the scalar search on the same (folded) bounds
  for (float g : globals) {
    for (int code = 1; code < 127; ++code) {
      const E2m1Bounds on_x = E2m1Bounds(e4m3_to_float(uint8_t(code))).of_numerator(g);
      const E2m1BoundsBf16x2 packed = E2m1BoundsBf16x2::of(e4m3_to_float(uint8_t(code)), g);
      for (uint32_t v = 0; v < 0x10000u; ++v) {
        if ((v & 0x7fffu) > 0x7f80u) continue;  // NaN: the group is all NaN before any code is taken
        const uint32_t partner = (v * 40503u + 0x1234u) & 0xffffu;
        if ((partner & 0x7fffu) > 0x7f80u) continue;
        const uint32_t c = packed.codes(v | (partner << 16));
        const uint32_t want_lo = on_x.code(bf16_bits_to_float(uint16_t(v)));
        const uint32_t want_hi = on_x.code(bf16_bits_to_float(uint16_t(partner)));
        checks += 2;
        if ((c & 0x0fff0fffu) != 0 || ((c >> 12) & 0xfu) != want_lo || (c >> 28) != want_hi) {
          if (mismatches++ < 10)
            printf("codes mismatch: g = %a, sf code %d, values %#x %#x: packed %#x, scalar %u %u\n", g, code, v, partner,
                   c, want_lo, want_hi);
        }
      }
    }
  }
  const long code_checks = checks;

  // 2. whole groups
  std::vector<float> group_globals = globals;
  group_globals.push_back(1e-30f);  // outside divides_exactly: the division path
  group_globals.push_back(1e35f);
  auto check_group = [&](const uint16_t (&v)[16], float g) {
    float x[16];
    uint32_t w[8];
    for (int i = 0; i < 16; ++i) x[i] = bf16_bits_to_float(v[i]);
    for (int i = 0; i < 8; ++i) w[i] = uint32_t(v[2 * i]) | (uint32_t(v[2 * i + 1]) << 16);
    uint8_t data[8];
    const uint8_t want_sf = nvfp4_quantize_group(x, g, data);
    uint32_t q[2];
    const uint8_t got_sf = nvfp4_quantize_group_bf16x2(w, g, q);
    bool same = want_sf == got_sf;
    for (int j = 0; j < 8; ++j) same = same && data[j] == uint8_t(q[j / 4] >> (8 * (j % 4)));
    ++checks;
    if (!same && mismatches++ < 10) {
      printf("group mismatch: g = %a, first value %#x: scale %#x / %#x, data", g, v[0], want_sf, got_sf);
      for (int j = 0; j < 8; ++j) printf(" %02x/%02x", data[j], unsigned(uint8_t(q[j / 4] >> (8 * (j % 4)))));
      printf("\n");
    }
  };
  std::uniform_int_distribution<uint32_t> bits16(0, 0xffff);
  std::uniform_int_distribution<int> exponent(0, 254), position(0, 15), spread(0, 24);
  for (float g : group_globals) {
    uint16_t v[16];
    for (uint32_t first = 0; first < 0x10000u; first += 16) {  // every bit pattern, NaN groups included
      for (int i = 0; i < 16; ++i) v[i] = uint16_t(first + i);
      check_group(v, g);
    }
    for (int n = 0; n < 20000; ++n) {  // random patterns
      for (int i = 0; i < 16; ++i) v[i] = uint16_t(bits16(rng));
      check_group(v, g);
    }
    for (int n = 0; n < 20000; ++n) {  // magnitudes within a range of 2^spread: the codes spread over 0..7
      const int top = exponent(rng), width = spread(rng);
      for (int i = 0; i < 16; ++i) {
        const int e = top - int(bits16(rng) % uint32_t(width + 1));
        v[i] = uint16_t((bits16(rng) & 0x807fu) | (uint32_t(e < 0 ? 0 : e) << 7));
      }
      if (n % 7 == 0) v[position(rng)] = uint16_t(0x7f80u | (bits16(rng) & 0x8000u));  // an infinity
      if (n % 11 == 0) v[position(rng)] = uint16_t(0x7fc1u | (bits16(rng) & 0x8000u));  // a NaN
      check_group(v, g);
    }
  }
  printf("%ld shortcut checks, %ld code checks, %ld group checks, %ld mismatches\n", shortcut_checks, code_checks,
         checks - code_checks, mismatches);
  return mismatches ? 1 : 0;
}
