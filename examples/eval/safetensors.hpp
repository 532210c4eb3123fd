#pragma once
// A strict safetensors reader (and a small writer) for kvevict-eval traces.
// Format: 8-byte little-endian header length N, N bytes of JSON header
//   {"name": {"dtype": "F32"|"F16"|"BF16", "shape": [...], "data_offsets": [b, e]}, ...,
//    "__metadata__": {"key": "value", ...}}
// then the raw little-endian tensor bytes; offsets are relative to the end of the header.
// Every malformed input throws kvevict::Error naming the file, the tensor and the value.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <kvevict/errors.hpp>
#include <kvevict/file.hpp>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../common/dtype.hpp"
#include "workloads.hpp"

namespace kvevict::eval {

// --- the JSON header: nlohmann::json, with the format's strictness checked around it ----
namespace json {

using Value = nlohmann::ordered_json;  // keeps the file's key order

inline constexpr int kMaxDepth = 64;  ///< nesting deeper than this is rejected
/// Largest integer accepted for a shape entry or offset (19 decimal digits; a data section
/// that large cannot exist, and the bound keeps byte arithmetic far from wrapping).
inline constexpr std::uint64_t kMaxInteger = 9'999'999'999'999'999'999ull;

/// nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1,
/// column 7: " preamble (the byte offset is reported separately).
inline std::string library_message(const char* what) {
  std::string_view m(what);
  if (!m.empty() && m.front() == '[') m.remove_prefix(std::min(m.size(), m.find("] ") + 2));
  if (m.starts_with("parse error") && m.find(": ") != std::string_view::npos)
    m.remove_prefix(m.find(": ") + 2);
  return std::string(m);
}

/// Parses one JSON document (RFC 8259, UTF-8, no comments) and rejects what the library
/// would accept but the format forbids: duplicate keys in an object, nesting deeper than
/// kMaxDepth, a byte-order mark, a NUL byte (nlohmann's lexer reads NUL as the end of
/// input, which would let bytes after it pass unread). Every failure is a kvevict::Error
/// naming `where`; `what` names the document in the message ("bad <what> at byte ..."):
/// a safetensors file's header by default, "JSON" for a file that is JSON throughout
/// (config.json, tokenizer.json).
inline Value parse(std::string_view text, const std::string& where,
                   std::string_view what = "JSON header") {
  if (text.starts_with("\xEF\xBB\xBF"))
    kvevict::detail::fail(where, ": bad ", what, ": starts with a UTF-8 byte-order mark");
  if (const auto nul = text.find('\0'); nul != std::string_view::npos)
    kvevict::detail::fail(where, ": bad ", what, " at byte ", nul,
                          ": NUL byte (JSON allows none, escaped or not)");
  std::vector<std::set<std::string>> keys;  // the keys seen so far, one set per open object
  const Value::parser_callback_t check = [&](int depth, Value::parse_event_t event,
                                             Value& parsed) {
    using E = Value::parse_event_t;
    if ((event == E::object_start || event == E::array_start || event == E::value) &&
        depth > kMaxDepth)
      kvevict::detail::fail(where, ": bad ", what, ": nesting deeper than ", kMaxDepth);
    if (event == E::object_start) keys.emplace_back();
    if (event == E::object_end) keys.pop_back();
    if (event == E::key && !keys.back().insert(parsed.get<std::string>()).second)
      kvevict::detail::fail(where, ": bad ", what, ": duplicate key \"",
                            parsed.get<std::string>(), "\"");
    return true;
  };
  try {
    return Value::parse(text.begin(), text.end(), check, /*allow_exceptions=*/true,
                        /*ignore_comments=*/false);
  } catch (const nlohmann::json::parse_error& e) {
    kvevict::detail::fail(where, ": bad ", what, " at byte ", e.byte, ": ",
                          library_message(e.what()));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for a double
    kvevict::detail::fail(where, ": bad ", what, ": ", library_message(e.what()));
  }
}

/// The value as an exact non-negative integer (no sign, fraction or exponent in the text).
inline std::optional<std::uint64_t> exact_size(const Value& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const auto n = v.get<std::uint64_t>();
  if (n > kMaxInteger) return std::nullopt;
  return n;
}

}  // namespace json

// --- safetensors --------------------------------------------------------------------------

// DType and the 16-bit conversions live in examples/common/dtype.hpp (shared with the
// model readers); the names stay available here.
using tensor::bf16_to_float;
using tensor::DType;
using tensor::dtype_name;
using tensor::dtype_size;
using tensor::float_to_bf16;
using tensor::float_to_half;
using tensor::half_to_float;

struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;  ///< byte offsets within the data section
  [[nodiscard]] std::size_t elements() const {
    std::size_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

/// A whole safetensors file held in memory, header validated on open.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path) {
    return from_bytes(kvevict::detail::read_file(path, "safetensors"), path);
  }

