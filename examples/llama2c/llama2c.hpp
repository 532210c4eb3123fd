#pragma once
// A small Llama inference engine for llama2.c checkpoints (legacy version-0 format) whose
// K/V live in one kvevict::KVCache<Policy>: the example an engine author copies from.
// Numerics follow llama2.c's run.c (RMSNorm eps 1e-5, RoPE over adjacent pairs, SwiGLU),
// so a full cache reproduces llama2.c's greedy output token for token.
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvevict/attention.hpp"
#include "kvevict/cache.hpp"
#include "kvevict/errors.hpp"
#include "kvevict/file.hpp"
#include "kvevict/geometry.hpp"
#include "weights.hpp"

namespace kvevict::llama2c {

/// Which components of a head RoPE rotates together.
enum class RopeStyle {
  interleaved,  ///< llama2.c / Meta's original: adjacent pairs (2i, 2i + 1)
  half,         ///< Hugging Face's rotate_half: pairs (i, i + head_dim / 2)
};

/// RoPE frequency scaling (Hugging Face's rope_scaling).
struct RopeScaling {
  enum class Kind { none, linear, llama3 } kind = Kind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;                     ///< llama3
  double high_freq_factor = 4.0;                    ///< llama3
  double original_max_position_embeddings = 8192.0;  ///< llama3

  friend bool operator==(const RopeScaling&, const RopeScaling&) = default;
};

/// The model's shape and the settings of its forward pass. llama2.c checkpoints fill the
/// seven int32 header fields (vocab_size made positive) and keep the other defaults;
/// the Hugging Face reader (hf.hpp) fills everything from config.json.
struct Config {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;
  bool shared_classifier = true;  ///< logits reuse the embedding (tied)
  int head_size = 0;              ///< explicit head dimension; 0: dim / n_heads
  float norm_eps = 1e-5f;         ///< RMSNorm epsilon
  double rope_theta = 10000.0;
  RopeStyle rope = RopeStyle::interleaved;
  RopeScaling rope_scaling;
  int bos_token = 1;  ///< the first token of a sampled stream

  [[nodiscard]] int head_dim() const { return head_size > 0 ? head_size : dim / n_heads; }
  [[nodiscard]] int q_dim() const { return n_heads * head_dim(); }
  [[nodiscard]] int kv_dim() const { return n_kv_heads * head_dim(); }
  [[nodiscard]] Geometry geometry() const { return {n_layers, n_heads, n_kv_heads, head_dim()}; }
};

/// RoPE's per-pair frequencies theta_i (head_dim / 2 of them). llama2.c's form for
/// interleaved RoPE (float: 10000^(-2i / head_dim), bit for bit what the engine always
/// computed); Hugging Face's in double for rotate_half, with its linear (every frequency
/// divided by factor) and llama3 (low frequencies divided by factor, high ones kept, a
/// smooth blend between) scalings.
inline std::vector<float> rope_frequencies(const Config& c) {
  const int hd = c.head_dim();
  std::vector<float> f;
  if (c.rope == RopeStyle::interleaved && c.rope_scaling.kind == RopeScaling::Kind::none) {
    const float theta = static_cast<float>(c.rope_theta);
    for (int i = 0; i < hd; i += 2)
      f.push_back(1.0f / std::pow(theta, static_cast<float>(i) / static_cast<float>(hd)));
    return f;
  }
  const RopeScaling& s = c.rope_scaling;
  constexpr double kPi = 3.14159265358979323846;
  for (int i = 0; i < hd; i += 2) {
    double inv = 1.0 / std::pow(c.rope_theta, static_cast<double>(i) / static_cast<double>(hd));
    if (s.kind == RopeScaling::Kind::linear) {
      inv /= s.factor;
    } else if (s.kind == RopeScaling::Kind::llama3) {
      const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
      const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
      const double wavelen = 2.0 * kPi / inv;
      if (wavelen > low_wavelen) {
        inv /= s.factor;
      } else if (wavelen >= high_wavelen) {  // medium: blend
        const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        inv = (1.0 - smooth) * inv / s.factor + smooth * inv;
      }
    }
    f.push_back(static_cast<float>(inv));
  }
  return f;
}

namespace detail {
using kvevict::detail::fail;
using kvevict::detail::require;

using kvevict::detail::read_file;  // names the path for a directory, missing file, failed read

// Products of header fields, checked so a corrupt header cannot wrap around.
inline std::uint64_t mul(std::uint64_t a, std::uint64_t b, const char* where) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    fail("checkpoint: ", where, " overflows 64 bits (corrupt header?)");
  return r;
}

template <class T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
}  // namespace detail

/// Floats in a version-0 checkpoint after its 28-byte header, in llama2.c's order.
inline std::uint64_t expected_floats(const Config& c) {
  using detail::mul;
  const std::uint64_t dim = static_cast<std::uint64_t>(c.dim);
  const std::uint64_t hid = static_cast<std::uint64_t>(c.hidden_dim);
  const std::uint64_t L = static_cast<std::uint64_t>(c.n_layers);
  const std::uint64_t hd = static_cast<std::uint64_t>(c.head_dim());
  const std::uint64_t kv = static_cast<std::uint64_t>(c.kv_dim());
  const std::uint64_t V = static_cast<std::uint64_t>(c.vocab_size);
  std::uint64_t n = mul(V, dim, "vocab_size x dim");                          // token_embedding
  n += mul(L, dim, "layers x dim");                                           // rms_att
  n += mul(mul(L, dim, "wq"), dim, "wq");                                     // wq
  n += 2 * mul(mul(L, dim, "wk"), kv, "wk");                                  // wk, wv
  n += mul(mul(L, dim, "wo"), dim, "wo");                                     // wo
  n += mul(L, dim, "layers x dim");                                           // rms_ffn
  n += 3 * mul(mul(L, dim, "ffn"), hid, "layers x dim x hidden_dim");         // w1, w2, w3
  n += dim;                                                                   // rms_final
  n += mul(static_cast<std::uint64_t>(c.seq_len), hd, "seq_len x head_dim");  // freq_cis (unused)
  if (!c.shared_classifier) n += mul(V, dim, "wcls");
  return n;
}

