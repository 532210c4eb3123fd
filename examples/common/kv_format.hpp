#pragma once
// The K/V storage formats the example programs run a KVCache with, by name (kvevict-eval
// --kv-format): float, the 16-bit types and the quantized formats of
// include/kvevict/quantized.hpp (docs/quantized.md). A program picks a format by name at
// run time and gets the storage type handed to a generic lambda:
//
//   kvevict::registry::with_kv_format("q8g8", [&]<class Scalar>() { ... KVCache<P, Scalar> ... });
//
// Each format listed here is one more instantiation of every cache a program runs with
// it, so the list holds what the memory/quality frontier (docs/quality.md) measures, not
// every group size: stories260K's head_dim 8 takes groups 1, 2, 4 or 8 (Q4: 2, 4, 8).
#include <Eigen/Core>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "kvevict/cache.hpp"
#include "kvevict/errors.hpp"
#include "kvevict/geometry.hpp"
#include "kvevict/policies/full_cache.hpp"
#include "kvevict/quantized.hpp"

namespace kvevict::registry {

struct KvFormatInfo {
  const char* name;
  const char* help;
};

/// The K/V split formats under one name each (a type with a comma cannot be a macro argument).
using K8V4 = KV<Q8<8>, Q4<8>>;
using K4V8 = KV<Q4<8>, Q8<8>>;
/// Mixed layouts (kvevict/mixed.hpp): a recent band of fp16 rows (--hot-rows R per head),
/// older rows in Q8<8> or k8v4.
using MixF16Q8 = Mixed<Eigen::half, Q8<8>>;
using MixF16K8V4 = Mixed<Eigen::half, K8V4>;

/// The one list of formats: X(type, name, help) per format, fp32 first. Programs that
/// compile the formats' engines in separate translation units (examples/eval/
/// model_formats.hpp) expand it to declare and define their instantiations.
#define KVEVICT_KV_FORMATS(X)                                                                   \
  X(float, "fp32", "float, 4 bytes per element (the reference)")                               \
  X(Eigen::half, "fp16", "IEEE half, 2 bytes per element")                                     \
  X(Eigen::bfloat16, "bf16", "bfloat16, 2 bytes per element")                                  \
  X(::kvevict::Q8<8>, "q8g8", "Q8<8>: int8, an fp16 scale per 8 elements (1.25 bytes/element)") \
  X(::kvevict::Q4<8>, "q4g8", "Q4<8>: 4-bit, an fp16 scale per 8 elements (0.75 bytes/element)") \
  X(::kvevict::Q4<4>, "q4g4", "Q4<4>: 4-bit, an fp16 scale per 4 elements (1 byte/element)")    \
  X(::kvevict::E4M3, "e4m3", "fp8 E4M3, 1 byte per element, no scale")                          \
  X(::kvevict::registry::K8V4, "k8v4",                                                          \
    "keys Q8<8>, values Q4<8> (a KIVI-style split, per-token scales; 1 byte/element)")          \
  X(::kvevict::registry::K4V8, "k4v8", "keys Q4<8>, values Q8<8> (the opposite split, a control)") \
  X(::kvevict::registry::MixF16Q8, "f16+q8g8",                                                   \
    "mixed: the --hot-rows most recent rows per head fp16, older rows Q8<8>")                     \
  X(::kvevict::registry::MixF16K8V4, "f16+k8v4",                                                 \
    "mixed: the --hot-rows most recent rows per head fp16, older rows k8v4")

/// Calls fn.template operator()<Scalar>(info) for every format, fp32 first.
template <class Fn>
void for_each_kv_format(Fn&& fn) {
#define KVEVICT_KV_FORMAT_CALL(T, name, help) fn.template operator()<T>(KvFormatInfo{name, help});
  KVEVICT_KV_FORMATS(KVEVICT_KV_FORMAT_CALL)
#undef KVEVICT_KV_FORMAT_CALL
}

/// The format names, comma-separated.
inline std::string kv_format_names() {
  std::string out;
  for_each_kv_format([&]<class S>(const KvFormatInfo& i) {
    out += fmt::format("{}{}", out.empty() ? "" : ", ", i.name);
  });
  return out;
}

/// Whether `name` is a format of for_each_kv_format.
inline bool is_kv_format(std::string_view name) {
  bool found = false;
  for_each_kv_format([&]<class S>(const KvFormatInfo& i) { found = found || name == i.name; });
  return found;
}

/// Calls fn.template operator()<Scalar>() for the format called `name` (fn returns void);
/// an unknown name is a kvevict::Error naming it and the known ones.
template <class Fn>
void with_kv_format(std::string_view name, Fn&& fn) {
  bool found = false;
  for_each_kv_format([&]<class S>(const KvFormatInfo& i) {
    if (found || name != i.name) return;
    found = true;
    fn.template operator()<S>();
  });
  if (!found) kvevict::detail::fail("K/V format '", name, "', expected one of: ", kv_format_names());
}

/// Bytes `rows` cached tokens take per (layer, KV head): rows x kv_row_bytes, or for a mixed
/// format min(rows, hot_rows) fp16 rows + the rest in the cold format.
inline std::size_t kv_head_bytes(std::string_view name, int head_dim, std::size_t rows,
                                 std::size_t hot_rows) {
  std::size_t bytes = 0;
  with_kv_format(name, [&]<class S>() {
    const KVCache<policies::FullCache, S> probe(Geometry{1, 1, 1, head_dim}, Budget::unbounded());
    if constexpr (KVCache<policies::FullCache, S>::mixed) {
      const std::size_t h = std::min(rows, hot_rows);
      bytes = h * probe.hot_row_bytes() + (rows - h) * probe.cold_row_bytes();
    } else {
      bytes = rows * (probe.key_row_bytes() + probe.value_row_bytes());
    }
  });
  return bytes;
}

/// Bytes one cached token takes per (layer, KV head) in `name` at `head_dim`: its key row
/// plus its value row as KVCache stores them (key_row_bytes() + value_row_bytes(), scales
/// included; positions and arrival indices not counted); for a mixed format, an older
/// (cold) row. A group size that does not divide head_dim is the cache's kvevict::Error.
inline std::size_t kv_row_bytes(std::string_view name, int head_dim) {
  return kv_head_bytes(name, head_dim, 1, 0);
}

/// The list for --help: name and description.
inline std::string kv_format_listing() {
  std::string out;
  for_each_kv_format([&]<class S>(const KvFormatInfo& i) {
    out += fmt::format("  {:<6} {}\n", i.name, i.help);
  });
  return out;
}

}  // namespace kvevict::registry
