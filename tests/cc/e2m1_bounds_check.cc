// E2m1Bounds (cc/common/quantize.h) against the division it replaces: for every E4M3 block scale a group can have
// (codes 1..126, 2^-9 .. 448), code(y) must equal float_to_e2m1_satfinite(y / sf) for the 400 floats around each of
// the seven boundaries y = T * sf (both signs), 20,000 uniform y in [0, 8 sf) (both signs), 20,000 random bit
// patterns (NaN and infinities among them) and the special values; then the same for of_numerator's bounds on x (the
// first division, by the global scale, folded in). Prints the counts; exits 1 on a mismatch.
// Built and run on the host by tests/test_quantize_bounds.py (the CUDA path differs only in its directed adds and
// fma, __fadd_rd / __fadd_ru / __fmaf_rd, which round the same exact values).
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "common/quantize.h"

using namespace jax_msa;

int main() {
  long mismatches = 0, checks = 0;
  std::mt19937_64 rng(1);
  auto check = [&](float y, float sf, const E2m1Bounds& bounds) {
    const uint8_t want = float_to_e2m1_satfinite(y / sf), got = bounds.code(y);
    ++checks;
    if (want != got && mismatches++ < 10) printf("mismatch: y = %a, sf = %a: division %u, bounds %u\n", y, sf, want, got);
  };
  const float midpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (int code = 1; code < 127; ++code) {
    const float sf = e4m3_to_float(uint8_t(code));
    const E2m1Bounds bounds(sf);
    for (float t : midpoints) {
      float y = t * sf;
      for (int i = 0; i < 200; ++i) y = std::nextafter(y, 0.0f);
      for (int i = 0; i < 400; ++i, y = std::nextafter(y, HUGE_VALF)) {
        check(y, sf, bounds);
        check(-y, sf, bounds);
      }
    }
    std::uniform_real_distribution<float> uniform(0.0f, 8.0f);
    for (int i = 0; i < 20000; ++i) {
      const float y = uniform(rng) * sf;
      check(y, sf, bounds);
      check(-y, sf, bounds);
    }
    std::uniform_int_distribution<uint32_t> bits;
    for (int i = 0; i < 20000; ++i) check(bits_to_float(bits(rng)), sf, bounds);
    for (float y : {0.0f, -0.0f, HUGE_VALF, -HUGE_VALF, NAN, -NAN, 0x1p-149f, -0x1p-149f, 0x1.fffffep127f})
      check(y, sf, bounds);
  }
  // of_numerator: the bounds on x for y = fl(x / g), against code(fl(x / g)), for global scales g across the range
  // divides_exactly admits (its ends, powers of two, the GPU tests' scales, random ones) and every block scale: the 400
  // floats around each bound, uniform x in [0, 8 sf g), random bit patterns and the special values, both signs.
  auto check_x = [&](float x, float g, float sf, const E2m1Bounds& bounds, const E2m1Bounds& on_x) {
    const uint8_t want = bounds.code(x / g), got = on_x.code(x);
    ++checks;
    if (want != got && mismatches++ < 10)
      printf("mismatch: x = %a, g = %a, sf = %a: division %u, bounds on x %u\n", x, g, sf, want, got);
  };
  std::vector<float> globals = {1.0f, 0.5f, 2.0f, 0.0371f, 3.0e-3f, 7.0f, 0.125f, 448.0f, 1.0f / 3.0f, 0x1p-90f,
                                0x1.000002p-90f, 0x1p100f, 0x1.fffffep99f, 1e-20f, 1e20f};
  std::uniform_real_distribution<float> log2_g(-90.0f, 100.0f);
  for (int i = 0; i < 10; ++i) globals.push_back(std::exp2(log2_g(rng)));
  for (float g : globals) {
    if (!E2m1Bounds::divides_exactly(g)) {
      printf("divides_exactly(%a) is false\n", g);
      return 1;
    }
    for (int code = 1; code < 127; code += (g == 1.0f || g == 0.0371f) ? 1 : 5) {
      const float sf = e4m3_to_float(uint8_t(code));
      const E2m1Bounds bounds(sf), on_x = bounds.of_numerator(g);
      for (float b : on_x.bound) {
        float x = b;
        for (int i = 0; i < 200; ++i) x = std::nextafter(x, 0.0f);
        for (int i = 0; i < 400; ++i, x = std::nextafter(x, HUGE_VALF)) {
          check_x(x, g, sf, bounds, on_x);
          check_x(-x, g, sf, bounds, on_x);
        }
      }
      std::uniform_real_distribution<float> uniform(0.0f, 8.0f);
      for (int i = 0; i < 2000; ++i) {
        const float x = uniform(rng) * sf * g;
        check_x(x, g, sf, bounds, on_x);
        check_x(-x, g, sf, bounds, on_x);
      }
      std::uniform_int_distribution<uint32_t> bits;
      for (int i = 0; i < 2000; ++i) check_x(bits_to_float(bits(rng)), g, sf, bounds, on_x);
      for (float x : {0.0f, -0.0f, HUGE_VALF, -HUGE_VALF, NAN, -NAN, 0x1p-149f, -0x1p-149f, 0x1.fffffep127f,
                      -0x1.fffffep127f})
        check_x(x, g, sf, bounds, on_x);
    }
  }
  for (float g : {0.0f, -1.0f, NAN, HUGE_VALF, 0x1.fffffep-91f, 0x1.000002p100f})
    if (E2m1Bounds::divides_exactly(g)) {
      printf("divides_exactly(%a) is true\n", g);
      return 1;
    }
  printf("%ld checks, %ld mismatches\n", checks, mismatches);
  return mismatches != 0;
}
