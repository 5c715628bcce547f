// The order of the 128 columns of a bf16 partial output row on the GPU (PrefillParams::partial_o), written by the
// prefill kernels and read by the combine (cc/sm80/prefill/combine_partials.cu).
//
// Natural order: column c at position c. A thread of an MMA accumulator (mma.sync m16n8k16, wgmma m64nNk16) holds
// columns 8 j + 2 q + e of its rows (q = lane % 4, j = 0..15, e = 0..1). In natural order a store instruction of j
// writes, for each row, the quad's 4 x 4 bytes: 16 contiguous bytes, half a 32-byte sector; 16 instructions a row.
//
// Fragment order (PrefillParams::partial_fragment_order): column 8 j + 2 q + e at position
// 32 (j / 4) + 8 q + 2 (j % 4) + e. A thread's values of j = 4 i .. 4 i + 3 are then 16 contiguous bytes, and the
// quad's four of them 64 contiguous bytes (two whole sectors): 4 instructions of 16-byte stores a row. The combine
// maps positions back to columns when it writes the output.
#pragma once

#include "common/host_device.h"

namespace jax_msa::partial_order {

constexpr int kRowColumns = 128;

// Position of column c in a fragment-order row.
MSA_HD constexpr int fragment_position(int c) {
  return 32 * (c >> 5) + 8 * ((c >> 1) & 3) + 2 * ((c >> 3) & 3) + (c & 1);
}

// Column held at position p of a fragment-order row (the inverse of fragment_position).
MSA_HD constexpr int fragment_column(int p) {
  return 8 * (4 * (p >> 5) + ((p >> 1) & 3)) + 2 * ((p >> 3) & 3) + (p & 1);
}

constexpr bool fragment_order_is_a_permutation() {
  for (int c = 0; c < kRowColumns; ++c)
    if (fragment_position(c) < 0 || fragment_position(c) >= kRowColumns || fragment_column(fragment_position(c)) != c)
      return false;
  return true;
}
static_assert(fragment_order_is_a_permutation());

}  // namespace jax_msa::partial_order
