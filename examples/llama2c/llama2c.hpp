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

namespace kvevict::llama2c {

/// The seven int32 fields of a version-0 header, with vocab_size made positive.
struct Config {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;
  int seq_len = 0;
  bool shared_classifier = true;  ///< header vocab_size > 0: logits reuse the embedding

  [[nodiscard]] int head_dim() const { return dim / n_heads; }
  [[nodiscard]] int kv_dim() const { return n_kv_heads * head_dim(); }
  [[nodiscard]] Geometry geometry() const { return {n_layers, n_heads, n_kv_heads, head_dim()}; }
};

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

/// A loaded checkpoint: its config and all weights in one buffer (row-major matrices,
/// out x in, as llama2.c stores them).
class Model {
 public:
  using Matrix =
      Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;
  using Vector = Eigen::Map<const Eigen::VectorXf>;

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
    m.weights_.resize(static_cast<std::size_t>(floats));
    std::memcpy(m.weights_.data(), bytes.data() + kHeader, static_cast<std::size_t>(floats) * 4);
    for (std::size_t i = 0; i < m.weights_.size(); ++i)
      require(std::isfinite(m.weights_[i]), "checkpoint '", name, "': weight float ", i, " = ",
              m.weights_[i], ", expected finite (corrupt file?)");
    m.layout();
    return m;
  }

  /// Reads and validates a version-0 checkpoint file.
  static Model load(const std::string& path) {
    return parse(detail::read_file(path, "checkpoint"), path);
  }

  [[nodiscard]] const Config& config() const { return config_; }

  // Weight views (layer-indexed where llama2.c stacks them).
  [[nodiscard]] Matrix token_embedding() const {
    return mat(off_.emb, config_.vocab_size, config_.dim);
  }
  [[nodiscard]] Vector rms_att(int l) const { return vec(off_.rms_att + l * d(), config_.dim); }
  [[nodiscard]] Matrix wq(int l) const {
    return mat(off_.wq + l * d() * d(), config_.dim, config_.dim);
  }
  [[nodiscard]] Matrix wk(int l) const {
    return mat(off_.wk + l * d() * kv(), config_.kv_dim(), config_.dim);
  }
  [[nodiscard]] Matrix wv(int l) const {
    return mat(off_.wv + l * d() * kv(), config_.kv_dim(), config_.dim);
  }
  [[nodiscard]] Matrix wo(int l) const {
    return mat(off_.wo + l * d() * d(), config_.dim, config_.dim);
  }
  [[nodiscard]] Vector rms_ffn(int l) const { return vec(off_.rms_ffn + l * d(), config_.dim); }
  [[nodiscard]] Matrix w1(int l) const {
    return mat(off_.w1 + l * d() * hid(), config_.hidden_dim, config_.dim);
  }
  [[nodiscard]] Matrix w2(int l) const {
    return mat(off_.w2 + l * d() * hid(), config_.dim, config_.hidden_dim);
  }
  [[nodiscard]] Matrix w3(int l) const {
    return mat(off_.w3 + l * d() * hid(), config_.hidden_dim, config_.dim);
  }
  [[nodiscard]] Vector rms_final() const { return vec(off_.rms_final, config_.dim); }
  [[nodiscard]] Matrix classifier() const {
    return mat(off_.wcls, config_.vocab_size, config_.dim);
  }

 private:
  struct Offsets {
    std::size_t emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, wcls;
  };
  std::size_t d() const { return static_cast<std::size_t>(config_.dim); }
  std::size_t kv() const { return static_cast<std::size_t>(config_.kv_dim()); }
  std::size_t hid() const { return static_cast<std::size_t>(config_.hidden_dim); }
  Matrix mat(std::size_t off, int rows, int cols) const {
    return Matrix(weights_.data() + off, rows, cols);
  }
  Vector vec(std::size_t off, int n) const { return Vector(weights_.data() + off, n); }