  /// Memory-maps the file read-only instead of reading it (model weights: pages are read
  /// on first use and shared with the page cache). Same checks as open().
  static SafetensorsFile open_mapped(const std::string& path) {
    auto m = std::make_shared<const Mapping>(path);
    const char* base = m->data;
    const std::size_t size = m->size;
    return from_view(base, size, std::move(m), path);
  }

  static SafetensorsFile from_bytes(std::vector<char> bytes, const std::string& path) {
    auto owned = std::make_shared<const std::vector<char>>(std::move(bytes));
    const char* base = owned->data();
    const std::size_t size = owned->size();
    return from_view(base, size, std::move(owned), path);
  }

  /// The raw bytes of a tensor's data (little-endian, tensor.dtype elements); valid while
  /// this file (or a copy of it) lives.
  [[nodiscard]] const char* data(const TensorInfo& t) const { return base_ + data_ + t.begin; }

 private:
  /// A read-only private mapping of a whole file, unmapped on destruction.
  struct Mapping {
    const char* data = nullptr;
    std::size_t size = 0;
    explicit Mapping(const std::string& path) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        kvevict::detail::fail("safetensors '", path, "': cannot open (", std::strerror(errno), ")");
      struct stat st {};
      if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        kvevict::detail::fail("safetensors '", path, "': not a regular file, expected a file");
      }
      size = static_cast<std::size_t>(st.st_size);
      if (size > 0) {
        void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
          const int err = errno;
          ::close(fd);
          kvevict::detail::fail("safetensors '", path, "': mmap of ", size, " bytes failed (",
                                std::strerror(err), ")");
        }
        data = static_cast<const char*>(p);
      } else {
        data = "";
      }
      ::close(fd);
    }
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() {
      if (size > 0) ::munmap(const_cast<char*>(data), size);
    }
  };

  static SafetensorsFile from_view(const char* base, std::size_t size,
                                   std::shared_ptr<const void> keep, const std::string& path) {
    SafetensorsFile sf;
    sf.path_ = path;
    sf.keep_ = std::move(keep);
    sf.base_ = base;
    sf.size_ = size;
    kvevict::detail::require(size >= 8, "safetensors '", path, "': file has ", size,
                             " bytes, expected at least 8 (the header length)");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i)
      n = (n << 8) | static_cast<unsigned char>(sf.base_[i]);
    kvevict::detail::require(n >= 2 && n <= size - 8, "safetensors '", path, "': header length ", n,
                             " bytes, expected between 2 and ", size - 8,
                             " (the bytes after the 8-byte length)");
    kvevict::detail::require(n <= (std::uint64_t{100} << 20), "safetensors '", path,
                             "': header length ", n, " bytes, expected at most 100 MiB");
    sf.data_ = 8 + static_cast<std::size_t>(n);
    const json::Value root =
        json::parse(std::string_view(sf.base_ + 8, static_cast<std::size_t>(n)),
                    "safetensors '" + path + "'");
    kvevict::detail::require(root.is_object(), "safetensors '", path,
                             "': header is not a JSON object");
    const std::size_t data_size = size - sf.data_;
    for (const auto& [name, v] : root.items()) {
      if (name == "__metadata__") {
        kvevict::detail::require(v.is_object(), "safetensors '", path,
                                 "': __metadata__ is not an object of strings");
        for (const auto& [k, s] : v.items()) {
          kvevict::detail::require(s.is_string(), "safetensors '", path, "': __metadata__.", k,
                                   " is not a string");
          sf.metadata_[k] = s.get<std::string>();
        }
        continue;
      }
      sf.tensors_.push_back(parse_tensor(name, v, path, data_size));
    }
    // Tensors may not overlap (the format forbids it; overlap means a corrupt header).
    std::vector<std::pair<std::size_t, std::size_t>> spans;
    for (const auto& t : sf.tensors_)
      if (t.end > t.begin) spans.push_back({t.begin, t.end});
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i)
      kvevict::detail::require(spans[i].first >= spans[i - 1].second, "safetensors '", path,
                               "': tensors overlap at data byte ", spans[i].first);
    return sf;
  }

 public:
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return metadata_; }
  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] const TensorInfo* find(const std::string& name) const {
    for (const auto& t : tensors_)
      if (t.name == name) return &t;
    return nullptr;
  }

  /// The tensor's elements widened to float (little-endian on disk, any host).
  [[nodiscard]] std::vector<float> read(const TensorInfo& t) const {
    const auto* p = reinterpret_cast<const unsigned char*>(data(t));
    std::vector<float> out(t.elements());
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (t.dtype == DType::f32) {
        const std::uint32_t b = std::uint32_t(p[4 * i]) | std::uint32_t(p[4 * i + 1]) << 8 |
                                std::uint32_t(p[4 * i + 2]) << 16 |
                                std::uint32_t(p[4 * i + 3]) << 24;
        std::memcpy(&out[i], &b, 4);
      } else {
        const auto h = static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
        out[i] = t.dtype == DType::f16 ? half_to_float(h) : bf16_to_float(h);
      }
    }
    return out;
  }

 private:
  static std::size_t to_size(const json::Value& v, const std::string& what,
                             const std::string& path) {
    const auto n = json::exact_size(v);
    kvevict::detail::require(n.has_value(), "safetensors '", path, "': ", what,
                             " is not a non-negative integer (at most ", json::kMaxInteger, ")");
    return static_cast<std::size_t>(*n);
  }

  static TensorInfo parse_tensor(const std::string& name, const json::Value& v,
                                 const std::string& path, std::size_t data_size) {
    const std::string where = "tensor '" + name + "'";
    kvevict::detail::require(v.is_object(), "safetensors '", path, "': ", where,
                             " is not an object");
    TensorInfo t;
    t.name = name;
    const json::Value *dt = nullptr, *sh = nullptr, *off = nullptr;
    for (const auto& [k, x] : v.items()) {
      if (k == "dtype")
        dt = &x;
      else if (k == "shape")
        sh = &x;
      else if (k == "data_offsets")
        off = &x;
      else
        kvevict::detail::fail("safetensors '", path, "': ", where, " has unknown field '", k, "'");
    }
    kvevict::detail::require(dt && sh && off, "safetensors '", path, "': ", where,
                             " needs dtype, shape and data_offsets");
    kvevict::detail::require(dt->is_string(), "safetensors '", path, "': ", where,
                             " dtype is not a string");
    const auto d = dt->get<std::string>();
    if (d == "F32")
      t.dtype = DType::f32;
    else if (d == "F16")
      t.dtype = DType::f16;
    else if (d == "BF16")
      t.dtype = DType::bf16;
    else
      kvevict::detail::fail("safetensors '", path, "': ", where, " has dtype ", d,
                            ", expected F32, F16 or BF16");
    kvevict::detail::require(sh->is_array(), "safetensors '", path, "': ", where,
                             " shape is not an array");
    for (const auto& x : *sh)
      t.shape.push_back(to_size(x, where + " shape entry", path));
    std::size_t bytes = dtype_size(t.dtype);
    if (std::find(t.shape.begin(), t.shape.end(), std::size_t{0}) != t.shape.end()) bytes = 0;
    for (std::size_t s : t.shape)
      if (bytes != 0)
        kvevict::detail::require(!__builtin_mul_overflow(bytes, s, &bytes), "safetensors '", path,
                                 "': ", where, " shape overflows a 64-bit byte count");
    kvevict::detail::require(off->is_array() && off->size() == 2,
                             "safetensors '", path, "': ", where,
                             " data_offsets is not a [begin, end] pair");
    const auto& o = *off;
    t.begin = to_size(o[0], where + " data_offsets[0]", path);
    t.end = to_size(o[1], where + " data_offsets[1]", path);
    kvevict::detail::require(t.begin <= t.end && t.end <= data_size, "safetensors '", path,
                             "': ", where, " data_offsets [", t.begin, ", ", t.end,
                             "] out of range, expected begin <= end <= ", data_size,
                             " (the data section's size)");
    kvevict::detail::require(t.end - t.begin == bytes, "safetensors '", path, "': ", where, " has ",
                             t.end - t.begin, " bytes of data, expected ", bytes, " (",
                             dtype_name(t.dtype), " x ", t.elements(), " elements of its shape)");
    return t;
  }

  std::string path_;
  std::shared_ptr<const void> keep_;  ///< owns the bytes (a vector or a Mapping)
  const char* base_ = nullptr;
  std::size_t size_ = 0;
  std::size_t data_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// A tensor to write: float data stored as `dtype`.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::f32;
  std::vector<std::size_t> shape;
  std::vector<float> data;
};

