// tcgen05 (sm_100a) sparse prefill (KV-block-major over the same jnp plan as cc/sm80/prefill): traits, shared-memory
// and tensor-memory plans, barrier roles. UNVERIFIED: compiled for sm_100a, never run (no Blackwell GPU here); used
// only with JAX_MSA_ENABLE_SM100_KERNELS=1 on compute capability 10.x (cc/cuda/kernel_path.h).
//
// Work unit (one CTA, 4 warps): one plan work item = (KV head g, request b, block blk, <= 128 / G queries that chose
// it), as in the warp-MMA kernel.
//   rows     : tile row R = i * G + h (query i of the tile, head h of the group) = thread R = TMEM lane R; the
//              UMMA M of both products is 128
//   S = Q K^T: tcgen05.mma kind::f16 (bf16 x bf16 -> fp32), M 128 x N 128 keys x K 128 dims, A = query tile and
//              B = the block's K, both K-major 128-byte-swizzled bf16 in shared memory; S in TMEM columns [0, 128)
//   softmax  : each thread reads its row of S from TMEM (tcgen05.ld 32x32b, 32 columns at a time), masks the keys
//              beyond its query's causal position, and writes P (bf16) K-major into shared memory; the block is
//              the whole key range of the item, so the softmax is exact per block (no running rescale)
//   O = P V  : tcgen05.mma M 128 x N 128 dims x K 128 keys, A = P (K-major), B = V (MN-major: the cache's rows are
//              keys with contiguous dims); O in TMEM columns [128, 256)
//   output   : one normalized bf16 partial and its lse per (query, block) at the plan's slot, merged afterwards by
//              the warp-MMA combine kernel (cc/sm80/prefill/combine_partials.cu), exactly as on the other GPUs
//   loads    : the block's K and V (FP8 / NVFP4 dequantized to bf16, exact) and the gathered query rows go through
//              registers into the UMMA layouts (16-byte units)
#pragma once
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm100.hpp>

#include "common/kv_format.h"
#include "sm100/common/kv_unit.cuh"

namespace jax_msa::sm100::prefill {

using sm100::kHeadDim;
constexpr int kBlockKeys = 128;
constexpr int kTileRows = 128;  // UMMA M; = cuda::kMaxTileRows
constexpr int kWarps = 4;       // warp w reads TMEM lanes [32 w, 32 w + 32) (tcgen05.ld lane quarter)
constexpr int kThreads = kWarps * 32;
constexpr int kUnitsPerRow = kHeadDim / 8;  // 16-byte units (8 bf16) of a 128-element row

using Bf16 = cute::bfloat16_t;

// S = Q K^T and O = P V as single-CTA 128 x 128 UMMAs (K = 16 per instruction, 8 instructions per product).
using MmaQK = decltype(cute::make_tiled_mma(
    cute::SM100_MMA_F16BF16_SS<Bf16, Bf16, float, kTileRows, kBlockKeys, cute::UMMA::Major::K,
                               cute::UMMA::Major::K>{}));
using MmaPV = decltype(cute::make_tiled_mma(
    cute::SM100_MMA_F16BF16_SS<Bf16, Bf16, float, kTileRows, kHeadDim, cute::UMMA::Major::K, cute::UMMA::Major::MN>{}));

// Shared-memory layouts of the four operands, in the MMA-partitioned form ((rows, 16), 1, 8): element (r, c) of a
// row-major 128 x 128 operand is at ((r, c % 16), 0, c / 16).
using TileShape = cute::Shape<cute::Int<128>, cute::Int<128>>;
using LayoutQ = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_A(MmaQK{}, TileShape{})));
using LayoutK = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_B(MmaQK{}, TileShape{})));
using LayoutP = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_A(MmaPV{}, TileShape{})));
using LayoutV = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_MN_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_B(MmaPV{}, TileShape{})));

// Shared memory: [Q | K | V | P], 32 KB each, 1024-byte aligned (the 128-byte swizzle repeats every 1024 bytes).
struct SharedPlan {
  static constexpr int kOperandBytes = kTileRows * kHeadDim * 2;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kOperandBytes;
  static constexpr int kVOffset = kKOffset + kOperandBytes;
  static constexpr int kPOffset = kVOffset + kOperandBytes;
  static constexpr int kAlign = 1024;
  static constexpr int kBytes = kPOffset + kOperandBytes + kAlign;  // + slack to align the dynamic base
  static_assert(int(cute::cosize_v<LayoutQ>) * 2 == kOperandBytes && int(cute::cosize_v<LayoutV>) * 2 == kOperandBytes,
                "each operand fills its 32 KB");
};

// Tensor memory: 256 fp32 columns x 128 lanes: S in [0, 128), O in [128, 256).
struct TmemPlan {
  static constexpr int kColumns = 256;  // a power of two >= 32 (tcgen05.alloc)
  static constexpr int kSColumn = 0;
  static constexpr int kOColumn = 128;
};

}  // namespace jax_msa::sm100::prefill
