// Quantize-on-write for the FP8 and NVFP4 caches (MSA.md section 4); shared by the CPU write_kv handler
// and the CUDA write_kv kernel so both produce the same bytes as jax_msa/kv_cache.py.
// Divisions are IEEE (correctly rounded): never build this with fast-math.
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "common/numeric.h"

namespace jax_msa {

// One E4M3 byte of a bf16-rounded value divided by the tensor scale (a NaN, of either sign, gives 0x7F).
MSA_HD uint8_t fp8_quantize(float x_bf16, float scale) { return float_to_e4m3_satfinite(x_bf16 / scale); }

// One 16-value NVFP4 group: x holds bf16-rounded values. Writes 8 data bytes (low nibble = even index)
// and returns the E4M3 scale byte.
//   sf   = e4m3_satfinite(max((max(amax, 1e-12) / 6) / global, 2^-9))
//   code = e2m1_satfinite_rne((x / global) / sf)
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
  float s = (amax > 1e-12f ? amax : 1e-12f) / 6.0f;
  s = s / global_scale;
  s = s > 0.001953125f ? s : 0.001953125f;
  const uint8_t sf_code = float_to_e4m3_satfinite(s);
  const float sf = e4m3_to_float(sf_code);
  for (int j = 0; j < 8; ++j) {
    const uint8_t lo = float_to_e2m1_satfinite((x[2 * j] / global_scale) / sf);
    const uint8_t hi = float_to_e2m1_satfinite((x[2 * j + 1] / global_scale) / sf);
    data[j] = uint8_t(lo | (hi << 4));
  }
  return sf_code;
}

}  // namespace jax_msa
