#pragma once
// Softmax attention probabilities of a group of query heads over one KV head's rows:
// the one primitive the container, IndexCache and attend() share. fp32 / fp16 / bf16 rows
// go through the dispatched kernel (kernels/attention_decode.hpp); any other storage type
// (double) through the Eigen reference, which also stays as the test oracle.
#include <Eigen/Core>
#include <cmath>
#include <cstddef>
#include <type_traits>

#include "errors.hpp"
#include "kernels/attention_decode.hpp"

namespace kvevict::detail {

/// True for the storage types the attention kernels read directly.
template <class Scalar>
inline constexpr bool kernel_scalar = std::is_same_v<Scalar, float> ||
                                      std::is_same_v<Scalar, Eigen::half> ||
                                      std::is_same_v<Scalar, Eigen::bfloat16>;

template <class Scalar>
constexpr kernels::KvFormat kv_format_of() noexcept {
  if constexpr (std::is_same_v<Scalar, Eigen::half>) return kernels::KvFormat::f16;
  else if constexpr (std::is_same_v<Scalar, Eigen::bfloat16>) return kernels::KvFormat::bf16;
  else return kernels::KvFormat::f32;
}
static_assert(sizeof(Eigen::half) == 2 && sizeof(Eigen::bfloat16) == 2);

/// T, named as a type that depends on D. A template's expressions whose types do not depend
/// on its parameters are analysed where the template is defined, in every includer, whether
/// or not it is ever instantiated (for an Eigen expression: its whole class hierarchy); a
/// template that names its Eigen types through dependent_t<..., Param> pays that only where
/// it is instantiated (issue 19's include cost).
template <class T, class D>
struct dependent_type {
  using type = T;
};
template <class T, class D>
using dependent_t = typename dependent_type<T, D>::type;

/// The Eigen reference (the pre-kernel implementation, kept as the test oracle):
/// out[g * n + i] = softmax_i(scale * q_g . k_i), scale 0 meaning 1 / sqrt(d).
template <class Scalar>
void group_probabilities_reference(const Scalar* keys, std::size_t n, std::size_t d,
                                   const float* queries, int group, float* out,
                                   float scale = 0.0f) {
  if (n == 0) return;
  using RowMajorS = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using RowMajorF =
      Eigen::Matrix<dependent_t<float, Scalar>, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
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

/// Probabilities of one group into out (group x n); false if a score q.k * scale is not
/// finite (out then unspecified). scale 0 means 1 / sqrt(d).
template <class Scalar>
[[nodiscard]] bool group_probabilities_checked(const Scalar* keys, std::size_t n, std::size_t d,
                                               const float* queries, std::size_t group,
                                               float* out, float scale = 0.0f) {
  if (n == 0) return true;
  if (scale == 0.0f) scale = 1.0f / std::sqrt(static_cast<float>(d));
  if constexpr (kernel_scalar<Scalar>) {
    return kernels::attention_probs_as<kv_format_of<Scalar>()>(queries, d, group, keys, d, n, d,
                                                               scale, out);
  } else {
    group_probabilities_reference(keys, n, d, queries, static_cast<int>(group), out, scale);
    std::uint32_t bad = 0;
    for (std::size_t i = 0; i < group * n; ++i) bad |= kernels::detail::nonfinite_bit(out[i]);
    return bad == 0;
  }
}

/// out[g * n + i] = softmax_i(q_g . k_i * scale) for the G query heads of a group,
/// computed in float whatever the storage type (fp16/bf16 rows are widened). Throws
/// kvevict::Error when a score overflows.
template <class Scalar>
void group_probabilities(const Scalar* keys, std::size_t n, std::size_t d, const float* queries,
                         int group, float* out, float scale = 0.0f) {
  require(group_probabilities_checked(keys, n, d, queries, static_cast<std::size_t>(group), out,
                                      scale),
          "attention: a score q.k x scale is not finite over ", n,
          " rows (query or key magnitudes overflow float)");
}

}  // namespace kvevict::detail
