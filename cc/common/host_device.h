// Portability macro for code shared by the CPU handlers (g++) and the CUDA kernels (nvcc).
#pragma once

#if defined(__CUDACC__)
#define MSA_HD __host__ __device__ __forceinline__
#else
#define MSA_HD inline
#endif
