// CUDA write_kv: quantize-on-write of new K/V tokens into a bf16, FP8 or NVFP4 paged cache, in place.
//
// Work split: one thread per 16-value chunk of one (token, KV head, K|V) half; a (token, head) row has
// 2 * D/16 <= 32 chunks (16 threads for D = 128), the block packs 256 / (2 * D/16) rows along threadIdx.y.
// A chunk is exactly one NVFP4 scale group, so no thread talks to another.
//   bf16 : two 16-byte loads, two 16-byte stores (the K and V halves of a cache row are contiguous)
//   FP8  : two 16-byte loads, one 16-byte store of 16 E4M3 bytes
//   NVFP4: two 16-byte loads, one 8-byte store of 16 E2M1 nibbles, one byte store of the E4M3 scale
//          (K scales are linear per token, V scales sit in 4x4 token quads: scattered bytes)
// When a buffer is not 16-byte aligned (never the case for XLA's own allocations) the same kernel runs
// with element-wise loads and stores instead.
//
// The arithmetic is cc/common/quantize.h, shared with the CPU handler, so the bytes agree with it and with
// jax_msa/kv_cache.py. Its divisions must stay IEEE (never build with fast-math / -prec-div=false).
#include "cuda/write_kv.h"

#include <cstdint>

#include "common/kv_format.h"
#include "common/numeric.h"
#include "common/quantize.h"

namespace jax_msa::cuda {
namespace {

constexpr int kChunk = 16;          // values per thread: one NVFP4 scale group
constexpr int kBlockThreads = 256;
constexpr int kMaxThreadsPerRow = 32;
constexpr int64_t kMaxGrid = int64_t(1) << 20;  // rows beyond this are covered by the grid-stride loop

// 16 bf16 values as 8 little-endian words: value 2i in the low half of w[i], 2i+1 in the high half.
template <bool kVec>
__device__ __forceinline__ void load_chunk(const uint16_t* __restrict__ src, uint32_t (&w)[8]) {
  if constexpr (kVec) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(src));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(src) + 1);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = uint32_t(__ldg(src + 2 * i)) | (uint32_t(__ldg(src + 2 * i + 1)) << 16);
  }
}

// Writes kWords 32-bit words (little-endian bytes) to dst; kVec: dst is aligned to min(16, 4 * kWords) bytes.
template <bool kVec, int kWords>
__device__ __forceinline__ void store_words(uint8_t* __restrict__ dst, const uint32_t* w) {
  if constexpr (kVec && kWords == 8) {
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(w[4], w[5], w[6], w[7]);
  } else if constexpr (kVec && kWords == 4) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (kVec && kWords == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int i = 0; i < 4 * kWords; ++i) dst[i] = uint8_t(w[i / 4] >> (8 * (i % 4)));
  }
}

// n / d without a division instruction sequence, for 0 <= n < 2^32 and 1 <= d < 2^32: magic = ceil(2^64 / d) =
// (2^64 + e) / d with 0 <= e < d, so n * magic / 2^64 = n / d + n e / (d 2^64), and n e < 2^64 leaves the floor
// as it is. d = 1 (whose magic, 2^64, does not fit) returns n. The kernel's two divisions were 64-bit ones (its
// row by Hkv, its token by tokens_per_scale); 96542cf's per-token scale entry (that second division and the indexed
// load) cost NVFP4 writes 3.3-6.6% on an H100 (docs/BENCHMARKS.md, fortieth session). Callers keep rows < 2^32
// (cuda_module.cc refuses more). cutlass::FastDivmod (one multiply-high, 31-bit int dividends) compiled worse here
// (forty-third session, sm_90a: the NVFP4 kernels 64 -> 83 / 106 registers, 1,304 -> 1,368 instructions).
struct MagicDivisor {
  uint64_t magic;
  uint32_t d;
  static MagicDivisor of(uint32_t d) { return {d > 1 ? UINT64_MAX / d + 1 : 0, d}; }
  __device__ __forceinline__ uint32_t divide(uint32_t n) const {
    // the top 32 bits of the 96-bit n * magic: (n * magic_hi + (n * magic_lo) / 2^32) / 2^32, no 64-bit overflow
    const uint64_t high = uint64_t(n) * uint32_t(magic >> 32) + __umulhi(n, uint32_t(magic));
    return d == 1 ? n : uint32_t(high >> 32);
  }
};

