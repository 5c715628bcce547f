// Warp-MMA (sm_80+) decode: moving one 64-key chunk of K and V from the paged cache into shared memory (cp.async,
// zero-filled past the visible keys) and, for FP8 / NVFP4, converting it: into the MMA registers as f16 (row_f16, the
// decode kernel's register path) or into the swizzled bf16 tile that the prefill kernel reads with ldmatrix
// (dequant). Scales: FP8 values are the raw e4m3 numbers (the per-layer k_scale / v_scale are folded into the
// softmax scale and the output); NVFP4 values are e2m1 x e4m3 block scale, exact in bf16 (the global scales are
// folded likewise; the register path delivers them times kRegisterValueFactor = 2^-7 in f16, folded likewise).
// The loaders take key0, the warp's first key of the chunk, as a multiple of 16 (every caller: 16 x a warp index;
// the swizzle terms need a multiple of 8, NVFP4's scale window of 4).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/kv_format.h"
#include "common/numeric.h"
#include "sm80/common/kept_in_register.cuh"
#include "sm80/common/register_pack.cuh"
#include "sm80/decode/config.h"

namespace jax_msa::sm80::decode {

// Byte offset of 16-byte unit `unit` (0..15) of row `key` in a swizzled [64][128] bf16 tile: the unit
// index is XORed with key % 8 so that ldmatrix's 8 row addresses hit 8 different bank groups.
__device__ __forceinline__ int swizzled_offset(int key, int unit) { return key * kBf16RowBytes + ((unit ^ (key & 7)) << 4); }

// 16 bytes global -> shared (cp.async.cg: through L2 only), zero-filled without reading when !pred; the shared
// destination as its 32-bit address in the shared window (__cvta_generic_to_shared)
__device__ __forceinline__ void cp_async_16_shared(uint32_t smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(pred ? 16 : 0));
#endif
}

// The same through a generic pointer into shared memory
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  cp_async_16_shared(uint32_t(__cvta_generic_to_shared(smem)), gmem, pred);
}

// One chunk to load: keys [64 * half, 64 * half + 64) of page `page`; keys >= visible are zero-filled. The loaders take
// it by value: read once into registers (the copies' asm would otherwise have it reloaded from shared memory).
struct ChunkRef {
  int64_t page;
  int half;
  int visible;  // 1..64 keys of this chunk are attended
};

// Bytes 0, 1 of `pair` (e4m3) -> f16x2, low byte first: one cvt.rn.f16x2.e4m3x2 on sm_89+ (CUDA's exact emulation
// before); every e4m3 value, NaN included, is exact in f16.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair & 0xffffu), __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// Bytes 2, 3 of `word` (e4m3) -> f16x2, byte 2 first: e4m3x2_to_f16x2(word >> 16), but the sm_89+ conversion reads
// the register's upper half itself (F2FP ... .H1) instead of after a shift.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t word) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;\n\t}" : "=r"(h) : "r"(word));
  return h;
#else
  return e4m3x2_to_f16x2(word >> 16);
#endif
}

// Eight e2m1 values (4 bytes, low nibble first) -> four f16x2 in order, each value times 2^-6 (the sm90 prefill's
// NVFP4 converter, convert_tiles.cuh; the decode takes e2m1x8_to_f16x8_split_pairs below). The e2m1 code s.ee.m
// placed as the e4m3 code s.0ee.m00 (exponent bias 7 instead of 1) is the value times 2^-6, normal and subnormal
// codes alike; four byte-wise bit operations place all eight, two byte permutes interleave them, the hardware
// converts the e4m3 pairs.
__device__ __forceinline__ void e2m1x8_to_f16x8(uint32_t w, uint32_t (&o)[4]) {
  const uint32_t lo = ((w << 2) & 0x1c1c1c1cu) | ((w << 4) & 0x80808080u);  // low nibbles: dims 0, 2, 4, 6
  const uint32_t hi = ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u);         // high nibbles: dims 1, 3, 5, 7
  const uint32_t d0123 = __byte_perm(lo, hi, 0x5140u), d4567 = __byte_perm(lo, hi, 0x7362u);
  o[0] = e4m3x2_to_f16x2(d0123);
  o[1] = e4m3x2_hi_to_f16x2(d0123);
  o[2] = e4m3x2_to_f16x2(d4567);
  o[3] = e4m3x2_hi_to_f16x2(d4567);
}