/// Writes a safetensors file (header padded with spaces to a multiple of 8 bytes).
inline void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  json::Value root = json::Value::object();
  std::string body;
  if (!metadata.empty()) root["__metadata__"] = metadata;
  for (const auto& t : tensors) {
    std::size_t n = 1;
    for (auto s : t.shape) n *= s;
    kvevict::detail::require(n == t.data.size(), "write_safetensors: tensor '", t.name, "' has ",
                             t.data.size(), " values, expected ", n, " from its shape");
    const std::size_t begin = body.size();
    for (float x : t.data) {
      if (t.dtype == DType::f32) {
        std::uint32_t b;
        std::memcpy(&b, &x, 4);
        for (int i = 0; i < 4; ++i) body += static_cast<char>((b >> (8 * i)) & 0xFF);
      } else {
        const std::uint16_t h = t.dtype == DType::f16 ? float_to_half(x) : float_to_bf16(x);
        body += static_cast<char>(h & 0xFF);
        body += static_cast<char>(h >> 8);
      }
    }
    root[t.name] = {{"dtype", dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {begin, body.size()}}};
  }
  std::string header = root.dump();
  while (header.size() % 8 != 0) header += ' ';
  std::ofstream f(path, std::ios::binary);
  kvevict::detail::require(static_cast<bool>(f), "write_safetensors: cannot write '", path, "'");
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  f << header << body;
  kvevict::detail::require(static_cast<bool>(f), "write_safetensors: write to '", path, "' failed");
}

