// tcgen05 (sm_100a) kernels, UNVERIFIED: ordering fences around thread synchronization, the CTA's tensor memory and
// MMA-completion barrier, issuing a UMMA product from shared-memory operands, tensor-memory loads.
// Defined only when compiling for an architecture with tcgen05 (JAX_MSA_SM100_TCGEN05); the kernels' bodies are
// empty elsewhere.
#pragma once
#include <cstdint>

#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/config.hpp>
#include <cute/arch/tmem_allocator_sm100.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace jax_msa::sm100 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#if defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED) && defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED)
#define JAX_MSA_SM100_TCGEN05 1

// Ordering of tcgen05 operations around thread synchronization (PTX: tcgen05.fence).
__device__ __forceinline__ void tcgen05_before_thread_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tcgen05_after_thread_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// 32 consecutive fp32 columns of this thread's TMEM lane (the warp's lane quarter), waited for.
__device__ __forceinline__ void tmem_load_row32(uint32_t taddr, float (&x)[32]) {
  uint32_t r[32];
  cute::SM100_TMEM_LOAD_32dp32b32x::copy(taddr, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10],
                                         r[11], r[12], r[13], r[14], r[15], r[16], r[17], r[18], r[19], r[20], r[21],
                                         r[22], r[23], r[24], r[25], r[26], r[27], r[28], r[29], r[30], r[31]);
  cutlass::arch::fence_view_async_tmem_load();
#pragma unroll
  for (int j = 0; j < 32; ++j) x[j] = __uint_as_float(r[j]);
}

// 16 consecutive fp32 columns of this thread's TMEM lane, waited for.
__device__ __forceinline__ void tmem_load_row16(uint32_t taddr, float (&x)[16]) {
  uint32_t r[16];
  cute::SM100_TMEM_LOAD_32dp32b16x::copy(taddr, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10],
                                         r[11], r[12], r[13], r[14], r[15]);
  cutlass::arch::fence_view_async_tmem_load();
#pragma unroll
  for (int j = 0; j < 16; ++j) x[j] = __uint_as_float(r[j]);
}
// All threads: warp 0 allocates `columns` of tensor memory (and gives up the right to allocate more, so another CTA
// on the SM may), thread 0 initializes the MMA-completion barrier; returns the TMEM base once every thread sees it.
__device__ __forceinline__ uint32_t tmem_alloc_and_init_barrier(int columns, uint32_t* s_tmem_base, uint64_t* s_bar) {
  if ((threadIdx.x >> 5) == 0) {
    __syncwarp();  // tcgen05.alloc is .sync.aligned: the whole warp, converged
    cute::TMEM::Allocator1Sm alloc{};
    alloc.allocate(columns, s_tmem_base);
    alloc.release_allocation_lock();
  }
  if (threadIdx.x == 0) {
    cute::initialize_barrier(*s_bar, 1);
    cutlass::arch::fence_barrier_init();
  }
  tcgen05_before_thread_sync();
  __syncthreads();
  tcgen05_after_thread_sync();
  return *s_tmem_base;
}

// All threads: frees the tensor memory once every warp's loads from it are done.
__device__ __forceinline__ void tmem_free(uint32_t tmem, int columns) {
  tcgen05_before_thread_sync();
  __syncthreads();
  if ((threadIdx.x >> 5) == 0) {
    tcgen05_after_thread_sync();
    cute::TMEM::Allocator1Sm{}.free(tmem, columns);
  }
}

// One warp (one lane issues inside the MMA atom): D (in TMEM at tmem_d, shape_mn) = or += A B over every K-block of
// the shared-memory operands sA, sB (UMMA layouts), then commits the MMAs to s_bar.
template <class TiledMma, class TensorA, class TensorB, class ShapeMN>
__device__ __forceinline__ void issue_mma(TiledMma& mma, const TensorA& sA, const TensorB& sB, ShapeMN shape_mn,
                                          uint32_t tmem_d, bool accumulate, uint64_t* s_bar) {
  using namespace cute;
  __syncwarp();  // the MMA atom and the commit elect one lane of a converged warp
  tcgen05_after_thread_sync();
  auto thr = mma.get_slice(0);
  Tensor tA = thr.make_fragment_A(sA);
  Tensor tB = thr.make_fragment_B(sB);
  Tensor tD = partition_fragment_C(mma, shape_mn);
  tD.data() = tmem_d;
  mma.accumulate_ = accumulate ? UMMA::ScaleOut::One : UMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(tA); ++k) {
    gemm(mma, tA(_, _, k), tB(_, _, k), tD);
    mma.accumulate_ = UMMA::ScaleOut::One;
  }
  cutlass::arch::umma_arrive(s_bar);
}

// All threads: waits for the MMAs committed to s_bar (the barrier's phase alternates with every commit).
__device__ __forceinline__ void wait_mma(uint64_t* s_bar, int& phase) {
  cute::wait_barrier(*s_bar, phase);
  phase ^= 1;
  tcgen05_after_thread_sync();
}
#endif

}  // namespace jax_msa::sm100
