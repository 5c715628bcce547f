// CPU write_kv: new K/V tokens into a bf16, FP8 or NVFP4 cache, in place (the output aliases the input).
#include <cstring>

#include "common/kv_format.h"
#include "common/quantize.h"
#include "cpu/handlers.h"
#include "cpu/parallel.h"

namespace jax_msa::cpu {

void write_kv(const WriteKvParams& p) {
  const int D = p.head_dim, Hkv = p.num_kv_heads;
  const int64_t capacity = p.num_pages * kPageSize;
  parallel_for(int64_t(p.num_tokens) * Hkv, 64, [&](int64_t ng) {
    const int64_t n = ng / Hkv;
    const int g = int(ng % Hkv);
    const int64_t slot = p.slot_mapping[n];
    if (slot < 0 || slot >= capacity) return;  // padding or beyond the cache: skipped
    const int64_t page = slot / kPageSize;
    const int t = int(slot % kPageSize);
    const uint16_t* src[2] = {p.k + (n * Hkv + g) * D, p.v + (n * Hkv + g) * D};
    const float k_scale = p.k_scale[n / p.tokens_per_scale], v_scale = p.v_scale[n / p.tokens_per_scale];
    if (p.kv_format == KvFormat::kNvfp4) {
      const Nvfp4Slot geo{D};
      for (int kv = 0; kv < 2; ++kv) {
        uint8_t* base = static_cast<uint8_t*>(p.kv_cache) + geo.slot_offset(page, Hkv, g, kv);
        const float global = kv == 0 ? k_scale : v_scale;
        for (int c = 0; c < geo.groups(); ++c) {
          float x[16];
          for (int i = 0; i < 16; ++i) x[i] = bf16_bits_to_float(src[kv][c * 16 + i]);
          const uint8_t sf = nvfp4_quantize_group(x, global, base + int64_t(t) * geo.data_bytes_per_token() + c * 8);
          base[kv == 0 ? geo.k_scale_offset(t, c) : geo.v_scale_offset(t, c)] = sf;
        }
      }
      return;
    }
    const int64_t row = ((page * Hkv + g) * kPageSize + t) * (2 * int64_t(D));
    if (p.kv_format == KvFormat::kBf16) {
      uint16_t* dst = static_cast<uint16_t*>(p.kv_cache) + row;
      std::memcpy(dst, src[0], sizeof(uint16_t) * D);
      std::memcpy(dst + D, src[1], sizeof(uint16_t) * D);
    } else {
      uint8_t* dst = static_cast<uint8_t*>(p.kv_cache) + row;
      for (int d = 0; d < D; ++d) {
        dst[d] = fp8_quantize(bf16_bits_to_float(src[0][d]), k_scale);
        dst[D + d] = fp8_quantize(bf16_bits_to_float(src[1][d]), v_scale);
      }
    }
  });
}

}  // namespace jax_msa::cpu
