#pragma once
// RowCodec<S>: how a container stores one K/V row of storage type S, written once for
// every layout that owns rows (KVCache's dense rows, PagedCache's pool blocks): the units
// (elements of StorageOf<S>::unit) a key row and a value row take, encoding a float row
// into them, decoding stored rows back to floats, and the input checks (a value the
// format cannot hold is a kvevict::Error naming it, before anything changes).
//   float, Eigen::half, Eigen::bfloat16: head_dim elements of S per row, converted;
//   quantized formats (quantized.hpp: Q8<G>, Q4<G>, E4M3, KV<KF, VF>): the codec's bytes.
#include <cstddef>
#include <cstdint>
#include <span>

#include "bookkeeping.hpp"
#include "quantized.hpp"

namespace kvevict::detail {

template <class S>
struct RowCodec {
  using Storage = StorageOf<S>;
  using unit = typename Storage::unit;  ///< element of the stored arrays
  using view = typename Storage::view;  ///< element of the rows policies read
  static constexpr bool quantized = Storage::quantized;

  /// Throws kvevict::Error unless the format's group size divides head_dim.
  static void check_dim(std::size_t d) {
    if constexpr (quantized) {
      check_codec_dim<typename Storage::key_codec>(d, "key");
      check_codec_dim<typename Storage::value_codec>(d, "value");
    }
  }
  [[nodiscard]] static std::size_t key_units(std::size_t d) {
    if constexpr (quantized) return Storage::key_codec::row_bytes(d);
    else return d;
  }
  [[nodiscard]] static std::size_t value_units(std::size_t d) {
    if constexpr (quantized) return Storage::value_codec::row_bytes(d);
    else return d;
  }
  /// Keys or values about to be stored: finite and within the format's range.
  static void check_stored(std::span<const float> x, const char* what, bool is_key) {
    if constexpr (quantized) {
      if (is_key) check_encodable<typename Storage::key_codec>(x.data(), x.size(), what);
      else check_encodable<typename Storage::value_codec>(x.data(), x.size(), what);
    } else {
      check_storable<S>(x, what);
    }
  }
  /// check_stored's test as a bound on |value| (the bit pattern of the smallest |value|
  /// rejected): float, fp16, bf16; 0 for quantized formats (their codecs' own checks).
  [[nodiscard]] static std::uint32_t limit_bits(bool is_key) {
    (void)is_key;
    if constexpr (quantized) return 0;
    else return storage_limit_bits<S>();
  }
  /// One row (d floats each) into k (key_units) and v (value_units).
  static void encode(const float* key, const float* value, std::size_t d, unit* k, unit* v) {
    if constexpr (quantized) {
      Storage::key_codec::encode(key, d, k);
      Storage::value_codec::encode(value, d, v);
    } else {
      for (std::size_t j = 0; j < d; ++j) k[j] = static_cast<S>(key[j]);
      for (std::size_t j = 0; j < d; ++j) v[j] = static_cast<S>(value[j]);
    }
  }
  /// `rows` stored key (is_key) or value rows, back to back, as rows x d floats.
  static void decode(bool is_key, const unit* in, std::size_t rows, std::size_t d, float* out) {
    for (std::size_t r = 0; r < rows; ++r) {
      if constexpr (quantized) {
        if (is_key) Storage::key_codec::decode(in + r * Storage::key_codec::row_bytes(d), d, out + r * d);
        else Storage::value_codec::decode(in + r * Storage::value_codec::row_bytes(d), d, out + r * d);
      } else {
        for (std::size_t j = 0; j < d; ++j) out[r * d + j] = static_cast<float>(in[r * d + j]);
      }
    }
  }
};

}  // namespace kvevict::detail
