# CUDA sources of the _jax_msa_cuda module (included by CMakeLists.txt when the CUDA handlers are built).
# One explicit kernel instantiation per .cu (compile time and memory stay bounded per file); paths relative
# to the project root.
set(JAX_MSA_CUDA_SOURCES
  cc/cuda/kernel_path.cc
  cc/cuda/write_kv.cu
  cc/ffi/decode_cuda_handler.cc
  cc/sm80/decode/decode_dispatch.cu
  cc/sm80/decode/combine_splits.cu
  cc/sm80/decode/cluster_launch.cc
  cc/sm80/decode/decode_bf16.cu
  cc/sm80/decode/decode_fp8.cu
  cc/sm80/decode/decode_nvfp4.cu
  cc/ffi/prefill_cuda_handler.cc
  cc/sm80/prefill/prefill_dispatch.cu
  cc/sm80/prefill/combine_partials.cu
  cc/sm80/prefill/prefill_bf16.cu
  cc/sm80/prefill/prefill_bf16_pipelined.cu
  cc/sm80/prefill/prefill_fp8.cu
  cc/sm80/prefill/prefill_nvfp4.cu
  cc/cuda/tensor_map.cc
  cc/sm90/prefill/prefill_dispatch.cc
  cc/sm90/prefill/prefill_bf16.cu
  cc/sm90/prefill/prefill_fp8.cu
  cc/sm90/prefill/prefill_nvfp4.cu
  cc/sm100/decode/decode_dispatch.cu
  cc/sm100/decode/decode_bf16.cu
  cc/sm100/decode/decode_fp8.cu
  cc/sm100/decode/decode_nvfp4.cu
  cc/sm100/prefill/prefill_dispatch.cu
  cc/sm100/prefill/prefill_bf16.cu
  cc/sm100/prefill/prefill_fp8.cu
  cc/sm100/prefill/prefill_nvfp4.cu
)
