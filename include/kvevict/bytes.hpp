#pragma once
// Little-endian byte writer and bounds-checked reader for saved state (serialize.hpp and
// the save_state/load_state hooks of policies). A reader never reads past its input and
// checks a count against the bytes left before anything is allocated for it.
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "errors.hpp"

namespace kvevict::detail {

/// Appends little-endian fields (the library targets little-endian CPUs).
class ByteWriter {
 public:
  explicit ByteWriter(std::vector<std::uint8_t>& out) : out_(out) {}
  template <class T>
  void put(T x) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::uint8_t*>(&x);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_array(const T* x, std::size_t n) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(x);
    out_.insert(out_.end(), p, p + n * sizeof(T));
  }
  void put_string(std::string_view s) {
    put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    put_array(s.data(), s.size());
  }

 private:
  std::vector<std::uint8_t>& out_;
};

/// Bounds-checked reader: every read names what it was reading when the input ends.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::uint8_t> in) : in_(in) {}
  template <class T>
  T get(const char* what) {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), what);
    T x;
    std::memcpy(&x, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return x;
  }
  template <class T>
  void get_array(T* out, std::size_t n, const char* what) {
    need_elems(n, sizeof(T), what);
    if (n) std::memcpy(static_cast<void*>(out), in_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
  }
  std::string get_string(const char* what, std::size_t max_len) {
    const auto n = get<std::uint32_t>(what);
    require(n <= max_len, "saved state: ", what, " has length ", n, ", expected <= ", max_len);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(in_.data() + at_), n);
    at_ += n;
    return s;
  }
  std::span<const std::uint8_t> get_bytes(std::size_t n, const char* what) {
    need(n, what);
    auto s = in_.subspan(at_, n);
    at_ += n;
    return s;
  }
  /// Fails unless `n` items of `size` bytes remain (checked before allocating for them).
  void need_elems(std::uint64_t n, std::size_t size, const char* what) const {
    require(size == 0 || n <= remaining() / size, "saved state: truncated or corrupt at byte ",
            at_, " reading ", what, " (", n, " x ", size, " bytes, ", remaining(), " left)");
  }
  [[nodiscard]] std::size_t remaining() const { return in_.size() - at_; }
  [[nodiscard]] std::size_t offset() const { return at_; }

 private:
  void need(std::size_t n, const char* what) const { need_elems(n, 1, what); }
  std::span<const std::uint8_t> in_;
  std::size_t at_ = 0;
};

}  // namespace kvevict::detail