  void layout() {
    const std::size_t L = static_cast<std::size_t>(config_.n_layers);
    const std::size_t V = static_cast<std::size_t>(config_.vocab_size);
    std::size_t p = 0;
    auto take = [&](std::size_t n) {
      const std::size_t at = p;
      p += n;
      return at;
    };
    off_.emb = take(V * d());
    off_.rms_att = take(L * d());
    off_.wq = take(L * d() * d());
    off_.wk = take(L * d() * kv());
    off_.wv = take(L * d() * kv());
    off_.wo = take(L * d() * d());
    off_.rms_ffn = take(L * d());
    off_.w1 = take(L * d() * hid());
    off_.w2 = take(L * hid() * d());
    off_.w3 = take(L * d() * hid());
    off_.rms_final = take(d());
    take(static_cast<std::size_t>(config_.seq_len) * static_cast<std::size_t>(config_.head_dim()));
    off_.wcls = config_.shared_classifier ? off_.emb : take(V * d());
  }

  Config config_;
  std::vector<float> weights_;
  Offsets off_{};
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

/// The K/V store Transformer<Policy> runs over: KVCache<Policy, float>, unless a
/// specialisation names another type with the same append(layer, pos, k, v, q) and an
/// attend(store, layer, queries) overload (paged_adapter.hpp: PagedTables' decisions).
template <class Policy>
struct CacheFor {
  using type = KVCache<Policy, float>;
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
template <class Policy>
class Transformer {
 public:
  using Cache = typename CacheFor<Policy>::type;
  /// Positions::reindex reads the stored rows back (keys(), values(), positions()): only
  /// the KVCache store has them, not paged_adapter.hpp's PagedStore.
  static constexpr bool kStoresRows = requires(Cache& c) {
    c.keys(0, 0);
    c.values(0, 0);
    c.positions(0, 0);
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
                               "Transformer: Positions::reindex needs a KVCache (this store "
                               "keeps keys rotated at their positions)");
    const Config& c = model_->config();
    x_.resize(c.dim);
    xb_.resize(c.dim);
    q_.resize(c.dim);
    k_.resize(c.kv_dim());
    v_.resize(c.kv_dim());
    h1_.resize(c.hidden_dim);
    h3_.resize(c.hidden_dim);
    logits_.resize(c.vocab_size);
    att_out_.resize(c.dim);
    // llama2.c's frequencies: theta_i = 10000^(-i / head_dim) for even i.
    const int hd = c.head_dim();
    for (int i = 0; i < hd; i += 2)
      freq_.push_back(1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(hd)));
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

  /// Feeds `token` at position `pos` (positions must increase) and returns the logits
  /// of the next token; the span is valid until the next call.
  std::span<const float> forward(int token, int pos) {
    const Config& c = model_->config();
    kvevict::detail::require(token >= 0 && token < c.vocab_size, "forward: token = ", token,
                             ", expected 0 <= token < ", c.vocab_size);
    kvevict::detail::require(pos >= 0, "forward: pos = ", pos, ", expected >= 0");
    kvevict::detail::require(pos < c.seq_len || bounded_ || pos < timing_limit_, "forward: pos = ",
                             pos, " is past the checkpoint's seq_len = ", c.seq_len,
                             "; only a bounded cache (a policy with a row budget) generates further");
    const Model& m = *model_;
    const bool reindex = positions_ == Positions::reindex;
    x_ = m.token_embedding().row(token).transpose();
    for (int l = 0; l < c.n_layers; ++l) {
      rmsnorm(xb_, x_, m.rms_att(l));
      q_.noalias() = m.wq(l) * xb_;
      k_.noalias() = m.wk(l) * xb_;
      v_.noalias() = m.wv(l) * xb_;
      if (!reindex) {
        rope(q_, pos);
        rope(k_, pos);
      }
      const std::span<const float> qs(q_.data(), static_cast<std::size_t>(q_.size()));
      cache_.append(l, pos, std::span<const float>(k_.data(), static_cast<std::size_t>(k_.size())),
                    std::span<const float>(v_.data(), static_cast<std::size_t>(v_.size())), qs);
      bool done = false;
      if constexpr (kStoresRows) {  // a KVCache (paged_adapter.hpp's store has its own attend)
        // The common case allocates nothing per step: output and probabilities in reused
        // buffers (the same kernel as the allocating overload, bit-identical).
        if (!reindex && !observer_) {
          attend(cache_, l, qs, std::span<float>(att_out_.data(), static_cast<std::size_t>(c.dim)),
                 workspace_);
          x_.noalias() += m.wo(l) * att_out_;
          done = true;
        }
      }
      if (!done) {
        const AttentionResult att = [&] {
          if constexpr (kStoresRows) {
            if (reindex) return attend_reindexed(l);
          }
          return attend(cache_, l, qs);
        }();
        if (observer_) observer_(l, qs, att);
        // att.out is n_heads x head_dim row-major: exactly the concatenated head outputs.
        x_.noalias() += m.wo(l) * Eigen::Map<const Eigen::VectorXf>(att.out.data(), c.dim);
      }
      rmsnorm(xb_, x_, m.rms_ffn(l));
      h1_.noalias() = m.w1(l) * xb_;
      h3_.noalias() = m.w3(l) * xb_;
      h1_ = (h1_.array() / (1.0f + (-h1_.array()).exp()) * h3_.array()).matrix();  // SwiGLU
      x_.noalias() += m.w2(l) * h1_;
    }
    rmsnorm(xb_, x_, m.rms_final());
    logits_.noalias() = m.classifier() * xb_;
    return {logits_.data(), static_cast<std::size_t>(logits_.size())};
  }

