// tcgen05 (sm_100a) sparse decode: traits, shared-memory and tensor-memory plans. UNVERIFIED: compiled for sm_100a,
// never run (no Blackwell GPU here); used only with JAX_MSA_ENABLE_SM100_KERNELS=1 on compute capability 10.x
// (cc/cuda/kernel_path.h), and only for calls it serves (decode_supports; the others take the warp-MMA decode).
//
// Work unit (one CTA, 4 warps): query token t, KV head g, split s of t's valid selected blocks (<= 16 a CTA), as
// in the warp-MMA decode. The products are transposed so that a block's 128 keys are the UMMA M and the G <= 16
// query heads (zero padded to 16) the N:
//   S^T = K Q^T  : M 128 keys x N 16 heads x K 128 dims per block, A = the block's K (K-major, 128-byte swizzle),
//                  B = Q (K-major); block i's scores land in TMEM columns [16 i, 16 i + 16), lane = key
//   softmax      : exact over every key of the split (two passes over TMEM, no running rescale): thread = key lane
//                  takes its 16 head scores a block, the per-head max and sum are reduced across the 128 threads;
//                  P^T of every block goes to shared memory (K-major: keys contiguous a head)
//   O^T = V^T P^T: M 128 dims x N 16 heads x K 128 keys, accumulated over the blocks into TMEM columns [0, 16)
//                  (free again once the scores are read), A = V (MN-major: a key's dims contiguous), B = P^T
//   output       : thread = dim lane; one split -> bf16 out and lse, several -> fp32 partials for the shared
//                  split combine (cc/sm80/decode/combine_splits.cu)
// K and V of a block are loaded (and FP8 / NVFP4 dequantized to bf16, exact) through registers into one 32 KB
// buffer, one block at a time: simple and serial; a pipelined version is the obvious next step once it has run.
#pragma once
#include <cute/atom/mma_traits_sm100.hpp>
#include <cute/tensor.hpp>

#include "common/kv_format.h"
#include "sm100/common/kv_unit.cuh"

namespace jax_msa::sm100::decode {

using sm100::kHeadDim;
constexpr int kBlockKeys = 128;  // UMMA M of S^T
constexpr int kHeads = 16;       // UMMA N: the query heads of (t, g), zero padded
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;  // thread = TMEM lane = key (S^T) or dim (O^T)
constexpr int kMaxBlocks = 16;         // selected blocks a CTA: 16 score tiles of 16 columns fill 256 columns
constexpr int kMaxTopk = 32;           // a top-k row is compacted by one warp ballot
constexpr int kUnitsPerRow = kHeadDim / 8;

using Bf16 = cute::bfloat16_t;

using MmaS = decltype(cute::make_tiled_mma(cute::SM100_MMA_F16BF16_SS<Bf16, Bf16, float, kBlockKeys, kHeads,
                                                                      cute::UMMA::Major::K, cute::UMMA::Major::K>{}));
using MmaO = decltype(cute::make_tiled_mma(cute::SM100_MMA_F16BF16_SS<Bf16, Bf16, float, kHeadDim, kHeads,
                                                                      cute::UMMA::Major::MN, cute::UMMA::Major::K>{}));

// Operand layouts in MMA-partitioned form ((rows, 16), 1, 8): element (r, c) of the row-major operand is at
// ((r, c % 16), 0, c / 16).
using KeysByDims = cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeadDim>>;
using HeadsByDims = cute::Shape<cute::Int<kHeads>, cute::Int<kHeadDim>>;
using DimsByKeys = cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockKeys>>;
using HeadsByKeys = cute::Shape<cute::Int<kHeads>, cute::Int<kBlockKeys>>;
using KeysByHeads = cute::Shape<cute::Int<kBlockKeys>, cute::Int<kHeads>>;  // S^T in TMEM
using DimsByHeads = cute::Shape<cute::Int<kHeadDim>, cute::Int<kHeads>>;   // O^T in TMEM
using LayoutK = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_A(MmaS{}, KeysByDims{})));
using LayoutQ = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_B(MmaS{}, HeadsByDims{})));
using LayoutV = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_MN_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_A(MmaO{}, DimsByKeys{})));
using LayoutP = decltype(cute::UMMA::tile_to_mma_shape(cute::UMMA::Layout_K_SW128_Atom<Bf16>{},
                                                       cute::partition_shape_B(MmaO{}, HeadsByKeys{})));

// Shared memory: [K or V of one block 32 KB | Q 4 KB | P^T of up to 16 blocks, 4 KB each], 1024-byte aligned.
struct SharedPlan {
  static constexpr int kAlign = 1024;
  static constexpr int kBlockBytes = kBlockKeys * kHeadDim * 2;
  static constexpr int kQBytes = kHeads * kHeadDim * 2;
  static constexpr int kPBytes = kHeads * kBlockKeys * 2;
  static constexpr int kKVOffset = 0;
  static constexpr int kQOffset = kKVOffset + kBlockBytes;
  static constexpr int kPOffset = kQOffset + kQBytes;
  static constexpr int kBytes = kPOffset + kMaxBlocks * kPBytes + kAlign;
  static_assert(int(cute::cosize_v<LayoutK>) * 2 == kBlockBytes && int(cute::cosize_v<LayoutV>) * 2 == kBlockBytes &&
                    int(cute::cosize_v<LayoutQ>) * 2 == kQBytes && int(cute::cosize_v<LayoutP>) * 2 == kPBytes,
                "operand sizes");
  static_assert(kQBytes % kAlign == 0 && kPBytes % kAlign == 0, "every operand starts on a swizzle period");
};

// Tensor memory: 256 columns; scores of block i in [16 i, 16 i + 16); O^T reuses [0, 16) after the softmax. (If the
// hardware wants N = 16 accumulators 32-column aligned, use 32-column slots and kMaxBlocks = 8: a first check on a
// Blackwell GPU.)
struct TmemPlan {
  static constexpr int kColumns = kMaxBlocks * kHeads;  // 256, a power of two
  static constexpr int kOColumn = 0;
};

}  // namespace jax_msa::sm100::decode