// Eight e2m1 values (4 bytes, low nibble first) -> four f16x2, each value times 2^-14, in split-pair order: register r
// holds values r and r + 4 (RegisterDims::kLaneSplitPairs, config.h). The e2m1 code s.ee.m placed as the f16 code
// s.000ee.m000000000 is the value times 2^-14, the subnormal 0.5 included. Two words hold the codes' high bytes (of
// the even and of the odd nibbles), one byte permute with zero places two of them a register: no conversion
// instruction (they run at a quarter of the integer pipe's rate on sm_90).
__device__ __forceinline__ void e2m1x8_to_f16x8_split_pairs(uint32_t w, uint32_t (&o)[4]) {
  const uint32_t even = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0e0e0e0eu);  // byte b: the code of value 2 b
  const uint32_t odd = (w & 0x80808080u) | ((w >> 3) & 0x0e0e0e0eu);          // byte b: the code of value 2 b + 1
  o[0] = __byte_perm(even, 0u, 0x2404u);  // values 0, 4
  o[1] = __byte_perm(odd, 0u, 0x2404u);   // values 1, 5
  o[2] = __byte_perm(even, 0u, 0x3414u);  // values 2, 6
  o[3] = __byte_perm(odd, 0u, 0x3414u);   // values 3, 7
}

template <KvFormat F>
struct ChunkIO;

// ---- bf16: K and V rows of 256 B straight into the swizzled tiles ------------------------------------------
// Every loader and dequantizer works on one warp's 16 keys [key0, key0 + 16) of the chunk: a warp reads
// only its own rows, so the main loop needs no CTA-wide barrier (cp.async.wait_group + __syncwarp).

template <>
struct ChunkIO<KvFormat::kBf16> {
  static constexpr float kRegisterValueFactor = 1.0f;  // the values are the cache's (read by ldmatrix)
  static constexpr bool kLaneLoads = false;  // the decode loop calls load() at every chunk

  // Copy i (0..15) of lane l: K (i < 8) or V, key key0 + 2 (i % 8) + l / 16, unit l % 16, so one source address a
  // chunk plus immediates. key0 is a multiple of 16, so the swizzle term key % 8 = (2 i + l / 16) % 8 repeats every 4
  // copies: 4 lane offsets, the same every chunk. (The destinations equal swizzled_offset(key, unit), spelled out
  // with the lane's key % 8: through swizzled_offset, and raw_offset for FP8, the decode loop takes 7 (FP8: 3) more
  // instructions a chunk.)
  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              ChunkRef c, int key0, int lane) {
    const int unit = lane & 15, key_lane = key0 + (lane >> 4);
    const uint8_t* src = static_cast<const uint8_t*>(cache) +
                         ((c.page * num_kv_heads + g) * kPageSize + c.half * kChunkKeys + key_lane) *
                             int64_t(2 * kBf16RowBytes) +
                         unit * 16;
    uint8_t* dst = stage + key_lane * kBf16RowBytes;
    int swizzle[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) swizzle[m] = (unit ^ ((2 * m + (lane >> 4)) & 7)) << 4;
#pragma unroll
    for (int i = 0; i < 2 * kKeysPerWarp * 16 / 32; ++i) {  // 512 units of 16 B per warp
      const int kv = i >> 3, j = i & 7;
      // a key past the visible ones is zero-filled: no byte is read, and its address stays inside the page anyway
      cp_async_16(dst + kv * kBf16TileBytes + 2 * j * kBf16RowBytes + swizzle[j & 3],
                  src + 2 * j * (2 * kBf16RowBytes) + kv * kBf16RowBytes, key_lane + 2 * j < c.visible);
    }
  }
};