/// A loaded model: its config and views of every weight in its stored type (row-major
/// matrices, out x in). The llama2.c reader owns one float buffer; the Hugging Face reader
/// (hf.hpp) keeps its memory-mapped safetensors files alive. Move-only (views point into
/// what the model owns).
class Model {
 public:
  using Vector = Eigen::Map<const Eigen::VectorXf>;

  /// One layer's weights. Norm weights and biases are float (widened on load); the
  /// optional ones (biases, Qwen3's per-head q/k norms) are nullptr when absent.
  struct Layer {
    Weight wq, wk, wv, wo, w1, w2, w3;  // w1 = gate, w3 = up, w2 = down
    const float* rms_att = nullptr;
    const float* rms_ffn = nullptr;
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;
    const float *q_norm = nullptr, *k_norm = nullptr;  ///< head_dim floats each
  };

  Model() = default;
  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  /// Parses a version-0 checkpoint held in memory; `name` is used in error messages.
  static Model parse(std::vector<char> bytes, const std::string& name = "checkpoint") {
    using detail::require;
    constexpr std::size_t kHeader = 7 * sizeof(std::int32_t);
    require(bytes.size() >= kHeader, "checkpoint '", name, "': ", bytes.size(),
            " bytes, expected at least ", kHeader, " (the seven int32 header fields)");
    std::int32_t h[7];
    for (int i = 0; i < 7; ++i) h[i] = detail::load<std::int32_t>(bytes.data() + 4 * i);
    // llama2.c's newer exports (version 1 and 2) start with the magic "ak42".
    require(static_cast<std::uint32_t>(h[0]) != 0x616b3432u, "checkpoint '", name,
            "': starts with magic 0x616b3432 (a llama2.c version-1/2 export), expected the "
            "legacy version-0 format (export with --version 0)");
    Config c;
    c.dim = h[0];
    c.hidden_dim = h[1];
    c.n_layers = h[2];
    c.n_heads = h[3];
    c.n_kv_heads = h[4];
    c.shared_classifier = h[5] > 0;
    c.seq_len = h[6];
    auto field = [&](const char* what, std::int64_t v, std::int64_t hi) {
      require(v > 0 && v <= hi, "checkpoint '", name, "': header ", what, " = ", v,
              ", expected 1..", hi, " (corrupt or not a llama2.c checkpoint)");
    };
    constexpr std::int64_t kMax = 1 << 20;  // far above any llama2.c model, far below overflow
    field("dim", c.dim, kMax);
    field("hidden_dim", c.hidden_dim, kMax);
    field("n_layers", c.n_layers, 4096);
    field("n_heads", c.n_heads, 4096);
    field("n_kv_heads", c.n_kv_heads, 4096);
    require(h[5] != 0 && h[5] != std::numeric_limits<std::int32_t>::min(), "checkpoint '", name,
            "': header vocab_size = ", h[5],
            ", expected non-zero (negative = unshared classifier)");
    c.vocab_size = h[5] > 0 ? h[5] : -h[5];
    field("|vocab_size|", c.vocab_size, kMax);
    field("seq_len", c.seq_len, kMax);
    require(c.dim % c.n_heads == 0, "checkpoint '", name, "': dim = ", c.dim,
            " is not a multiple of n_heads = ", c.n_heads);
    require(c.n_heads % c.n_kv_heads == 0, "checkpoint '", name, "': n_heads = ", c.n_heads,
            " is not a multiple of n_kv_heads = ", c.n_kv_heads);
    require(c.head_dim() % 2 == 0, "checkpoint '", name,
            "': head_dim = dim / n_heads = ", c.head_dim(), ", expected even (RoPE rotates pairs)");
    const std::uint64_t floats = expected_floats(c);
    const std::uint64_t want = kHeader + detail::mul(floats, 4, "weight bytes");
    require(bytes.size() == want, "checkpoint '", name, "': ", bytes.size(), " bytes, expected ",
            want, " for dim ", c.dim, ", hidden_dim ", c.hidden_dim, ", n_layers ", c.n_layers,
            ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads, ", vocab_size ", h[5],
            ", seq_len ", c.seq_len,
            bytes.size() < want ? " (file truncated?)" : " (trailing bytes: wrong header?)");
    Model m;
    m.config_ = c;
    std::vector<float> w(static_cast<std::size_t>(floats));
    std::memcpy(w.data(), bytes.data() + kHeader, static_cast<std::size_t>(floats) * 4);
    for (std::size_t i = 0; i < w.size(); ++i)
      require(std::isfinite(w[i]), "checkpoint '", name, "': weight float ", i, " = ", w[i],
              ", expected finite (corrupt file?)");
    m.layout_llama2c(m.own(std::move(w)));
    return m;
  }

  /// Reads and validates a version-0 checkpoint file.
  static Model load(const std::string& path) {
    return parse(detail::read_file(path, "checkpoint"), path);
  }

