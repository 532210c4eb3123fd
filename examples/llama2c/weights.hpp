#pragma once
// A view of one weight tensor in its stored type (f32, f16 or bf16), as the engine's
// forward pass reads it: matrix-vector products and row lookups accumulate in float.
// Both checkpoint readers (llama2.c's float file, Hugging Face safetensors memory-mapped)
// hand the one forward pass (llama2c.hpp's Transformer) these views.
#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/dtype.hpp"

namespace kvevict::llama2c {

using tensor::DType;

/// rows x cols, row-major, `dtype` elements at `data` (aligned to the element size; the
/// owner keeps the bytes alive). An empty view (data == nullptr) is an absent tensor.
struct Weight {
  const void* data = nullptr;
  DType dtype = DType::f32;
  int rows = 0;
  int cols = 0;

  [[nodiscard]] explicit operator bool() const { return data != nullptr; }

  using FloatMatrix =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

  /// out = W x (out has `rows` floats, x has `cols`). Float weights go through one Eigen
  /// product (what the llama2.c engine always did, bit for bit); 16-bit weights are widened
  /// one row at a time into `scratch` and dotted in float.
  void matvec(Eigen::VectorXf& out, const Eigen::VectorXf& x, std::vector<float>& scratch) const {
    if (dtype == DType::f32) {
      out.noalias() = FloatMatrix(static_cast<const float*>(data), rows, cols) * x;
      return;
    }
    out.resize(rows);
    scratch.resize(static_cast<std::size_t>(cols));
    const Eigen::Map<const Eigen::VectorXf> w(scratch.data(), cols);
    for (int r = 0; r < rows; ++r) {
      widen_row(r, scratch.data());
      out[r] = w.dot(x);
    }
  }

  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  /// Rows of a 16-bit matrix widened to float at a time by matmul(): its scratch stays
  /// kWidenRows x cols floats (4 MB at cols 4096), not the whole matrix.
  static constexpr int kWidenRows = 256;

  /// out = X W^T for a block of rows X (n x cols; out n x rows): matrix products, the
  /// weights read once. Float weights in one product; 16-bit weights widened kWidenRows
  /// rows at a time into `scratch`, one product per slice of output columns.
  void matmul(RowMatrix& out, const RowMatrix& x, std::vector<float>& scratch) const {
    out.resize(x.rows(), rows);
    if (dtype == DType::f32) {
      out.noalias() = x * FloatMatrix(static_cast<const float*>(data), rows, cols).transpose();
      return;
    }
    const auto c = static_cast<std::size_t>(cols);
    scratch.resize(static_cast<std::size_t>(std::min(rows, kWidenRows)) * c);
    for (int r0 = 0; r0 < rows; r0 += kWidenRows) {
      const int n = std::min(kWidenRows, rows - r0);
      for (int r = 0; r < n; ++r) widen_row(r0 + r, scratch.data() + static_cast<std::size_t>(r) * c);
      out.middleCols(r0, n).noalias() = x * FloatMatrix(scratch.data(), n, cols).transpose();
    }
  }

  /// Row r widened to float into out[0, cols).
  void widen_row(int r, float* out) const {
    const std::size_t n = static_cast<std::size_t>(cols);
    const std::size_t at = static_cast<std::size_t>(r) * n;
    if (dtype == DType::f32) {
      std::memcpy(out, static_cast<const float*>(data) + at, n * sizeof(float));
      return;
    }
    const auto* p = static_cast<const std::uint16_t*>(data) + at;
    if (dtype == DType::bf16) {
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint32_t bits = static_cast<std::uint32_t>(p[i]) << 16;
        std::memcpy(out + i, &bits, 4);
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) out[i] = tensor::half_to_float(p[i]);
    }
  }
};

}  // namespace kvevict::llama2c