// ---- FP8 E4M3: raw rows of 128 B, then e4m3 -> bf16 by bit placement and one exact multiply ------------
template <>
struct ChunkIO<KvFormat::kFp8> {
  static constexpr bool kLaneLoads = false;  // the decode loop calls load() at every chunk (memory-bound there)
  // Copy i (0..7) of lane l: K (i < 4) or V, key key0 + 4 (i % 4) + l / 8, unit l % 8: one source address a chunk plus
  // immediates; the swizzle term key % 8 = (4 i + l / 8) % 8 repeats every 2 copies (key0 is a multiple of 16).
  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              ChunkRef c, int key0, int lane) {
    const int unit = lane & 7, key_lane = key0 + (lane >> 3);
    const uint8_t* src = static_cast<const uint8_t*>(cache) +
                         ((c.page * num_kv_heads + g) * kPageSize + c.half * kChunkKeys + key_lane) *
                             int64_t(2 * kHeadDim) +
                         unit * 16;
    uint8_t* dst = stage + key_lane * kHeadDim;
    const int swizzle[2] = {(unit ^ ((lane >> 3) & 7)) << 4, (unit ^ ((4 + (lane >> 3)) & 7)) << 4};
#pragma unroll
    for (int i = 0; i < 2 * kKeysPerWarp * 8 / 32; ++i) {  // 256 units of 16 B per warp
      const int kv = i >> 2, j = i & 3;
      // a key past the visible ones is zero-filled: no byte is read, and its address stays inside the page anyway
      cp_async_16(dst + kv * (kChunkKeys * kHeadDim) + 4 * j * kHeadDim + swizzle[j & 1],
                  src + 4 * j * (2 * kHeadDim) + kv * kHeadDim, key_lane + 4 * j < c.visible);
    }
  }

  // Byte offset of 16-byte unit `unit` (0..7) of row `key` of K (kv = 0) or V in a stage: rows of 128 B, the unit
  // index XORed with key % 8, so that the lanes of a quarter warp reading units 2c + h of two rows (row_f16) and
  // those reading 8 units of one row (dequant) hit distinct banks.
  static __device__ __forceinline__ int raw_offset(int kv, int key, int unit) {
    return kv * (kChunkKeys * kHeadDim) + key * kHeadDim + ((unit ^ (key & 7)) << 4);
  }

  static constexpr float kRegisterValueFactor = 1.0f;  // the register path's values are the cache's

  // The decode kernel's register path: dims [32 c, 32 c + 32) of row `key` of K (kv = 0) or V as 16 f16x2 registers,
  // register i = dims (32 c + 2 i, 32 c + 2 i + 1) (RegisterDims::kLanePairs); one hardware conversion per register,
  // exact.
  static __device__ __forceinline__ void row_f16(const uint8_t* stage, const ChunkRef&, int kv, int key, int c,
                                                 uint32_t (&out)[16]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + raw_offset(kv, key, 2 * c + h));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        out[8 * h + 2 * j] = e4m3x2_to_f16x2(w[j]);
        out[8 * h + 2 * j + 1] = e4m3x2_hi_to_f16x2(w[j]);
      }
    }
  }

  // Bytes b0..b3 of w -> bf16x2 (b0, b1) for hi=false, (b2, b3) for hi=true. An e4m3 byte s.eeee.mmm placed
  // as bf16 bits s.0000eeee.mmm0000 is the value times 2^-120 (normal and subnormal codes alike); one
  // bf16x2 multiply by 2^120 (exact, subnormals supported) restores it. NaN codes are not preserved.
  static __device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t w, bool hi) {
    const uint32_t x = __byte_perm(w, 0u, hi ? 0x3424u : 0x1404u);  // b_odd << 24 | b_even << 8
    const uint32_t bits = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                     __nv_bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80)));
    return *reinterpret_cast<const uint32_t*>(&v);
  }

  // The prefill kernel's path (its query tile is bf16): the warp's raw rows -> its rows of the swizzled bf16 tile.
  static __device__ __forceinline__ void dequant(const uint8_t* stage, uint8_t* tile, const ChunkRef&, int key0,
                                                 int lane) {
#pragma unroll
    for (int i = 0; i < 2 * kKeysPerWarp * 8 / 32; ++i) {
      const int idx = i * 32 + lane;
      const int kv = idx >> 7, key = key0 + ((idx >> 3) & 15), unit = idx & 7;
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + raw_offset(kv, key, unit));
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t o[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o[2 * j] = e4m3x2_to_bf16x2(w[j], false);
        o[2 * j + 1] = e4m3x2_to_bf16x2(w[j], true);
      }
      uint8_t* dst = tile + kv * kBf16TileBytes;
      *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 2 * unit)) = make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 2 * unit + 1)) = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
};

