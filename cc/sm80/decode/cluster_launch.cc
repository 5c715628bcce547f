// Host side of the decode's cluster merge: see cluster_launch.h.
#include "sm80/decode/cluster_launch.h"

#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/env_flag.h"

namespace jax_msa::sm80::decode {

namespace {

constexpr int kMaxPortableClusterSize = 8;

std::atomic<uint64_t> g_merge_counts[kDecodeMergeKinds];

}  // namespace

ClusterSupport cluster_merge_supported(const void* kernel, int splits, int threads, int smem_bytes) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    cudaGetLastError();  // clear the error: this launch falls back to the combine kernel
    return ClusterSupport::kUnknown;
  }
  // Both the SASS and the code it came from must be sm_90+: PTX of an older target, compiled for this device at
  // load time, has binaryVersion 90 but no cluster merge in it (ptxVersion says so).
  if (attributes.binaryVersion < 90 || attributes.ptxVersion < 90) return ClusterSupport::kNo;
  if (splits > kMaxPortableClusterSize &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    return ClusterSupport::kUnknown;
  }
  cudaLaunchAttribute cluster = cluster_dimension(splits);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(splits), 1, 1);
  config.blockDim = dim3(unsigned(threads), 1, 1);
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return ClusterSupport::kUnknown;
  }
  return clusters > 0 ? ClusterSupport::kYes : ClusterSupport::kNo;
}

bool use_cluster_merge(const void* kernel, int splits, int threads, int smem_bytes) {
  if (splits < 2 || splits > kMaxClusterSplits) return false;
  if (cuda::env_equals("JAX_MSA_DECODE_CLUSTER_MERGE", "0")) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  using Key = std::tuple<int, const void*, int, int, int>;
  static std::mutex mutex;
  static std::map<Key, bool> answers;  // definite answers only: a failed query is asked again next call
  const Key key{device, kernel, splits, threads, smem_bytes};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = answers.find(key); it != answers.end()) return it->second;
  const ClusterSupport support = cluster_merge_supported(kernel, splits, threads, smem_bytes);
  if (support == ClusterSupport::kUnknown) return false;
  answers.emplace(key, support == ClusterSupport::kYes);
  return support == ClusterSupport::kYes;
}

void count_decode_merge(DecodeMerge merge) {
  g_merge_counts[int(merge)].fetch_add(1, std::memory_order_relaxed);
}

std::array<uint64_t, kDecodeMergeKinds> decode_merge_counts() {
  std::array<uint64_t, kDecodeMergeKinds> counts;
  for (int i = 0; i < kDecodeMergeKinds; ++i) counts[i] = g_merge_counts[i].load(std::memory_order_relaxed);
  return counts;
}

}  // namespace jax_msa::sm80::decode
