// CPU building blocks: fp32 query load, attention of a group of query heads over one KV block (a
// normalized partial plus its log-sum-exp), and the log-sum-exp merge of partials. The GPU kernels
// follow the same decomposition (partial per (query, block), then merge).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/kv_format.h"
#include "common/numeric.h"

namespace jax_msa::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// q row (one head) -> fp32
inline void load_query(const void* q, bool is_fp8, float q_scale, int64_t row, int D, float* out) {
  if (is_fp8) {
    const uint8_t* p = static_cast<const uint8_t*>(q) + row * D;
    for (int d = 0; d < D; ++d) out[d] = e4m3_to_float(p[d]) * q_scale;
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(q) + row * D;
    for (int d = 0; d < D; ++d) out[d] = bf16_bits_to_float(p[d]);
  }
}

// K and V of one (page, KV head) in fp32, n_keys tokens. K is kept transposed ([D, 128]) so that the scores of
// all keys accumulate with vector instructions over the keys while each key's dot product still sums over d in
// order (the same rounding as a plain loop).
struct BlockKV {
  std::vector<float> kt, v;  // kt [D, 128], v [128, D]
  int n_keys = 0;
  void load(const KvPageReader& reader, int64_t page, int g, int n, float k_scale, float v_scale) {
    const int D = reader.head_dim;
    kt.resize(size_t(kPageSize) * D);
    v.resize(size_t(kPageSize) * D);
    std::vector<float> row(static_cast<size_t>(D));
    n_keys = n;
    for (int t = 0; t < n; ++t) {
      reader.load_token(page, g, t, false, k_scale, row.data());
      for (int d = 0; d < D; ++d) kt[size_t(d) * kPageSize + t] = row[d];
      reader.load_token(page, g, t, true, v_scale, &v[size_t(t) * D]);
    }
  }
};

// Attention of one query head over the first `visible` keys of a block: writes the normalized partial
// output o[D] and returns its lse (natural log). visible <= 0 -> o = 0, lse = -inf.
inline float attend_block(const float* qh, const BlockKV& kv, int visible, int D, float softmax_scale, float* o,
                          float* scores /* [128] scratch */) {
  std::fill(o, o + D, 0.0f);
  if (visible <= 0) return kNegInf;
  std::fill(scores, scores + visible, 0.0f);
  for (int d = 0; d < D; ++d) {  // scores[j] = sum over d (in order) of q[d] k[j, d]
    const float qd = qh[d];
    const float* kd = &kv.kt[size_t(d) * kPageSize];
    for (int j = 0; j < visible; ++j) scores[j] += qd * kd[j];
  }
  float m = kNegInf;
  for (int j = 0; j < visible; ++j) {
    scores[j] *= softmax_scale;
    m = std::max(m, scores[j]);
  }
  float l = 0.0f;
  for (int j = 0; j < visible; ++j) {
    const float p = std::exp(scores[j] - m);
    l += p;
    const float* vj = &kv.v[size_t(j) * D];
    for (int d = 0; d < D; ++d) o[d] += p * vj[d];
  }
  const float inv = 1.0f / l;
  for (int d = 0; d < D; ++d) o[d] *= inv;
  return m + std::log(l);
}

// Running log-sum-exp merge of normalized partials (o_i, lse_i).
struct LseMerger {
  std::vector<float> acc;
  float m = kNegInf, s = 0.0f;
  explicit LseMerger(int D) : acc(size_t(D), 0.0f) {}
  void add(const float* o, float lse, int D) {
    if (lse == kNegInf) return;
    if (lse > m) {
      const float c = (m == kNegInf) ? 0.0f : std::exp(m - lse);
      for (int d = 0; d < D; ++d) acc[d] *= c;
      s *= c;
      m = lse;
    }
    const float w = std::exp(lse - m);
    for (int d = 0; d < D; ++d) acc[d] += w * o[d];
    s += w;
  }
  // out = merged output rounded to bf16 (0 for an empty set); returns the merged lse (-inf if empty)
  float finish(uint16_t* out, int D) const {
    if (m == kNegInf) {
      for (int d = 0; d < D; ++d) out[d] = float_to_bf16_bits(0.0f);
      return kNegInf;
    }
    const float inv = 1.0f / s;
    for (int d = 0; d < D; ++d) out[d] = float_to_bf16_bits(acc[d] * inv);
    return m + std::log(s);
  }
};

}  // namespace jax_msa::cpu