// ---- NVFP4: data and scale bytes of the warp's 16 tokens (both contiguous in the slot), then each data
//      byte -> bf16x2 through a 256-entry table (two e2m1 values) and one exact bf16x2 multiply by the
//      block scale (e2m1 x e4m3 is exact in bf16) ---------------------------------------------------------
template <>
struct ChunkIO<KvFormat::kNvfp4> {
  using T = FormatTraits<KvFormat::kNvfp4>;
  static constexpr int kHalfBytes = T::kDataBytes + T::kScaleBytes;  // K (or V) part of a stage
  static constexpr int kWarpScaleBytes = kKeysPerWarp * kHeadDim / 16;  // 128: contiguous for K and for V

  // Data copy i (0..3) of lane l: K (i < 2) or V, key key0 + 8 (i % 2) + l / 4, unit l % 4 of the key's 64 bytes: one
  // source address a chunk plus immediates (the V slot follows the K slot at slot_bytes()).
  static __device__ __forceinline__ void load(uint8_t* stage, const void* cache, int num_kv_heads, int g,
                                              ChunkRef c, int key0, int lane) {
    constexpr Nvfp4Slot kSlot{kHeadDim};
    constexpr int kDataUnits = kKeysPerWarp * kHeadDim / 2 / 16;  // 64 per K or V: 4 per token
    constexpr int kScaleUnits = kWarpScaleBytes / 16;              // 8 per K or V
    static_assert(kDataUnits == 2 * 32 && 2 * kScaleUnits <= 32, "4 data units a lane, one scale unit on 16 lanes");
    const uint8_t* k_slot = static_cast<const uint8_t*>(cache) + kSlot.slot_offset(c.page, num_kv_heads, g, 0);
    const int key_lane = key0 + (lane >> 2), unit = lane & 3;
    const uint8_t* src = k_slot + (c.half * kChunkKeys + key_lane) * (kHeadDim / 2) + unit * 16;
    uint8_t* dst = stage + key_lane * (kHeadDim / 2) + unit * 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // data: K units 0-63, then V's
      const int kv = i >> 1, j = i & 1;
      // a key past the visible ones is zero-filled: no byte is read, and its address stays inside the slot anyway
      cp_async_16(dst + kv * kHalfBytes + 8 * j * (kHeadDim / 2),
                  src + kv * kSlot.slot_bytes() + 8 * j * (kHeadDim / 2), key_lane + 8 * j < c.visible);
    }
    // scales: K linear (t*8 + c) and V quads ((t/4)*32 + 4c + t%4) both cover [8*key0, +128)
    if (lane < 2 * kScaleUnits) {
      const int kv = lane / kScaleUnits;
      const int off = key0 * (kHeadDim / 16) + (lane % kScaleUnits) * 16;
      const uint8_t* scale_src = k_slot + kv * kSlot.slot_bytes() + kSlot.data_bytes() + c.half * T::kScaleBytes + off;
      cp_async_16(stage + kv * kHalfBytes + T::kDataBytes + off, scale_src, true);
    }
  }

  // The decode loop's loads (load() above, split): what depends only on the lane and the KV head, computed once
  // before the loop (lane_loads) and kept in registers, and per chunk the page, the half and the stage
  // (load_chunk). Rebuilt from the thread and block indices at every chunk, as the compiler would otherwise do, the
  // addresses cost the issue-bound NVFP4 loop about 40 instructions a chunk.
  static constexpr bool kLaneLoads = true;
  struct LaneLoads {
    const uint8_t* data;    // K data unit (lane % 4) of key key0 + lane / 4, KV head g, page 0, half 0 (V: + slot)
    const uint8_t* scales;  // lanes < 16: their 16 scale bytes of K (lanes 0-7) or V, page 0, half 0
    uint32_t data_dst;      // shared-window address of the data unit in stage 0
    uint32_t scale_dst;     // ... and of the scale unit
    uint32_t page_bytes;    // a page: 2 x num_kv_heads slots of 9 KB (< 2^32)
    int key_lane;           // the chunk key of the lane's first data copy (the second: + 8)
  };

  static __device__ __forceinline__ LaneLoads lane_loads(const uint8_t* stage0, const void* cache, int num_kv_heads,
                                                         int g, int key0, int lane) {
    constexpr Nvfp4Slot kSlot{kHeadDim};
    constexpr int kScaleUnits = kWarpScaleBytes / 16;
    const uint8_t* slot = static_cast<const uint8_t*>(cache) + kSlot.slot_offset(0, num_kv_heads, g, 0);
    const int key_lane = key0 + (lane >> 2), unit = lane & 3;
    const int kv = (lane / kScaleUnits) & 1, off = key0 * (kHeadDim / 16) + (lane % kScaleUnits) * 16;
    const uint32_t stage = uint32_t(__cvta_generic_to_shared(stage0));
    return LaneLoads{kept(slot + key_lane * (kHeadDim / 2) + unit * 16),
                     kept(slot + kv * kSlot.slot_bytes() + kSlot.data_bytes() + off),
                     kept(stage + uint32_t(key_lane * (kHeadDim / 2) + unit * 16)),
                     kept(stage + uint32_t(kv * kHalfBytes + T::kDataBytes + off)),
                     kept(uint32_t(2 * num_kv_heads * kSlot.slot_bytes())), kept(key_lane)};
  }

  // load() of chunk c into the stage at `stage_offset` bytes from stage 0, through the lane's precomputed addresses;
  // c.page (a block-table entry, int32) and page_bytes as 32-bit factors of one wide multiply
  static __device__ __forceinline__ void load_chunk(const LaneLoads& l, uint32_t stage_offset, ChunkRef c, int lane) {
    constexpr Nvfp4Slot kSlot{kHeadDim};
    const uint64_t page = uint64_t(uint32_t(c.page)) * l.page_bytes;
    const uint8_t* src = l.data + page + uint32_t(c.half * T::kDataBytes);
    const uint32_t dst = l.data_dst + stage_offset;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // data: K units 0-63, then V's
      const int kv = i >> 1, j = i & 1;
      cp_async_16_shared(dst + kv * kHalfBytes + 8 * j * (kHeadDim / 2),
                         src + kv * kSlot.slot_bytes() + 8 * j * (kHeadDim / 2), l.key_lane + 8 * j < c.visible);
    }
    if (lane < 2 * (kWarpScaleBytes / 16))
      cp_async_16_shared(l.scale_dst + stage_offset, l.scales + page + uint32_t(c.half * T::kScaleBytes), true);
  }

  // table[byte] = bf16x2(e2m1(byte & 15), e2m1(byte >> 4)); built once per CTA
  static __device__ __forceinline__ void build_table(uint32_t* table) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x)
      table[i] = pack_bf16x2(e2m1_to_float(uint8_t(i & 15)), e2m1_to_float(uint8_t(i >> 4)));
  }

  // The prefill kernel's bf16 path: each data byte -> bf16x2 through the table, times the block scale (exact).
  static __device__ __forceinline__ void dequant(const uint8_t* stage, uint8_t* tile, const ChunkRef& c, int key0,
                                                 int lane, const uint32_t* table) {
    dequant_units(stage, tile, c, key0, lane,
                  [&](uint32_t w0, uint32_t w1, const uint8_t* sf_ptr, bool live, uint32_t* out) {
                    const float sf = live ? e4m3_to_float(*sf_ptr) : 0.0f;
                    const __nv_bfloat162 sf2 = __floats2bfloat162_rn(sf, sf);  // exact: e4m3 fits bf16
                    const uint32_t words[2] = {w0, w1};
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
#pragma unroll
                      for (int b = 0; b < 4; ++b) {
                        const uint32_t pair = table[(words[j] >> (8 * b)) & 0xffu];
                        const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair), sf2);
                        out[j * 4 + b] = *reinterpret_cast<const uint32_t*>(&v);
                      }
                    }
                  });
  }

  // The register path's values are the cache's times kRegisterValueFactor (the kernel folds its inverse into k_scale
  // and v_scale).
  static constexpr float kRegisterValueFactor = 1.0f / 128.0f;

  // The decode kernel's register path, without a table: dims [32 c, 32 c + 32) of row `key` of K (kv = 0) or V as
  // 16 f16x2 registers in split-pair order (register 4 j + r = dims 32 c + 8 j + r and + 4). e2m1 placed as f16
  // (value x 2^-14) times the block scale x 2^7 in f16 (448 x 2^7 < 65504): e2m1 x scale x 2^-7, a multiple of
  // 2^-17 (0.5 x 2^-9 x 2^-7) with at most 6 significant bits, exact in f16 (whose subnormals are the multiples of
  // 2^-24), normal or not. The scale bytes of invisible keys may hold anything (even NaN): their scale is taken as 0.
  static __device__ __forceinline__ void row_f16(const uint8_t* stage, const ChunkRef& c, int kv, int key, int quad,
                                                 uint32_t (&out)[16]) {
    const uint8_t* half = stage + kv * kHalfBytes;
    const uint4 raw = *reinterpret_cast<const uint4*>(half + key * (kHeadDim / 2) + quad * 16);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    const bool live = key < c.visible;
    // the scale bytes of groups 2 quad and 2 quad + 1, low byte first: adjacent for K; for V, bytes key % 4 and
    // 4 + key % 4 of the 8-byte unit at (key / 4) * 32 + 8 quad
    const uint8_t* scales = half + T::kDataBytes;
    uint32_t sf_pair;
    if (kv == 0) {
      sf_pair = *reinterpret_cast<const uint16_t*>(scales + scale_offset(0, key, 2 * quad));
    } else {
      const uint2 unit = *reinterpret_cast<const uint2*>(scales + scale_offset(1, key & ~3, 2 * quad));
      sf_pair = __byte_perm(unit.x, unit.y, (key & 3) | ((4 + (key & 3)) << 4));
    }
    const uint32_t sf_bits = e4m3x2_to_f16x2(sf_pair);
    const __half2 sf01 = live ? __hmul2(*reinterpret_cast<const __half2*>(&sf_bits), __floats2half2_rn(128.0f, 128.0f))
                              : __half2{};
#pragma unroll
    for (int grp = 0; grp < 2; ++grp) {  // 16-value scale group 2 quad + grp: words 2 grp, 2 grp + 1
      const __half2 sf2 = grp == 0 ? __low2half2(sf01) : __high2half2(sf01);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t v[4];
        e2m1x8_to_f16x8_split_pairs(w[2 * grp + j], v);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&v[b]), sf2);
          out[8 * grp + 4 * j + b] = *reinterpret_cast<const uint32_t*>(&x);
        }
      }
    }
  }

 private:
  // Offset of the scale byte of 16-value group `group` (0..7) of chunk key `key` in a stage's scale area: K linear
  // (key * 8 + group), V in quads ((key / 4) * 32 + 4 group + key % 4), the slot's byte order.
  static __device__ __forceinline__ int scale_offset(int kv, int key, int group) {
    return kv == 0 ? key * 8 + group : (key >> 2) * 32 + 4 * group + (key & 3);
  }

  // The tile dequantizer's loop (dequant): each of the warp's units of 16 data bytes (32 values: two 16-value scale
  // groups) -> 4 swizzled 16-byte units of the tile. convert(word0, word1, scale byte, live, out) turns one group into
  // 8 x2 registers; the scale bytes of invisible keys may hold anything (even NaN), hence `live`.
  template <class ConvertGroup>
  static __device__ __forceinline__ void dequant_units(const uint8_t* stage, uint8_t* tile, const ChunkRef& c, int key0,
                                                       int lane, ConvertGroup convert) {
#pragma unroll
    for (int i = 0; i < 2 * kKeysPerWarp * 4 / 32; ++i) {  // 128 units of 16 data bytes = 32 values
      const int idx = i * 32 + lane;
      const int kv = idx >> 6, key = key0 + ((idx >> 2) & 15), unit = idx & 3;
      const uint8_t* half = stage + kv * kHalfBytes;
      const uint4 raw = *reinterpret_cast<const uint4*>(half + key * (kHeadDim / 2) + unit * 16);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      const bool live = key < c.visible;
      uint32_t o[16];
#pragma unroll
      for (int grp = 0; grp < 2; ++grp) {
        const int group = 2 * unit + grp;  // 16-value group 0..7
        convert(w[2 * grp], w[2 * grp + 1], half + T::kDataBytes + scale_offset(kv, key, group), live, o + grp * 8);
      }
      uint8_t* dst = tile + kv * kBf16TileBytes;
#pragma unroll
      for (int q = 0; q < 4; ++q)
        *reinterpret_cast<uint4*>(dst + swizzled_offset(key, 4 * unit + q)) =
            make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
    }
  }
};

}  // namespace jax_msa::sm80::decode