// store_words when `valid`, else nothing. Vectorized: one predicated store instruction (inline PTX), so that the
// compiler sees no branch on `valid` and keeps the loads and arithmetic that feed the store above the slot's check
// (their latency then overlaps the slot's round trip instead of following it).
template <bool kVec, int kWords>
__device__ __forceinline__ void store_words_if(bool valid, uint8_t* __restrict__ dst, const uint32_t* w) {
  if constexpr (kVec && kWords == 8) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t"
                 "@p st.global.v4.u32 [%1], {%2, %3, %4, %5};\n\t@p st.global.v4.u32 [%1+16], {%6, %7, %8, %9};\n\t}"
                 :: "r"(uint32_t(valid)), "l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(w[4]), "r"(w[5]),
                    "r"(w[6]), "r"(w[7]) : "memory");
  } else if constexpr (kVec && kWords == 4) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p st.global.v4.u32 [%1], {%2, %3, %4, %5};\n\t}"
                 :: "r"(uint32_t(valid)), "l"(dst), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
  } else if constexpr (kVec && kWords == 2) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p st.global.v2.u32 [%1], {%2, %3};\n\t}"
                 :: "r"(uint32_t(valid)), "l"(dst), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    if (valid) store_words<kVec, kWords>(dst, w);
  }
}

// One byte when `valid` (a predicated st.global.u8).
__device__ __forceinline__ void store_byte_if(bool valid, uint8_t* dst, uint8_t b) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.u32 p, %0, 0;\n\t@p st.global.u8 [%1], %2;\n\t}"
               :: "r"(uint32_t(valid)), "l"(dst), "h"(uint16_t(b)) : "memory");
}