struct TraceOptions {
  std::optional<std::size_t> prompt;  ///< default: metadata "prompt_tokens", else 25% of T
  std::optional<std::size_t> steps;   ///< decode steps kept (default: all after the prompt)
};

/// Reads a trace: for each layer l = 0, 1, ... tensors "layers.<l>.q" [T, H, d],
/// "layers.<l>.k" [T, Hkv, d] and "layers.<l>.v" [T, Hkv, d] (post-RoPE, as attention
/// sees them). Layers are counted from 0 until "layers.<l>.q" is missing.
inline Workload load_trace(const std::string& path, const TraceOptions& options = {}) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  Workload w;
  w.name = "trace";
  w.description = "trace " + path;
  auto need = [&](int l, const char* which) -> const TensorInfo& {
    const std::string name = "layers." + std::to_string(l) + "." + which;
    const TensorInfo* t = f.find(name);
    kvevict::detail::require(t != nullptr, "trace '", path, "': tensor '", name,
                             "' is missing (layer ", l, " has a q tensor, so it needs q, k, v)");
    kvevict::detail::require(t->shape.size() == 3, "trace '", path, "': tensor '", name, "' has ",
                             t->shape.size(), " dimensions, expected 3 ([T, heads, head_dim])");
    return *t;
  };
  int layers = 0;
  while (f.find("layers." + std::to_string(layers) + ".q") != nullptr) ++layers;
  kvevict::detail::require(layers > 0, "trace '", path,
                           "': no tensor 'layers.0.q', expected layers.<l>.q/k/v (docs/traces.md)");
  std::size_t T = 0;
  for (int l = 0; l < layers; ++l) {
    const auto& q = need(l, "q");
    const auto& k = need(l, "k");
    const auto& v = need(l, "v");
    if (l == 0) {
      T = q.shape[0];
      w.geometry = Geometry{layers, static_cast<int>(q.shape[1]), static_cast<int>(k.shape[1]),
                            static_cast<int>(q.shape[2])};
    }
    const std::vector<std::size_t> qs{T, std::size_t(w.geometry.n_heads),
                                      std::size_t(w.geometry.head_dim)};
    const std::vector<std::size_t> ks{T, std::size_t(w.geometry.n_kv_heads),
                                      std::size_t(w.geometry.head_dim)};
    auto shape_str = [](const std::vector<std::size_t>& s) {
      std::string o = "[";
      for (std::size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
      return o + "]";
    };
    for (const auto* t : {&q, &k, &v}) {
      const auto& expect = t == &q ? qs : ks;
      kvevict::detail::require(t->shape == expect, "trace '", path, "': tensor '", t->name,
                               "' has shape ", shape_str(t->shape), ", expected ",
                               shape_str(expect),
                               " (layer 0 sets T, heads, kv heads and head_dim)");
    }
  }
  w.geometry.n_layers = layers;
  kvevict::detail::require(
      w.geometry.n_kv_heads > 0 && w.geometry.n_heads % w.geometry.n_kv_heads == 0, "trace '", path,
      "': ", w.geometry.n_heads, " query heads is not a multiple of ", w.geometry.n_kv_heads,
      " KV heads");
  w.geometry.validate();
  std::size_t prompt = T / 4;
  if (auto it = f.metadata().find("prompt_tokens"); it != f.metadata().end()) {
    const auto& s = it->second;
    kvevict::detail::require(
        !s.empty() && s.size() < 19 &&
            std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }),
        "trace '", path, "': metadata prompt_tokens = '", s, "', expected an integer");
    prompt = std::stoull(s);
  }
  if (options.prompt) prompt = *options.prompt;
  kvevict::detail::require(prompt < T, "trace '", path, "': prompt = ", prompt,
                           " tokens, expected < T = ", T, " (at least one decode step)");
  std::size_t tokens = T;
  if (options.steps) tokens = std::min(T, prompt + *options.steps);
  w.tokens = tokens;
  w.prompt = prompt;
  const std::size_t d = static_cast<std::size_t>(w.geometry.head_dim);
  for (int l = 0; l < layers; ++l) {
    LayerTrace lt;
    lt.q = f.read(need(l, "q"));
    lt.k = f.read(need(l, "k"));
    lt.v = f.read(need(l, "v"));
    lt.q.resize(tokens * static_cast<std::size_t>(w.geometry.n_heads) * d);
    lt.k.resize(tokens * static_cast<std::size_t>(w.geometry.n_kv_heads) * d);
    lt.v.resize(lt.k.size());
    for (const auto* vec : {&lt.q, &lt.k, &lt.v})
      for (float x : *vec)
        kvevict::detail::require(std::isfinite(x), "trace '", path, "': layer ", l,
                                 " holds a NaN or infinite value");
    w.layers.push_back(std::move(lt));
  }
  w.validate();
  return w;
}

}  // namespace kvevict::eval
