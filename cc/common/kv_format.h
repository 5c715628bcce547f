// The three KV-cache formats of ../shared/spec/MSA.md sections 3-4 and their byte layouts.
// One page = one block = kPageSize tokens. Shared by the CPU handlers and the CUDA kernels.
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "common/numeric.h"

namespace jax_msa {

constexpr int kPageSize = 128;  // tokens per page == tokens per sparse block

// Matches jax_msa/kv_cache.py KVFormat (the integer is the FFI attribute `kv_format`).
enum class KvFormat : int32_t {
  kBf16 = 0,   // bf16  [pages, Hkv, 128, 2*D]: token row = K[0:D] | V[D:2D]
  kFp8 = 1,    // e4m3  [pages, Hkv, 128, 2*D]: same layout, value = e4m3 * k_scale / v_scale
  kNvfp4 = 2,  // uint8 [pages, 2*Hkv, 128, D/2 + D/16]: slot 2g = K of head g, 2g+1 = V
};

// NVFP4 slot geometry for head_dim D (D % 16 == 0).
//   data   bytes [0, 128*D/2): token t at t*D/2, low nibble = even dim, high nibble = odd dim
//   scales bytes [128*D/2, 128*(D/2 + D/16)): one E4M3 per 16 dims
//     K: linear            t*(D/16) + c
//     V: 4x4 token quads   (t/4)*(4*D/16) + 4*c + t%4
struct Nvfp4Slot {
  int head_dim;
  MSA_HD constexpr int groups() const { return head_dim / 16; }
  MSA_HD constexpr int data_bytes_per_token() const { return head_dim / 2; }
  MSA_HD constexpr int64_t data_bytes() const { return int64_t(kPageSize) * (head_dim / 2); }
  MSA_HD constexpr int64_t slot_bytes() const { return int64_t(kPageSize) * (head_dim / 2 + head_dim / 16); }
  // Byte offset in the cache of the slot of K (kv = 0) or V (kv = 1) of KV head g in page `page`: slot 2g + kv.
  MSA_HD constexpr int64_t slot_offset(int64_t page, int num_kv_heads, int g, int kv) const {
    return (page * 2 * num_kv_heads + 2 * g + kv) * slot_bytes();
  }
  MSA_HD constexpr int64_t k_scale_offset(int t, int c) const { return data_bytes() + int64_t(t) * groups() + c; }
  MSA_HD constexpr int64_t v_scale_offset(int t, int c) const {
    return data_bytes() + int64_t(t / 4) * (4 * groups()) + 4 * c + (t % 4);
  }
};

// Dequantized element d of token t (0..127) of K (is_v=false) or V (is_v=true) for KV head g in page p,
// in fp32. `scale` is the per-layer global (fp32) k_scale or v_scale; unused for bf16.
// Scalar reference path: the CPU handlers use it; GPU kernels read vectors but must agree bit for bit.
struct KvPageReader {
  const void* cache;
  KvFormat format;
  int num_kv_heads;
  int head_dim;

  MSA_HD void load_token(int64_t page, int g, int t, bool is_v, float scale, float* out) const {
    const int D = head_dim;
    if (format == KvFormat::kNvfp4) {
      const Nvfp4Slot slot{D};
      const uint8_t* base = static_cast<const uint8_t*>(cache) + slot.slot_offset(page, num_kv_heads, g, is_v ? 1 : 0);
      const uint8_t* data = base + int64_t(t) * slot.data_bytes_per_token();
      for (int c = 0; c < slot.groups(); ++c) {
        const float sf = e4m3_to_float(base[is_v ? slot.v_scale_offset(t, c) : slot.k_scale_offset(t, c)]);
        for (int j = 0; j < 8; ++j) {
          const uint8_t byte = data[c * 8 + j];
          out[c * 16 + 2 * j] = e2m1_to_float(byte & 0xfu) * sf * scale;
          out[c * 16 + 2 * j + 1] = e2m1_to_float(byte >> 4) * sf * scale;
        }
      }
      return;
    }
    const int64_t row = ((page * num_kv_heads + g) * kPageSize + t) * (2 * int64_t(D)) + (is_v ? D : 0);
    if (format == KvFormat::kBf16) {
      const uint16_t* p = static_cast<const uint16_t*>(cache) + row;
      for (int d = 0; d < D; ++d) out[d] = bf16_bits_to_float(p[d]);
    } else {
      const uint8_t* p = static_cast<const uint8_t*>(cache) + row;
      for (int d = 0; d < D; ++d) out[d] = e4m3_to_float(p[d]) * scale;
    }
  }
};

}  // namespace jax_msa
