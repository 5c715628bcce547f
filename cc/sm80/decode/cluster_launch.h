// Host side of the decode's cluster merge (cluster_merge.cuh): whether a split-K launch runs its splits as one
// thread-block cluster per (token, KV head), and a count of which merge each split-K launch used (read by the GPU
// tests through the module's decode_merge_launches(), so they can tell which path ran).
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

namespace jax_msa::sm80::decode {

// The largest cluster sm_90 launches (with cudaFuncAttributeNonPortableClusterSizeAllowed beyond 8).
constexpr int kMaxClusterSplits = 16;

// The launch attribute that groups grid.x in clusters of `splits` CTAs.
inline cudaLaunchAttribute cluster_dimension(int splits) {
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = unsigned(splits);
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  return cluster;
}

// How a split-K launch merged its splits: the combine kernel, a thread-block cluster, or the teams of one CTA
// (config.h, CtaLayout: kTeams and kThreeTeams at one CTA an SM, kTeamsTwoPerSm at two)
enum class DecodeMerge : int { kCombineKernel = 0, kCluster = 1, kTeams = 2, kTeamsTwoPerSm = 3 };
constexpr int kDecodeMergeKinds = 4;

enum class ClusterSupport : int { kNo = 0, kYes = 1, kUnknown = 2 };

// Uncached: the device's and the kernel's answer. The kernel must be sm_90+ code compiled from sm_90+ source (the
// merge's cluster instructions exist only there), clusters of `splits` CTAs (non-portable beyond 8) must launch with
// this block size and dynamic shared memory, and at least one such cluster must fit the device. kUnknown: a query
// failed (its error is cleared).
ClusterSupport cluster_merge_supported(const void* kernel, int splits, int threads, int smem_bytes);

// Whether this split-K launch merges in a cluster: 2 <= splits <= 16, JAX_MSA_DECODE_CLUSTER_MERGE is not "0"
// (read per call with getenv: a test switch, not meant to be flipped while other threads launch), and
// cluster_merge_supported says kYes (definite answers cached per device, kernel, split count and launch shape). A
// host call only (no stream work): safe while XLA captures a command buffer.
bool use_cluster_merge(const void* kernel, int splits, int threads, int smem_bytes);

void count_decode_merge(DecodeMerge merge);

// Split-K decode launches since the module loaded: [combine kernel, cluster merge, teams of one CTA at one CTA an SM,
// at two].
std::array<uint64_t, kDecodeMergeKinds> decode_merge_counts();

}  // namespace jax_msa::sm80::decode