template <KvFormat kFormat, bool kVec>
__global__ void __launch_bounds__(kBlockThreads) write_kv_kernel(const WriteKvParams p, const MagicDivisor by_heads,
                                                                 const MagicDivisor by_tokens_per_scale) {
  const int D = p.head_dim;
  const int G = D / kChunk;  // chunks per K (or V) half
  const int Hkv = p.num_kv_heads;
  const int64_t rows = int64_t(p.num_tokens) * Hkv;
  const int64_t capacity = p.num_pages * kPageSize;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows;
       row += int64_t(gridDim.x) * blockDim.y) {
    const uint32_t n = by_heads.divide(uint32_t(row));  // rows < 2^32 (cuda_module.cc)
    const int g = int(row - int64_t(n) * Hkv);
    // One chunk a thread (blockDim.x = 2 G <= 32: launch_write_kv). The chunk and its scale are loaded first: nothing
    // but the stores' addresses depends on the slot, so these loads and the quantization overlap the slot's round trip.
    const int c2 = threadIdx.x;
    const int kv = c2 >= G ? 1 : 0;
    const int c = c2 - kv * G;
    uint32_t w[8];
    load_chunk<kVec>((kv ? p.v : p.k) + row * D + c * kChunk, w);
    float scale = 1.0f;
    if constexpr (kFormat != KvFormat::kBf16)  // (kv ? v_scale : k_scale)[n / tokens_per_scale]; volatile: issued here,
      asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];"  // not sunk below the NVFP4 group's NaN branch, which uses it
                   : "=f"(scale) : "l"((kv ? p.v_scale : p.k_scale) + by_tokens_per_scale.divide(n)));
    // Padding or a slot beyond the cache is skipped: its stores are predicated off (no branch, which would let the
    // compiler sink the loads above below it), and slot 0 keeps the address arithmetic in range.
    const int32_t slot_read = p.slot_mapping[n];
    const bool valid = slot_read >= 0 && slot_read < capacity;
    const int32_t slot = valid ? slot_read : 0;
    const int64_t page = slot / kPageSize;
    const int t = slot % kPageSize;
    if constexpr (kFormat == KvFormat::kBf16) {
      const int64_t elem = ((page * Hkv + g) * kPageSize + t) * (2 * int64_t(D)) + kv * D + c * kChunk;
      store_words_if<kVec, 8>(valid, reinterpret_cast<uint8_t*>(static_cast<uint16_t*>(p.kv_cache) + elem), w);
    } else if constexpr (kFormat == KvFormat::kFp8) {
      float x[kChunk];
      bf16_pairs_to_float(w, x);
      uint32_t q[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < kChunk; i += 2)
        q[i / 4] |= uint32_t(fp8_quantize_pair(x[i], x[i + 1], scale)) << (8 * (i % 4));
      const int64_t byte = ((page * Hkv + g) * kPageSize + t) * (2 * int64_t(D)) + kv * D + c * kChunk;
      store_words_if<kVec, 4>(valid, static_cast<uint8_t*>(p.kv_cache) + byte, q);
    } else {
      const Nvfp4Slot geo{D};
      uint32_t q[2];  // the group's 8 data bytes; its values stay packed bf16 pairs (two a compare on sm_90+)
      const uint8_t sf = nvfp4_quantize_group_bf16x2(w, scale, q);
      uint8_t* base = static_cast<uint8_t*>(p.kv_cache) + geo.slot_offset(page, Hkv, g, kv);
      store_words_if<kVec, 2>(valid, base + int64_t(t) * geo.data_bytes_per_token() + c * 8, q);
      store_byte_if(valid, base + (kv ? geo.v_scale_offset(t, c) : geo.k_scale_offset(t, c)), sf);
    }
  }
}

template <KvFormat kFormat>
void launch(const WriteKvParams& p, bool vec, dim3 grid, dim3 block, cudaStream_t stream) {
  const MagicDivisor by_heads = MagicDivisor::of(uint32_t(p.num_kv_heads));
  const MagicDivisor by_tokens_per_scale = MagicDivisor::of(uint32_t(p.tokens_per_scale));
  if (vec)
    write_kv_kernel<kFormat, true><<<grid, block, 0, stream>>>(p, by_heads, by_tokens_per_scale);
  else
    write_kv_kernel<kFormat, false><<<grid, block, 0, stream>>>(p, by_heads, by_tokens_per_scale);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

cudaError_t launch_write_kv(const WriteKvParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.num_tokens) * p.num_kv_heads;
  if (rows <= 0 || p.head_dim <= 0) return cudaSuccess;
  const int chunks_per_row = 2 * (p.head_dim / kChunk);
  // one thread a chunk: the kernel has no loop over a row's chunks (cuda_module.cc refuses head_dim > 256)
  if (p.head_dim % kChunk != 0 || chunks_per_row > kMaxThreadsPerRow) return cudaErrorInvalidValue;
  const int bx = chunks_per_row;
  const int by = kBlockThreads / bx;
  const int64_t blocks_needed = (rows + by - 1) / by;
  const dim3 block(bx, by);
  const dim3 grid(unsigned(blocks_needed < kMaxGrid ? blocks_needed : kMaxGrid));
  const bool vec = aligned16(p.k) && aligned16(p.v) && aligned16(p.kv_cache);
  switch (p.kv_format) {
    case KvFormat::kBf16:
      launch<KvFormat::kBf16>(p, vec, grid, block, stream);
      break;
    case KvFormat::kFp8:
      launch<KvFormat::kFp8>(p, vec, grid, block, stream);
      break;
    case KvFormat::kNvfp4:
      launch<KvFormat::kNvfp4>(p, vec, grid, block, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace jax_msa::cuda