 private:
  static void rmsnorm(Eigen::VectorXf& out, const Eigen::VectorXf& x, const Model::Vector& w) {
    const float ss = 1.0f / std::sqrt(x.squaredNorm() / static_cast<float>(x.size()) + 1e-5f);
    out = (x.array() * ss * w.array()).matrix();
  }
  // Rotates each adjacent pair (2i, 2i+1) of every head by pos * theta_i (llama2.c).
  void rope(Eigen::VectorXf& v, int pos) const {
    const int hd = model_->config().head_dim();
    for (Eigen::Index i = 0; i < v.size(); i += 2) {
      const float a = static_cast<float>(pos) * freq_[static_cast<std::size_t>((i % hd) / 2)];
      const float cr = std::cos(a), ci = std::sin(a);
      const float v0 = v[i], v1 = v[i + 1];
      v[i] = v0 * cr - v1 * ci;
      v[i + 1] = v0 * ci + v1 * cr;
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
    for (std::size_t i = 0; i < half; ++i) {
      const float v0 = x[2 * i], v1 = x[2 * i + 1];
      x[2 * i] = v0 * cr[i] - v1 * ci[i];
      x[2 * i + 1] = v0 * ci[i] + v1 * cr[i];
    }
  }

  // Attention of layer l in reindex mode: the cache holds unrotated keys and q_ is
  // unrotated; each KV head's rows are rotated by their rank in position order and its
  // group's queries by n - 1. Otherwise what kvevict::attend does (the Oracle's limit,
  // observe for attention policies).
  AttentionResult attend_reindexed(int l) {
    const Config& c = model_->config();
    const int G = c.n_heads / c.n_kv_heads;
    const auto d = static_cast<std::size_t>(c.head_dim());
    AttentionResult r;
    r.out.setZero(c.n_heads, c.head_dim());
    r.probs.resize(static_cast<std::size_t>(c.n_kv_heads));
    for (int kh = 0; kh < c.n_kv_heads; ++kh) {
      const auto k = cache_.keys(l, kh);
      const auto v = cache_.values(l, kh);
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
      group_q_.assign(q_.data() + std::size_t(kh * G) * d, q_.data() + std::size_t(kh * G + G) * d);
      for (int g = 0; g < G; ++g) rope_rank(group_q_.data() + std::size_t(g) * d, n - 1);
      kvevict::detail::group_probabilities(rotated_.data(), n, d, group_q_.data(), G, p.data());
      if constexpr (kvevict::detail::RestrictsAttention<Policy>)
        kvevict::detail::restrict_to_top(p, cache_.policy().attention_limit(l, kh));
      r.out.middleRows(kh * G, G).noalias() = p * v;
      cache_.observe(l, kh, std::span<const float>(p.data(), static_cast<std::size_t>(p.size())));
    }
    return r;
  }

  std::shared_ptr<const Model> model_;
  Cache cache_;
  Positions positions_ = Positions::keep;
  bool bounded_ = false;
  std::vector<float> rank_cos_, rank_sin_, rotated_, group_q_;
  std::vector<std::uint32_t> order_;
  Eigen::VectorXf x_, xb_, q_, k_, v_, h1_, h3_, logits_, att_out_;
  AttendWorkspace workspace_;
  int timing_limit_ = 0;
  std::vector<float> freq_;
  AttentionObserver observer_;
};

}  // namespace kvevict::llama2c
