// tcgen05 (sm_100a) kernels, UNVERIFIED: one 16-byte unit of the paged cache as 8 bf16: elements [8 u, 8 u + 8) of
// token `key` of K (kv = 0) or V (kv = 1) of KV head g in `page`. FP8 and NVFP4 codes are decoded exactly to bf16
// (e4m3 and e2m1 x e4m3 fit bf16); the per-layer global scales are folded by the kernels, as everywhere else.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "common/kv_format.h"
#include "common/numeric.h"
#include "sm80/common/register_pack.cuh"
#include "sm80/decode/chunk_io.cuh"

namespace jax_msa::sm100 {

constexpr int kHeadDim = 128;

using sm80::pack_bf16x2;

// Eight e4m3 codes (low byte first) as eight bf16, exact: the warp-MMA kernels' bit placement, two codes at a time.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8(uint2 raw) {
  using Fp8 = sm80::decode::ChunkIO<KvFormat::kFp8>;
  return make_uint4(Fp8::e4m3x2_to_bf16x2(raw.x, false), Fp8::e4m3x2_to_bf16x2(raw.x, true),
                    Fp8::e4m3x2_to_bf16x2(raw.y, false), Fp8::e4m3x2_to_bf16x2(raw.y, true));
}

template <KvFormat F>
__device__ __forceinline__ uint4 load_kv_unit(const void* cache, int num_kv_heads, int64_t page, int g, int key, int kv,
                                              int u);

template <>
__device__ __forceinline__ uint4 load_kv_unit<KvFormat::kBf16>(const void* cache, int num_kv_heads, int64_t page, int g,
                                                               int key, int kv, int u) {
  const int64_t token = (page * num_kv_heads + g) * kPageSize + key;
  const uint16_t* row = static_cast<const uint16_t*>(cache) + token * 256;
  return *reinterpret_cast<const uint4*>(row + kv * kHeadDim + 8 * u);
}

template <>
__device__ __forceinline__ uint4 load_kv_unit<KvFormat::kFp8>(const void* cache, int num_kv_heads, int64_t page, int g,
                                                              int key, int kv, int u) {
  const int64_t token = (page * num_kv_heads + g) * kPageSize + key;
  const uint8_t* row = static_cast<const uint8_t*>(cache) + token * 256;
  return e4m3x8_to_bf16x8(*reinterpret_cast<const uint2*>(row + kv * kHeadDim + 8 * u));
}

template <>
__device__ __forceinline__ uint4 load_kv_unit<KvFormat::kNvfp4>(const void* cache, int num_kv_heads, int64_t page, int g,
                                                                int key, int kv, int u) {
  const Nvfp4Slot slot{kHeadDim};
  const uint8_t* base = static_cast<const uint8_t*>(cache) + slot.slot_offset(page, num_kv_heads, g, kv);
  const uint32_t data = *reinterpret_cast<const uint32_t*>(base + int64_t(key) * slot.data_bytes_per_token() + 4 * u);
  const int group = u >> 1;  // 16-value scale group of elements 8u..8u+7
  const float sf = e4m3_to_float(base[kv == 0 ? slot.k_scale_offset(key, group) : slot.v_scale_offset(key, group)]);
  uint32_t o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // byte j: elements 2j (low nibble), 2j + 1 (high nibble); e2m1 x e4m3 is exact
    const uint8_t b = uint8_t(data >> (8 * j));
    o[j] = pack_bf16x2(e2m1_to_float(uint8_t(b & 15u)) * sf, e2m1_to_float(uint8_t(b >> 4)) * sf);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace jax_msa::sm100
