// TMA descriptor encoding (see tensor_map.h).
#include "cuda/tensor_map.h"

#include <cudaTypedefs.h>

namespace jax_msa::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

cudaError_t encode_2d(CUtensorMap* map, CUtensorMapDataType type, CUtensorMapSwizzle swizzle, const void* base,
                      uint64_t rows, uint64_t cols, uint64_t row_bytes, uint32_t box_rows, uint32_t box_cols) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorInvalidValue;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t encode_bf16_tensor_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                      uint64_t row_bytes, uint32_t box_rows, uint32_t box_cols) {
  return encode_2d(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, CU_TENSOR_MAP_SWIZZLE_128B, base, rows, cols, row_bytes,
                   box_rows, box_cols);
}

cudaError_t encode_u8_tensor_map_2d(CUtensorMap* map, const void* base, uint64_t rows, uint64_t cols,
                                    uint64_t row_bytes, uint32_t box_rows, uint32_t box_cols) {
  return encode_2d(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, CU_TENSOR_MAP_SWIZZLE_NONE, base, rows, cols, row_bytes,
                   box_rows, box_cols);
}

}  // namespace jax_msa::cuda