  [[nodiscard]] const Config& config() const { return config_; }
  [[nodiscard]] const Weight& token_embedding() const { return emb_; }
  [[nodiscard]] const Layer& layer(int l) const { return layers_[static_cast<std::size_t>(l)]; }
  [[nodiscard]] Vector rms_final() const { return Vector(rms_final_, config_.dim); }
  [[nodiscard]] const Weight& classifier() const { return cls_; }
  /// logits = classifier x hidden (dim floats in, vocab out): the forward pass's last
  /// product, the same code, so the same floats as forward() gave for that hidden state.
  void classify(Eigen::VectorXf& logits, const Eigen::VectorXf& hidden,
                std::vector<float>& scratch) const {
    cls_.matvec(logits, hidden, scratch);
  }

  /// What the Hugging Face reader uses to assemble a model (hf.hpp).
  struct Parts {
    Config config;
    Weight emb, cls;
    const float* rms_final = nullptr;
    std::vector<Layer> layers;
    std::vector<std::vector<float>> owned;           ///< buffers the views point into
    std::vector<std::shared_ptr<const void>> keep;  ///< e.g. the mapped files
  };
  static Model assemble(Parts p) {
    Model m;
    m.config_ = p.config;
    m.emb_ = p.emb;
    m.cls_ = p.cls;
    m.rms_final_ = p.rms_final;
    m.layers_ = std::move(p.layers);
    m.owned_ = std::move(p.owned);  // moving the vectors keeps their buffers in place
    m.keep_ = std::move(p.keep);
    return m;
  }

 private:
  const float* own(std::vector<float> w) {
    owned_.push_back(std::move(w));
    return owned_.back().data();
  }

  // llama2.c's order: all layers' rms_att, then all wq, ... (one buffer at `base`).
  void layout_llama2c(const float* base) {
    const Config& c = config_;
    const std::size_t L = static_cast<std::size_t>(c.n_layers);
    const std::size_t V = static_cast<std::size_t>(c.vocab_size);
    const std::size_t d = static_cast<std::size_t>(c.dim);
    const std::size_t kv = static_cast<std::size_t>(c.kv_dim());
    const std::size_t hid = static_cast<std::size_t>(c.hidden_dim);
    const float* p = base;
    auto take = [&](std::size_t n) {
      const float* at = p;
      p += n;
      return at;
    };
    auto mat = [](const float* at, int rows, int cols) {
      return Weight{at, DType::f32, rows, cols};
    };
    const float* emb = take(V * d);
    const float* rms_att = take(L * d);
    const float* wq = take(L * d * d);
    const float* wk = take(L * d * kv);
    const float* wv = take(L * d * kv);
    const float* wo = take(L * d * d);
    const float* rms_ffn = take(L * d);
    const float* w1 = take(L * d * hid);
    const float* w2 = take(L * hid * d);
    const float* w3 = take(L * d * hid);
    rms_final_ = take(d);
    take(static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.head_dim()));
    const float* wcls = c.shared_classifier ? emb : take(V * d);
    emb_ = mat(emb, c.vocab_size, c.dim);
    cls_ = mat(wcls, c.vocab_size, c.dim);
    layers_.resize(L);
    for (std::size_t l = 0; l < L; ++l) {
      Layer& y = layers_[l];
      y.rms_att = rms_att + l * d;
      y.rms_ffn = rms_ffn + l * d;
      y.wq = mat(wq + l * d * d, c.dim, c.dim);
      y.wk = mat(wk + l * d * kv, c.kv_dim(), c.dim);
      y.wv = mat(wv + l * d * kv, c.kv_dim(), c.dim);
      y.wo = mat(wo + l * d * d, c.dim, c.dim);
      y.w1 = mat(w1 + l * d * hid, c.hidden_dim, c.dim);
      y.w2 = mat(w2 + l * d * hid, c.dim, c.hidden_dim);
      y.w3 = mat(w3 + l * d * hid, c.hidden_dim, c.dim);
    }
  }

  Config config_;
  Weight emb_, cls_;
  const float* rms_final_ = nullptr;
  std::vector<Layer> layers_;
  std::vector<std::vector<float>> owned_;
  std::vector<std::shared_ptr<const void>> keep_;
};

/// llama2.c's tokenizer file: int32 max_token_length, then per token float32 score,
/// int32 length and the bytes. The file does not store the count: it is the model's vocab.
class Tokenizer {
 public:
  static Tokenizer parse(const std::vector<char>& bytes, int vocab_size,
                         const std::string& name = "tokenizer") {
    using detail::require;
    require(vocab_size > 0, "tokenizer '", name, "': vocab_size = ", vocab_size, ", expected > 0");
    require(bytes.size() >= 4, "tokenizer '", name, "': ", bytes.size(),
            " bytes, expected at least 4 (max_token_length)");
    Tokenizer t;
    const auto max_len = detail::load<std::int32_t>(bytes.data());
    require(max_len > 0 && max_len <= 65536, "tokenizer '", name, "': max_token_length = ", max_len,
            ", expected 1..65536");
    std::size_t p = 4;
    for (int i = 0; i < vocab_size; ++i) {
      require(p + 8 <= bytes.size(), "tokenizer '", name, "': truncated at token ", i, " of ",
              vocab_size, " (", bytes.size(), " bytes)");
      const float score = detail::load<float>(bytes.data() + p);
      const auto len = detail::load<std::int32_t>(bytes.data() + p + 4);
      p += 8;
      require(len >= 0 && len <= max_len, "tokenizer '", name, "': token ", i, " has length ", len,
              ", expected 0..", max_len, " (max_token_length)");
      require(p + static_cast<std::size_t>(len) <= bytes.size(), "tokenizer '", name,
              "': truncated in the bytes of token ", i, " of ", vocab_size);
      t.pieces_.emplace_back(bytes.data() + p, static_cast<std::size_t>(len));
      t.scores_.push_back(score);
      p += static_cast<std::size_t>(len);
    }
    require(p == bytes.size(), "tokenizer '", name, "': ", bytes.size() - p,
            " trailing bytes after ", vocab_size,
            " tokens (vocabulary size does not match the model's?)");
    for (int i = 0; i < vocab_size; ++i) t.ids_.emplace(t.pieces_[static_cast<std::size_t>(i)], i);
    return t;
  }
  static Tokenizer load(const std::string& path, int vocab_size) {
    return parse(detail::read_file(path, "tokenizer"), vocab_size, path);
  }

  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  [[nodiscard]] int vocab_size() const { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] const std::string& piece(int id) const {
    return pieces_.at(static_cast<std::size_t>(id));
  }

