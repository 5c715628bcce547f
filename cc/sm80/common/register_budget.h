// The register budget of the warp-MMA kernels: how many CTAs an SM `__launch_bounds__` promises, per architecture.
//
// Each kernel is tuned for `wanted` CTAs an SM on sm_90 (its shared-memory plan fits that many there). An
// architecture whose shared memory holds fewer of its CTAs can never run `wanted` of them, so promising `wanted`
// would only cap its registers (65536 / (threads x wanted)) and make ptxas spill for nothing: the budget is `wanted`
// capped by the CTAs that fit. Shared memory an SM, as the CUDA programming guide gives it: sm_86 / sm_89 / sm_120
// 100 KB, sm_80 / sm_87 164 KB, sm_90 / sm_100 228 KB (227 KB usable; 1 KB of it reserved per CTA, which each
// kernel's footprint counts).
#pragma once

namespace jax_msa::sm80 {

constexpr int kSm90SharedBytes = 227 * 1024;  // what an SM offers its CTAs on sm_90 / sm_100

// `wanted` CTAs of `footprint_bytes` (dynamic + static shared memory + the 1 KB reserve) an SM, capped by what the
// architecture being compiled holds (at least 1). Host code (no __CUDA_ARCH__) gets `wanted`.
constexpr int register_budget_ctas(int wanted, int footprint_bytes) {
#if defined(__CUDA_ARCH__)
  constexpr int kSmemPerSm = __CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200 ? 100 * 1024
                             : __CUDA_ARCH__ >= 900                                                ? kSm90SharedBytes
                                                                                                  : 164 * 1024;
  const int fit = kSmemPerSm / footprint_bytes;
  return fit < 1 ? 1 : (fit < wanted ? fit : wanted);
#else
  return wanted;
#endif
}

}  // namespace jax_msa::sm80
