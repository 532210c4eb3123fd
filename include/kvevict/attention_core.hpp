#pragma once
// Softmax attention probabilities of a group of query heads over one KV head's rows:
// the one primitive the container and the reference attention share.
#include <Eigen/Core>
#include <cmath>
#include <cstddef>

namespace kvevict::detail {

/// out[g * n + i] = softmax_i(q_g . k_i / sqrt(d)) for the G query heads of a group,
/// computed in float whatever the storage type (fp16/bf16 rows are widened).
template <class Scalar>
void group_probabilities(const Scalar* keys, std::size_t n, std::size_t d, const float* queries,
                         int group, float* out, float scale = 0.0f) {
  if (n == 0) return;
  using RowMajorS = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using RowMajorF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const auto rows = static_cast<Eigen::Index>(n);
  const auto dim = static_cast<Eigen::Index>(d);
  Eigen::Map<const RowMajorS> k(keys, rows, dim);
  Eigen::Map<const RowMajorF> q(queries, group, dim);
  Eigen::Map<RowMajorF> p(out, group, rows);
  if (scale == 0.0f) scale = 1.0f / std::sqrt(static_cast<float>(d));
  if constexpr (std::is_same_v<Scalar, float>) {
    p.noalias() = q * k.transpose();
  } else {
    p.noalias() = q * k.template cast<float>().transpose();
  }
  for (Eigen::Index g = 0; g < group; ++g) {
    auto row = p.row(g);
    row *= scale;
    const float m = row.maxCoeff();
    row = (row.array() - m).exp().matrix();
    row /= row.sum();
  }
}

}  // namespace kvevict::detail