  /// Text of `token` following `prev` (llama2.c's rules: the leading space after BOS is
  /// dropped; "<0xHH>" pieces are raw bytes).
  [[nodiscard]] std::string decode(int prev, int token) const {
    kvevict::detail::require(token >= 0 && token < vocab_size(), "decode: token = ", token,
                             ", expected 0 <= token < ", vocab_size());
    std::string s = pieces_[static_cast<std::size_t>(token)];
    if (prev == kBos && !s.empty() && s[0] == ' ') s.erase(0, 1);
    unsigned byte = 0;
    if (s.size() == 6 && std::sscanf(s.c_str(), "<0x%02X>", &byte) == 1)
      return std::string(1, static_cast<char>(byte));
    return s;
  }

  /// Text of a whole stream (starting after its first token, conventionally BOS).
  [[nodiscard]] std::string decode(std::span<const int> tokens) const {
    std::string out;
    for (std::size_t i = 1; i < tokens.size(); ++i) out += decode(tokens[i - 1], tokens[i]);
    return out;
  }

  /// SentencePiece-style BPE as llama2.c does it: a dummy leading space, one piece per
  /// UTF-8 character (byte fallback id = byte + 3), then repeatedly merge the adjacent
  /// pair whose merged piece has the highest score.
  [[nodiscard]] std::vector<int> encode(const std::string& text, bool bos, bool eos) const {
    std::vector<int> ids;
    if (bos) ids.push_back(kBos);
    std::vector<int> toks;
    std::string src = text.empty() ? text : " " + text;
    for (std::size_t i = 0; i < src.size();) {
      std::size_t n = 1;
      const auto c = static_cast<unsigned char>(src[i]);
      if (c >= 0xF0)
        n = 4;
      else if (c >= 0xE0)
        n = 3;
      else if (c >= 0xC0)
        n = 2;
      n = std::min(n, src.size() - i);
      const auto it = ids_.find(src.substr(i, n));
      if (it != ids_.end()) {
        toks.push_back(it->second);
      } else {
        for (std::size_t j = 0; j < n; ++j)
          toks.push_back(static_cast<unsigned char>(src[i + j]) + 3);
      }
      i += n;
    }
    for (;;) {
      float best = -std::numeric_limits<float>::infinity();
      int best_id = -1;
      std::size_t best_at = 0;
      for (std::size_t i = 0; i + 1 < toks.size(); ++i) {
        const auto it = ids_.find(piece(toks[i]) + piece(toks[i + 1]));
        if (it != ids_.end() && scores_[static_cast<std::size_t>(it->second)] > best) {
          best = scores_[static_cast<std::size_t>(it->second)];
          best_id = it->second;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      toks[best_at] = best_id;
      toks.erase(toks.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    ids.insert(ids.end(), toks.begin(), toks.end());
    if (eos) ids.push_back(kEos);
    return ids;
  }

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> ids_;
};

/// The K/V store Transformer<Policy, Scalar> runs over: KVCache<Policy, Scalar> (float by
/// default; Eigen::half, Eigen::bfloat16 or a quantized format of quantized.hpp, e.g.
/// Q8<8>, store the rows in fewer bytes and attend() reads those bytes), unless a
/// specialisation names another type with the same append(layer, pos, k, v, q) and an
/// attend(store, layer, queries) overload (paged_adapter.hpp: PagedTables' decisions).
template <class Policy, class Scalar = float>
struct CacheFor {
  using type = KVCache<Policy, Scalar>;
};

/// What RoPE sees after eviction (docs/engine.md, "Generating past the trained length").
enum class Positions {
  /// Keys are rotated at their token position before they are stored: a kept row keeps
  /// the position it was computed with, and positions grow without bound.
  keep,
  /// StreamingLLM's re-indexing: keys are stored before rotation and rotated at attention
  /// by their rank inside the cache (the oldest kept row is 0, the newest n - 1), queries
  /// at n - 1; positions seen by the model never exceed the cache's rows.
  reindex,
};

/// A Llama forward pass whose K/V of all layers live in one KVCache<Policy>. With
/// Positions::keep (the default) keys are rotated (RoPE) before they are stored, at their
/// original token position, so rows kept after eviction keep the positions they were
/// computed with; Positions::reindex stores them unrotated and re-indexes at attention.
/// A bounded cache (any budget but Budget::unbounded()) may run past the checkpoint's
/// seq_len; an unbounded one (FullCache, the Oracle) stops there with an Error.
template <class Policy, class Scalar = float>
class Transformer {
 public:
  using Cache = typename CacheFor<Policy, Scalar>::type;
  /// A KVCache (of any storage type): attention runs through the allocation-free
  /// workspace overload of kvevict::attend, which reads the stored rows (or bytes).
  static constexpr bool kDenseCache = requires(Cache& c) {
    c.stored_keys(0, 0);
    c.positions(0, 0);
  };
  /// Positions::reindex reads the stored rows back as floats (keys(), values(),
  /// positions()): only a float KVCache has them, not paged_adapter.hpp's PagedStore nor
  /// a 16-bit or quantized cache.
  static constexpr bool kStoresRows = kDenseCache && std::is_same_v<Scalar, float> &&
                                      requires(Cache& c) {
                                        c.keys(0, 0);
                                        c.values(0, 0);
                                      };

  /// `model` must outlive the transformer (shared so several policies reuse one copy).
  Transformer(std::shared_ptr<const Model> model, const Budget& budget, Policy policy = Policy{},
              Positions positions = Positions::keep)
      : model_(std::move(model)),
        cache_((kvevict::detail::require(model_ != nullptr, "Transformer: model is null"),
                model_->config().geometry()),
               budget, std::move(policy)),
        positions_(positions),
        bounded_(!budget.is_unbounded()) {
    if constexpr (!kStoresRows)
      kvevict::detail::require(positions == Positions::keep,
                               "Transformer: Positions::reindex needs a float KVCache (this "
                               "store keeps keys rotated at their positions)");
    const Config& c = model_->config();
    x_.resize(c.dim);
    xb_.resize(c.dim);
    q_.resize(c.q_dim());
    k_.resize(c.kv_dim());
    v_.resize(c.kv_dim());
    h1_.resize(c.hidden_dim);
    h3_.resize(c.hidden_dim);
    logits_.resize(c.vocab_size);
    freq_ = rope_frequencies(c);
  }

  [[nodiscard]] const Model& model() const { return *model_; }
  [[nodiscard]] Cache& cache() { return cache_; }
  [[nodiscard]] const Cache& cache() const { return cache_; }

  /// Called by forward() after each layer's attention with the layer, its rotated queries
  /// (n_heads x head_dim) and the result; att.probs[kv_head] is over the cache's live rows
  /// in row order (cache().positions(layer, kv_head) names their tokens). For measurement
  /// (docs/quality.md's diagnosis); unset, forward() pays one branch per layer.
  using AttentionObserver =
      std::function<void(int layer, std::span<const float> queries, const AttentionResult& att)>;
  void set_attention_observer(AttentionObserver observer) { observer_ = std::move(observer); }

  /// For timing only (llama2c_decode_timing): accept positions below `limit` even when it
  /// exceeds the checkpoint's seq_len and the cache is unbounded. RoPE extrapolates, so the
  /// outputs past seq_len mean nothing; the work per token is the real one. 0 restores the
  /// checkpoint's limit.
  void set_position_limit_for_timing(int limit) {
    kvevict::detail::require(limit >= 0, "set_position_limit_for_timing: limit = ", limit,
                             ", expected >= 0");
    timing_limit_ = limit;
  }

  /// forward_block as an engine with chunked prefill runs it (off by default): each layer's
  /// block attends at full attention over the rows the cache holds plus the whole block
  /// (causal), and only then goes to the cache in one KVCache::prefill, so a policy with a
  /// prompt selection (SnapKV: after every block from its held rows plus the block) selects
  /// with the block's keys and queries, and policies without one take the block token by
  /// token through their decode rule. A float KVCache with Positions::keep only.
  void set_prefill_select(bool on) {
    if constexpr (!kStoresRows) {
      kvevict::detail::require(!on, "set_prefill_select: needs a float KVCache");
    } else {
      kvevict::detail::require(!on || positions_ == Positions::keep,
                               "set_prefill_select: needs Positions::keep");
    }
    prefill_select_ = on;
  }
  /// With set_prefill_select: layer l's block goes to `sink` instead of the cache's prefill
  /// (sink(layer, first_position, tokens, keys, values, queries), the layouts of
  /// KVCache::prefill): for a caller that stages the block across layers before it goes in
  /// (policies::ChunkedXkvPrefill). An empty function restores the cache's prefill.
  using PrefillSink = std::function<void(int, std::int64_t, std::size_t, std::span<const float>,
                                         std::span<const float>, std::span<const float>)>;
  void set_prefill_sink(PrefillSink sink) { prefill_sink_ = std::move(sink); }

  /// Feeds `token` at position `pos` (positions must increase) and returns the logits
  /// of the next token; the span is valid until the next call.
  std::span<const float> forward(int token, int pos) {
    const Config& c = model_->config();
    check_input(token, pos);
    const Model& m = *model_;
    m.token_embedding().widen_row(token, x_.data());
    const float eps = c.norm_eps;
    for (int l = 0; l < c.n_layers; ++l) {
      const Model::Layer& w = m.layer(l);
      rmsnorm(xb_, x_, w.rms_att, eps);
      w.wq.matvec(q_, xb_, scratch_);
      w.wk.matvec(k_, xb_, scratch_);
      w.wv.matvec(v_, xb_, scratch_);
      att_.resize(c.q_dim());
      attention_step(w, l, pos, q_.data(), k_.data(), v_.data(), att_.data());
      w.wo.matvec(xb_, att_, scratch_);
      if (w.bo != nullptr) xb_ += Model::Vector(w.bo, c.dim);
      x_ += xb_;
      rmsnorm(xb_, x_, w.rms_ffn, eps);
      w.w1.matvec(h1_, xb_, scratch_);
      w.w3.matvec(h3_, xb_, scratch_);
      h1_ = (h1_.array() / (1.0f + (-h1_.array()).exp()) * h3_.array()).matrix();  // SwiGLU
      w.w2.matvec(xb_, h1_, scratch_);
      x_ += xb_;
    }
    rmsnorm(xb_, x_, m.rms_final().data(), eps);
    m.classify(logits_, xb_, scratch_);
    return {logits_.data(), static_cast<std::size_t>(logits_.size())};
  }

  /// The last forward()'s final RMSNorm output (dim floats): the classifier turns it into
  /// the logits, so Model::classify() on a copy gives them again bit for bit. Valid until
  /// the next call (not set by forward_block() with all_logits).
  [[nodiscard]] std::span<const float> final_hidden() const {
    return {xb_.data(), static_cast<std::size_t>(xb_.size())};
  }

  /// Feeds tokens[i] at position pos0 + i, as forward() would one at a time, but each
  /// layer's projections and MLP run as one matrix product over the block (weights are
  /// read once per block instead of once per token: the prefill path). Attention stays
  /// per token in order (append, then attend to the rows so far), so the cache sees the
  /// same appends as with forward(); only the order of calls across layers differs, which
  /// matters only to a policy with state shared across layers (none of the registry's:
  /// Random draws from one generator per layer and KV head). The block's keys and queries
  /// differ from forward()'s by float rounding, so a policy ranking rows by a near-tied
  /// quantity (KNorm's key norms on stories260K) can choose other rows. Returns the last token's logits; when `all_logits` is set it
  /// receives tokens.size() x vocab floats. Logits equal forward()'s up to float rounding
  /// (tests/hf_test.py checks 1e-4).
  std::span<const float> forward_block(std::span<const int> tokens, int pos0,
                                       std::vector<float>* all_logits = nullptr) {
    const Config& c = model_->config();
    kvevict::detail::require(!tokens.empty(), "forward_block: no tokens");
    kvevict::detail::require(pos0 >= 0 && tokens.size() <= static_cast<std::size_t>(
                                                               std::numeric_limits<int>::max() - pos0),
                             "forward_block: pos0 = ", pos0, " with ", tokens.size(),
                             " tokens overflows int positions");
    for (std::size_t i = 0; i < tokens.size(); ++i)
      check_input(tokens[i], pos0 + static_cast<int>(i));
    const Model& m = *model_;
    const auto n = static_cast<Eigen::Index>(tokens.size());
    const float eps = c.norm_eps;
    X_.resize(n, c.dim);
    for (Eigen::Index i = 0; i < n; ++i)
      m.token_embedding().widen_row(tokens[static_cast<std::size_t>(i)], X_.row(i).data());
    for (int l = 0; l < c.n_layers; ++l) {
      const Model::Layer& w = m.layer(l);
      rmsnorm_rows(XB_, X_, w.rms_att, eps);
      w.wq.matmul(Q_, XB_, scratch_);
      w.wk.matmul(K_, XB_, scratch_);
      w.wv.matmul(V_, XB_, scratch_);
      A_.resize(n, c.q_dim());
      if (prefill_select_) {
        if constexpr (kStoresRows) select_block(w, l, pos0, n);
      } else {
        for (Eigen::Index i = 0; i < n; ++i)
          attention_step(w, l, pos0 + static_cast<int>(i), Q_.row(i).data(), K_.row(i).data(),
                         V_.row(i).data(), A_.row(i).data());
      }
      w.wo.matmul(XB_, A_, scratch_);
      if (w.bo != nullptr) XB_.rowwise() += Model::Vector(w.bo, c.dim).transpose();
      X_ += XB_;
      rmsnorm_rows(XB_, X_, w.rms_ffn, eps);
      w.w1.matmul(H1_, XB_, scratch_);
      w.w3.matmul(H3_, XB_, scratch_);
      H1_ = (H1_.array() / (1.0f + (-H1_.array()).exp()) * H3_.array()).matrix();  // SwiGLU
      w.w2.matmul(XB_, H1_, scratch_);
      X_ += XB_;
    }
    if (all_logits != nullptr) {
      rmsnorm_rows(XB_, X_, m.rms_final().data(), eps);
      m.classifier().matmul(L_, XB_, scratch_);
      all_logits->assign(L_.data(), L_.data() + L_.size());
      std::copy_n(L_.row(n - 1).data(), c.vocab_size, logits_.data());
    } else {
      x_ = X_.row(n - 1).transpose();
      rmsnorm(xb_, x_, m.rms_final().data(), eps);
      m.classifier().matvec(logits_, xb_, scratch_);
    }
    return {logits_.data(), static_cast<std::size_t>(logits_.size())};
  }

 private:
  using RowMatrix = Weight::RowMatrix;

  void check_input(int token, int pos) const {
    const Config& c = model_->config();
    kvevict::detail::require(token >= 0 && token < c.vocab_size, "forward: token = ", token,
                             ", expected 0 <= token < ", c.vocab_size);
    kvevict::detail::require(pos >= 0, "forward: pos = ", pos, ", expected >= 0");
    kvevict::detail::require(
        pos < c.seq_len || bounded_ || pos < timing_limit_, "forward: pos = ", pos,
        " is past the checkpoint's seq_len = ",
        c.seq_len, "; only a bounded cache (a policy with a row budget) generates further");
  }

  // The projections q (q_dim floats), k and v (kv_dim) of one token get their biases,
  // q/k norms and RoPE (unless `reindex`).
  void project(const Model::Layer& w, int pos, float* q, float* k, float* v, bool reindex) {
    const Config& c = model_->config();
    const auto qn = static_cast<std::size_t>(c.q_dim());
    const auto kn = static_cast<std::size_t>(c.kv_dim());
    const float eps = c.norm_eps;
    auto add = [](float* x, const float* b, std::size_t n) {
      if (b != nullptr)
        for (std::size_t i = 0; i < n; ++i) x[i] += b[i];
    };
    add(q, w.bq, qn);
    add(k, w.bk, kn);
    add(v, w.bv, kn);
    if (w.q_norm != nullptr) head_rmsnorm(q, qn, w.q_norm, eps);
    if (w.k_norm != nullptr) head_rmsnorm(k, kn, w.k_norm, eps);
    if (!reindex) {
      rope(q, qn, pos);
      rope(k, kn, pos);
    }
  }

  // set_prefill_select: layer l of a block of n tokens (projections in Q_, K_, V_). Token i
  // attends causally over the cache's rows and block tokens 0..i; then the block goes to the
  // cache in one prefill (the policy's selection).
  void select_block(const Model::Layer& w, int l, int pos0, Eigen::Index n) {
    const Config& c = model_->config();
    const int G = c.n_heads / c.n_kv_heads, d = c.head_dim();
    for (Eigen::Index i = 0; i < n; ++i)
      project(w, pos0 + static_cast<int>(i), Q_.row(i).data(), K_.row(i).data(), V_.row(i).data(), false);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> logit;
    for (int kh = 0; kh < c.n_kv_heads; ++kh) {
      const auto held_k = cache_.keys(l, kh);
      const auto held_v = cache_.values(l, kh);
      const Eigen::Index held = held_k.rows();
      for (Eigen::Index i = 0; i < n; ++i)
        for (int g = 0; g < G; ++g) {
          const float* q = Q_.row(i).data() + static_cast<std::size_t>((kh * G + g) * d);
          const Eigen::Map<const Eigen::VectorXf> qv(q, d);
          logit.resize(static_cast<std::size_t>(held + i + 1));
          for (Eigen::Index r = 0; r < held; ++r) logit[static_cast<std::size_t>(r)] = held_k.row(r).dot(qv) * scale;
          for (Eigen::Index j = 0; j <= i; ++j)
            logit[static_cast<std::size_t>(held + j)] =
                Eigen::Map<const Eigen::VectorXf>(K_.row(j).data() + kh * d, d).dot(qv) * scale;
          const float m = *std::max_element(logit.begin(), logit.end());
          float z = 0.0f;
          for (float& x : logit) z += (x = std::exp(x - m));
          float* out = A_.row(i).data() + static_cast<std::size_t>((kh * G + g) * d);
          Eigen::Map<Eigen::VectorXf> o(out, d);
          o.setZero();
          for (Eigen::Index r = 0; r < held; ++r) o += (logit[static_cast<std::size_t>(r)] / z) * held_v.row(r).transpose();
          for (Eigen::Index j = 0; j <= i; ++j)
            o += (logit[static_cast<std::size_t>(held + j)] / z) *
                 Eigen::Map<const Eigen::VectorXf>(V_.row(j).data() + kh * d, d);
        }
    }
    const auto un = static_cast<std::size_t>(n);
    const std::span<const float> ks(K_.data(), un * static_cast<std::size_t>(c.kv_dim())),
        vs(V_.data(), un * static_cast<std::size_t>(c.kv_dim())), qs(Q_.data(), un * static_cast<std::size_t>(c.q_dim()));
    if (prefill_sink_) prefill_sink_(l, pos0, un, ks, vs, qs);
    else cache_.prefill(l, pos0, un, ks, vs, qs);
  }

  // One token's attention in layer l: the projections q (q_dim floats), k and v (kv_dim)
  // get their biases, q/k norms and RoPE, k and v go into the cache, and the heads'
  // outputs (q_dim floats) go to `out`. Shared by forward() and forward_block().
  void attention_step(const Model::Layer& w, int l, int pos, float* q, float* k, float* v,
                      float* out) {
    const Config& c = model_->config();
    const auto qn = static_cast<std::size_t>(c.q_dim());
    const auto kn = static_cast<std::size_t>(c.kv_dim());
    const bool reindex = positions_ == Positions::reindex;
    project(w, pos, q, k, v, reindex);
    const std::span<const float> qs(q, qn);
    cache_.append(l, pos, std::span<const float>(k, kn), std::span<const float>(v, kn), qs);
    if constexpr (kDenseCache) {  // a KVCache (paged_adapter.hpp's store has its own attend)
      // The common case allocates nothing per step: output and probabilities in reused
      // buffers (the same kernel as the allocating overload, bit-identical).
      if (!reindex && !observer_) {
        attend(cache_, l, qs, std::span<float>(out, qn), workspace_);
        return;
      }
    }
    const AttentionResult att = [&] {
      if constexpr (kStoresRows) {
        if (reindex) return attend_reindexed(l, q);
      }
      return attend(cache_, l, qs);
    }();
    if (observer_) observer_(l, qs, att);
    // att.out is n_heads x head_dim row-major: exactly the concatenated head outputs.
    std::copy_n(att.out.data(), qn, out);
  }

  static void rmsnorm_rows(RowMatrix& out, const RowMatrix& x, const float* weight, float eps) {
    const Model::Vector w(weight, x.cols());
    out.resize(x.rows(), x.cols());
    for (Eigen::Index i = 0; i < x.rows(); ++i) {
      const float ss =
          1.0f / std::sqrt(x.row(i).squaredNorm() / static_cast<float>(x.cols()) + eps);
      out.row(i) = (x.row(i).array() * ss * w.transpose().array()).matrix();
    }
  }
  static void rmsnorm(Eigen::VectorXf& out, const Eigen::VectorXf& x, const float* weight,
                      float eps) {
    const Model::Vector w(weight, x.size());
    const float ss = 1.0f / std::sqrt(x.squaredNorm() / static_cast<float>(x.size()) + eps);
    out = (x.array() * ss * w.array()).matrix();
  }
  // Qwen3's q/k norm: RMSNorm over each head's head_dim floats with one shared weight.
  void head_rmsnorm(float* v, std::size_t n, const float* weight, float eps) const {
    const int hd = model_->config().head_dim();
    const Model::Vector w(weight, hd);
    for (std::size_t at = 0; at < n; at += static_cast<std::size_t>(hd)) {
      Eigen::Map<Eigen::VectorXf> h(v + at, hd);
      const float ss = 1.0f / std::sqrt(h.squaredNorm() / static_cast<float>(hd) + eps);
      h = (h.array() * ss * w.array()).matrix();
    }
  }
  // Rotates one head's pair i, (a, b), by the angle with cosine cr and sine ci: adjacent
  // floats (2i, 2i + 1) in llama2.c's layout, (i, i + head_dim / 2) in rotate_half's.
  static void rotate_pair(float* head, std::size_t i, std::size_t half, RopeStyle style, float cr,
                          float ci) {
    const std::size_t a = style == RopeStyle::interleaved ? 2 * i : i;
    const std::size_t b = style == RopeStyle::interleaved ? 2 * i + 1 : i + half;
    const float v0 = head[a], v1 = head[b];
    head[a] = v0 * cr - v1 * ci;
    head[b] = v0 * ci + v1 * cr;
  }
  // Rotates pair i of every head by pos * theta_i.
  void rope(float* v, std::size_t n, int pos) const {
    const auto hd = static_cast<std::size_t>(model_->config().head_dim());
    const std::size_t half = freq_.size();
    const RopeStyle style = model_->config().rope;
    for (std::size_t at = 0; at < n; at += hd)
      for (std::size_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(pos) * freq_[i];
        rotate_pair(v + at, i, half, style, std::cos(a), std::sin(a));
      }
  }

  // Rotates the head_dim floats at x by rank `r` with the cached table (reindex mode).
  void rope_rank(float* x, std::size_t r) {
    const std::size_t half = freq_.size();
    while (rank_cos_.size() < (r + 1) * half) {
      const std::size_t p = rank_cos_.size() / half;
      for (std::size_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(p) * freq_[i];
        rank_cos_.push_back(std::cos(a));
        rank_sin_.push_back(std::sin(a));
      }
    }
    const float* cr = rank_cos_.data() + r * half;
    const float* ci = rank_sin_.data() + r * half;
    const RopeStyle style = model_->config().rope;
    for (std::size_t i = 0; i < half; ++i) rotate_pair(x, i, half, style, cr[i], ci[i]);
  }

  // Attention of layer l in reindex mode: the cache holds unrotated keys and q_ is
  // unrotated; each KV head's rows are rotated by their rank in position order and its
  // group's queries by n - 1. Otherwise what kvevict::attend does (the Oracle's limit,
  // observe for attention policies).
  AttentionResult attend_reindexed(int l, const float* q) {
    const Config& c = model_->config();
    const int G = c.n_heads / c.n_kv_heads;
    const auto d = static_cast<std::size_t>(c.head_dim());
    AttentionResult r;
    r.out.setZero(c.n_heads, c.head_dim());
    r.probs.resize(static_cast<std::size_t>(c.n_kv_heads));
    for (int kh = 0; kh < c.n_kv_heads; ++kh) {
      const auto k = cache_.keys(l, kh);
      const auto pos = cache_.positions(l, kh);
      const auto n = static_cast<std::size_t>(k.rows());
      auto& p = r.probs[static_cast<std::size_t>(kh)];
      p.resize(G, static_cast<Eigen::Index>(n));
      if (n == 0) continue;
      order_.resize(n);
      std::iota(order_.begin(), order_.end(), 0u);
      std::sort(order_.begin(), order_.end(),
                [&](std::uint32_t a, std::uint32_t b) { return pos[a] < pos[b]; });
      rotated_.resize(n * d);
      for (std::size_t rank = 0; rank < n; ++rank) {
        float* row = rotated_.data() + std::size_t(order_[rank]) * d;
        std::copy_n(k.data() + std::size_t(order_[rank]) * d, d, row);
        rope_rank(row, rank);
      }
      group_q_.assign(q + std::size_t(kh * G) * d, q + std::size_t(kh * G + G) * d);
      for (int g = 0; g < G; ++g) rope_rank(group_q_.data() + std::size_t(g) * d, n - 1);
      kvevict::detail::group_probabilities(rotated_.data(), n, d, group_q_.data(), G, p.data());
    }
    if constexpr (kvevict::detail::RestrictsAttention<Policy>)
      kvevict::detail::restrict_attention(cache_.policy(), l, r.probs.size(), [&](std::size_t kh) {
        return Eigen::Ref<kvevict::detail::RowMajorF>(r.probs[kh]);
      });
    for (int kh = 0; kh < c.n_kv_heads; ++kh) {
      const auto& p = r.probs[static_cast<std::size_t>(kh)];
      if (p.cols() == 0) continue;
      r.out.middleRows(kh * G, G).noalias() = p * cache_.values(l, kh);
      cache_.observe(l, kh, std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
    }
    return r;
  }

  std::shared_ptr<const Model> model_;
  Cache cache_;
  Positions positions_ = Positions::keep;
  bool bounded_ = false;
  bool prefill_select_ = false;
  PrefillSink prefill_sink_;
  std::vector<float> rank_cos_, rank_sin_, rotated_, group_q_;
  std::vector<std::uint32_t> order_;
  Eigen::VectorXf x_, xb_, q_, k_, v_, h1_, h3_, logits_, att_;
  RowMatrix X_, XB_, Q_, K_, V_, A_, H1_, H3_, L_;  // forward_block's rows, one per token
  AttendWorkspace workspace_;
  int timing_limit_ = 0;
  std::vector<float> freq_, scratch_;
  AttentionObserver observer_;
};

}  // namespace kvevict::llama2c
