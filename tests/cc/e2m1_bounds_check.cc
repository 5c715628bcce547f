// E2m1Bounds (cc/common/quantize.h) against the division it replaces: for every E4M3 block scale a group can have
// (codes 1..126, 2^-9 .. 448), code(y) must equal float_to_e2m1_satfinite(y / sf) for the 400 floats around each of
// the seven boundaries y = T * sf (both signs), 20,000 uniform y in [0, 8 sf) (both signs), 20,000 random bit
// patterns (NaN and infinities among them) and the special values. Prints the counts; exits 1 on a mismatch.
// Built and run on the host by tests/test_quantize_bounds.py (the CUDA path differs only in its directed adds,
// __fadd_rd / __fadd_ru, which round the same exact sum).
#include <cmath>
#include <cstdio>
#include <random>

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
  printf("%ld checks, %ld mismatches\n", checks, mismatches);
  return mismatches != 0;
}
