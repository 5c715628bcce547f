// TMA descriptors (CUtensorMap) built on the host for a call's buffers. The driver's encoder is reached through the
// runtime (cudaGetDriverEntryPointByVersion), so the module keeps linking cudart statically and nothing else.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jax_msa::cuda {

// A row-major 2-D bf16 tensor [rows, cols] (row stride row_bytes, a multiple of 16) read in boxes of
// box_cols x box_rows (box_cols * 2 = 128 bytes) with the 128-byte swizzle, no out-of-bounds fill beyond zeros.
// Returns cudaErrorInvalidValue when the driver refuses the description (or has no encoder).
cudaError_t encode_bf16_tensor_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                      uint64_t row_bytes, uint32_t box_rows, uint32_t box_cols);

// A row-major 2-D byte tensor [rows, cols] (row stride row_bytes, a multiple of 16) read in boxes of box_cols x
// box_rows bytes (box_cols a multiple of 16, at most 256), unswizzled: the box lands row-major.
cudaError_t encode_u8_tensor_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                    uint64_t row_bytes, uint32_t box_rows, uint32_t box_cols);

}  // namespace jax_msa::cuda
