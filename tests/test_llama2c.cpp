// The llama2c example engine: checkpoint and tokenizer readers, the forward pass against
// a plain llama2.c-style reference written here, and the end-to-end protocol. Uses only
// tiny random checkpoints written to a temp directory (no shared/ model needed).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../examples/llama2c/e2e.hpp"
#include "../examples/llama2c/llama2c.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/oracle.hpp"
#include "kvevict/policies/random.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"

namespace {

using namespace kvevict;
using namespace kvevict::llama2c;

struct Tiny {
  int dim = 16, hidden = 24, layers = 2, heads = 4, kv_heads = 2, vocab = 32, seq_len = 48;
  bool shared = true;
  int hd() const { return dim / heads; }
  int kv() const { return kv_heads * hd(); }
};

// Weights in llama2.c's order, each tensor its own vector so the reference reads them plainly.
struct TinyWeights {
  Tiny c;
  std::vector<float> emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq, wcls;
};

TinyWeights make_weights(const Tiny& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.4f);
  auto fill = [&](std::size_t count, float mean = 0.0f) {
    std::vector<float> v(count);
    for (auto& x : v) x = mean + n(rng);
    return v;
  };
  const auto L = static_cast<std::size_t>(c.layers), d = static_cast<std::size_t>(c.dim),
             h = static_cast<std::size_t>(c.hidden), kv = static_cast<std::size_t>(c.kv()),
             V = static_cast<std::size_t>(c.vocab);
  TinyWeights w{c,
                fill(V * d),
                fill(L * d, 1.0f),
                fill(L * d * d),
                fill(L * d * kv),
                fill(L * d * kv),
                fill(L * d * d),
                fill(L * d, 1.0f),
                fill(L * h * d),
                fill(L * d * h),
                fill(L * h * d),
                fill(d, 1.0f),
                fill(static_cast<std::size_t>(c.seq_len * c.hd())),
                {}};
  if (!c.shared) w.wcls = fill(V * d);
  return w;
}

std::vector<char> serialize(const TinyWeights& w) {
  std::vector<char> out;
  auto put = [&](const void* p, std::size_t n) {
    const std::size_t at = out.size();
    out.resize(at + n);
    if (n > 0) std::memcpy(out.data() + at, p, n);
  };
  const std::int32_t h[7] = {w.c.dim,    w.c.hidden,   w.c.layers,
                             w.c.heads,  w.c.kv_heads, w.c.shared ? w.c.vocab : -w.c.vocab,
                             w.c.seq_len};
  put(h, sizeof h);
  for (const auto* v : {&w.emb, &w.rms_att, &w.wq, &w.wk, &w.wv, &w.wo, &w.rms_ffn, &w.w1, &w.w2,
                        &w.w3, &w.rms_final, &w.freq, &w.wcls})
    put(v->data(), v->size() * sizeof(float));
  return out;
}

struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::vector<char>& bytes) {
    static int counter = 0;
    path =
        std::filesystem::temp_directory_path() / ("kvevict_llama2c_" + std::to_string(::getpid()) +
                                                  "_" + std::to_string(counter++) + ".bin");
    std::ofstream(path, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  ~TempFile() { std::filesystem::remove(path); }
};

// llama2.c's forward written out plainly; `visible(j, t)` says whether the query at
// position t may attend to the key at position j (all j <= t for the full cache).
class Reference {
 public:
  explicit Reference(const TinyWeights& w) : w_(w) {
    const auto n = static_cast<std::size_t>(w.c.layers * w.c.seq_len * w.c.kv());
    kc_.assign(n, 0.0f);
    vc_.assign(n, 0.0f);
  }
  std::vector<float> forward(int token, int pos, const std::function<bool(int, int)>& visible) {
    const Tiny& c = w_.c;
    const int d = c.dim, hd = c.hd(), kvd = c.kv(), G = c.heads / c.kv_heads;
    std::vector<float> x(w_.emb.begin() + token * d, w_.emb.begin() + (token + 1) * d);
    std::vector<float> xb(d), q(d), k(kvd), v(kvd), att(d), hb(c.hidden), hb2(c.hidden);
    for (int l = 0; l < c.layers; ++l) {
      rmsnorm(xb, x, &w_.rms_att[static_cast<std::size_t>(l * d)]);
      matmul(q, xb, &w_.wq[static_cast<std::size_t>(l * d * d)], d, d);
      matmul(k, xb, &w_.wk[static_cast<std::size_t>(l * d * kvd)], d, kvd);
      matmul(v, xb, &w_.wv[static_cast<std::size_t>(l * d * kvd)], d, kvd);
      for (int i = 0; i < d; i += 2) {
        const float freq =
            1.0f / std::pow(10000.0f, static_cast<float>(i % hd) / static_cast<float>(hd));
        const float a = static_cast<float>(pos) * freq, cr = std::cos(a), ci = std::sin(a);
        for (auto* vec : {&q, &k}) {
          if (vec == &k && i >= kvd) continue;
          const float v0 = (*vec)[i], v1 = (*vec)[i + 1];
          (*vec)[i] = v0 * cr - v1 * ci;
          (*vec)[i + 1] = v0 * ci + v1 * cr;
        }
      }
      float* kl = &kc_[static_cast<std::size_t>((l * c.seq_len + pos) * kvd)];
      float* vl = &vc_[static_cast<std::size_t>((l * c.seq_len + pos) * kvd)];
      std::copy(k.begin(), k.end(), kl);
      std::copy(v.begin(), v.end(), vl);
      for (int h = 0; h < c.heads; ++h) {
        const int kvh = h / G;
        std::vector<double> s(static_cast<std::size_t>(pos + 1), 0.0);
        double m = -1e300;
        for (int t = 0; t <= pos; ++t) {
          if (!visible(t, pos)) continue;
          const float* kt = &kc_[static_cast<std::size_t>((l * c.seq_len + t) * kvd + kvh * hd)];
          double dot = 0.0;
          for (int i = 0; i < hd; ++i) dot += q[static_cast<std::size_t>(h * hd + i)] * kt[i];
          s[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(hd));
          m = std::max(m, s[static_cast<std::size_t>(t)]);
        }
        double z = 0.0;
        for (int t = 0; t <= pos; ++t)
          z += visible(t, pos) ? std::exp(s[static_cast<std::size_t>(t)] - m) : 0.0;
        for (int i = 0; i < hd; ++i) {
          double o = 0.0;
          for (int t = 0; t <= pos; ++t) {
            if (!visible(t, pos)) continue;
            const float* vt = &vc_[static_cast<std::size_t>((l * c.seq_len + t) * kvd + kvh * hd)];
            o += std::exp(s[static_cast<std::size_t>(t)] - m) / z * vt[i];
          }
          att[static_cast<std::size_t>(h * hd + i)] = static_cast<float>(o);
        }
      }
      std::vector<float> o(d);
      matmul(o, att, &w_.wo[static_cast<std::size_t>(l * d * d)], d, d);
      for (int i = 0; i < d; ++i) x[static_cast<std::size_t>(i)] += o[static_cast<std::size_t>(i)];
      rmsnorm(xb, x, &w_.rms_ffn[static_cast<std::size_t>(l * d)]);
      matmul(hb, xb, &w_.w1[static_cast<std::size_t>(l * d * c.hidden)], d, c.hidden);
      matmul(hb2, xb, &w_.w3[static_cast<std::size_t>(l * d * c.hidden)], d, c.hidden);
      for (int i = 0; i < c.hidden; ++i) {
        const float a = hb[static_cast<std::size_t>(i)];
        hb[static_cast<std::size_t>(i)] =
            a / (1.0f + std::exp(-a)) * hb2[static_cast<std::size_t>(i)];
      }
      matmul(o, hb, &w_.w2[static_cast<std::size_t>(l * d * c.hidden)], c.hidden, d);
      for (int i = 0; i < d; ++i) x[static_cast<std::size_t>(i)] += o[static_cast<std::size_t>(i)];
    }
    rmsnorm(xb, x, w_.rms_final.data());
    std::vector<float> logits(static_cast<std::size_t>(c.vocab));
    matmul(logits, xb, c.shared ? w_.emb.data() : w_.wcls.data(), d, c.vocab);
    return logits;
  }

 private:
  static void rmsnorm(std::vector<float>& o, const std::vector<float>& x, const float* w) {
    double ss = 0.0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double s = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + 1e-5);
    for (std::size_t i = 0; i < x.size(); ++i) o[i] = static_cast<float>(w[i] * s * x[i]);
  }
  // W is (out x in) row-major, as llama2.c stores it.
  static void matmul(std::vector<float>& o, const std::vector<float>& x, const float* w, int in,
                     int out) {
    for (int r = 0; r < out; ++r) {
      double s = 0.0;
      for (int i = 0; i < in; ++i)
        s += static_cast<double>(w[r * in + i]) * x[static_cast<std::size_t>(i)];
      o[static_cast<std::size_t>(r)] = static_cast<float>(s);
    }
  }
  const TinyWeights& w_;
  std::vector<float> kc_, vc_;
};

double max_abs_diff(std::span<const float> a, const std::vector<float>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < b.size(); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - b[i]));
  return m;
}

std::vector<int> random_tokens(int n, int vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> t;
  for (int i = 0; i < n; ++i) t.push_back(static_cast<int>(rng() % static_cast<unsigned>(vocab)));
  return t;
}

std::string error_of(const std::vector<char>& bytes) {
  try {
    (void)Model::parse(bytes, "tiny.bin");
  } catch (const kvevict::Error& e) {
    return e.what();
  }
  return "";
}

void put_int(std::vector<char>& b, std::size_t at, std::int32_t v) {
  std::memcpy(b.data() + at, &v, 4);
}

}  // namespace

TEST_CASE("full-cache forward matches a plain llama2.c forward", "[llama2c]") {
  for (bool shared : {true, false}) {
    Tiny c;
    c.shared = shared;
    const TinyWeights w = make_weights(c, shared ? 1u : 2u);
    const TempFile f(serialize(w));
    auto model = std::make_shared<const Model>(Model::load(f.path.string()));
    CHECK(model->config().shared_classifier == shared);
    CHECK(model->config().vocab_size == c.vocab);
    Transformer<policies::FullCache> tf(model, Budget::unbounded());
    Reference ref(w);
    const auto tokens = random_tokens(c.seq_len, c.vocab, 7);
    double worst = 0.0;
    for (int pos = 0; pos < c.seq_len; ++pos) {
      const auto got = tf.forward(tokens[static_cast<std::size_t>(pos)], pos);
      const auto want =
          ref.forward(tokens[static_cast<std::size_t>(pos)], pos, [](int, int) { return true; });
      worst = std::max(worst, max_abs_diff(got, want));
    }
    INFO("shared classifier " << shared);
    CHECK(worst < 2e-4);
    CHECK(tf.cache().size(0, 0) == static_cast<std::size_t>(c.seq_len));
  }
}

TEST_CASE("StreamingLLM eviction equals attending to sinks plus the recent window", "[llama2c]") {
  // Rows keep their original positions, so the evicting engine must equal a full forward
  // whose attention is masked to the same rows: this checks RoPE-before-store and GQA.
  Tiny c;
  const TinyWeights w = make_weights(c, 3);
  auto model = std::make_shared<const Model>(Model::parse(serialize(w)));
  const std::size_t sinks = 2, budget = 9;
  Transformer<policies::StreamingLLM> tf(model, Budget::uniform(budget),
                                         policies::StreamingLLM{sinks});
  Reference ref(w);
  const auto tokens = random_tokens(c.seq_len, c.vocab, 11);
  double worst = 0.0, moved = 0.0;
  Reference full(w);
  for (int pos = 0; pos < c.seq_len; ++pos) {
    const int tok = tokens[static_cast<std::size_t>(pos)];
    const auto got = tf.forward(tok, pos);
    const auto want = ref.forward(tok, pos, [&](int j, int t) {
      return j < static_cast<int>(sinks) || j > t - static_cast<int>(budget - sinks);
    });
    const auto unmasked = full.forward(tok, pos, [](int, int) { return true; });
    worst = std::max(worst, max_abs_diff(got, want));
    moved = std::max(moved, max_abs_diff(got, unmasked));
  }
  CHECK(worst < 2e-4);
  CHECK(moved > 1e-2);  // eviction really changed the logits
  CHECK(tf.cache().size(1, 1) == budget);
}

TEST_CASE("checkpoint reader rejects truncated and corrupt files with clear messages",
          "[llama2c]") {
  Tiny c;
  const auto good = serialize(make_weights(c, 4));
  REQUIRE(error_of(good).empty());
  using Catch::Matchers::Contains;

  auto cut = good;
  cut.resize(cut.size() - 4);
  CHECK_THAT(error_of(cut), Contains("tiny.bin") && Contains("truncated") &&
                                Contains(std::to_string(good.size())));
  auto longer = good;
  longer.push_back(0);
  CHECK_THAT(error_of(longer), Contains("trailing bytes"));
  CHECK_THAT(error_of(std::vector<char>(good.begin(), good.begin() + 20)),
             Contains("20 bytes") && Contains("header"));

  auto bad = good;
  put_int(bad, 0, 0);
  CHECK_THAT(error_of(bad), Contains("dim = 0"));
  bad = good;
  put_int(bad, 12, 5);  // n_heads 5 does not divide dim 16
  CHECK_THAT(error_of(bad), Contains("not a multiple of n_heads = 5"));
  bad = good;
  put_int(bad, 16, 3);  // n_kv_heads 3 does not divide n_heads 4
  CHECK_THAT(error_of(bad), Contains("n_kv_heads = 3"));
  bad = good;
  put_int(bad, 20, 0);
  CHECK_THAT(error_of(bad), Contains("vocab_size = 0"));
  bad = good;
  put_int(bad, 20, -c.vocab);  // claims an unshared classifier the file does not hold
  CHECK_THAT(error_of(bad), Contains("truncated"));
  bad = good;
  put_int(bad, 24, -3);
  CHECK_THAT(error_of(bad), Contains("seq_len = -3"));
  bad = good;
  put_int(bad, 8, 1 << 30);
  CHECK_THAT(error_of(bad), Contains("n_layers = 1073741824"));
  bad = good;
  put_int(bad, 0, 0x616b3432);
  CHECK_THAT(error_of(bad), Contains("version-1/2"));
  bad = good;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad.data() + 28 + 4 * 5, &nan, 4);
  CHECK_THAT(error_of(bad), Contains("weight float 5") && Contains("finite"));
  CHECK_THROWS_WITH(Model::load("/nonexistent/kvevict.bin"), Contains("cannot open"));
}

namespace {
std::vector<char> tokenizer_file(const std::vector<std::pair<std::string, float>>& vocab) {
  std::vector<char> b(4);
  put_int(b, 0, 8);
  for (const auto& [piece, score] : vocab) {
    const auto at = b.size();
    b.resize(at + 8);
    std::memcpy(b.data() + at, &score, 4);
    put_int(b, at + 4, static_cast<std::int32_t>(piece.size()));
    b.insert(b.end(), piece.begin(), piece.end());
  }
  return b;
}
}  // namespace

TEST_CASE("tokenizer decodes llama2.c's way, encodes by score, rejects bad files", "[llama2c]") {
  // ids 0..2 specials, 3..5 bytes <0x00>.. as llama2.c's byte fallback, then pieces.
  std::vector<std::pair<std::string, float>> v = {
      {"<unk>", 0}, {"<s>", 0}, {"</s>", 0}, {"<0x0A>", 0}, {"<0x01>", 0}, {"<0x02>", 0},
      {" ", -1},    {"a", -1},  {"b", -1},   {" a", -0.5f}, {"ab", -0.1f}, {" ab", 2.0f}};
  const auto bytes = tokenizer_file(v);
  const Tokenizer tok = Tokenizer::parse(bytes, static_cast<int>(v.size()));
  CHECK(tok.decode(Tokenizer::kBos, 11) == "ab");  // leading space dropped after BOS
  CHECK(tok.decode(7, 11) == " ab");
  CHECK(tok.decode(7, 3) == "\n");
  // " ab": " a" (-0.5) vs "ab" (-0.1) first, then " " + "ab" -> " ab".
  CHECK(tok.encode("ab", true, false) == std::vector<int>{1, 11});
  CHECK(tok.encode("ba", false, true) == std::vector<int>{6, 8, 7, 2});
  CHECK_THROWS_WITH(tok.decode(0, 99), Catch::Matchers::Contains("token = 99"));

  auto cut = bytes;
  cut.resize(cut.size() - 1);
  CHECK_THROWS_WITH(Tokenizer::parse(cut, static_cast<int>(v.size()), "t.bin"),
                    Catch::Matchers::Contains("t.bin") && Catch::Matchers::Contains("truncated"));
  CHECK_THROWS_WITH(Tokenizer::parse(bytes, static_cast<int>(v.size()) - 1),
                    Catch::Matchers::Contains("trailing bytes"));
  auto bad = bytes;
  put_int(bad, 4 + 4, 100);  // first token claims 100 bytes > max_token_length 8
  CHECK_THROWS_WITH(Tokenizer::parse(bad, static_cast<int>(v.size())),
                    Catch::Matchers::Contains("length 100"));
}

TEST_CASE("the engine hands attention probabilities to policies that ask for them", "[llama2c]") {
  // Without eviction every step adds one unit of probability per query head, so H2O's
  // accumulated scores of a head sum to steps x group.
  Tiny c;
  auto model = std::make_shared<const Model>(Model::parse(serialize(make_weights(c, 6))));
  const int steps = 20;
  Transformer<policies::H2O> tf(model, Budget::uniform(steps),
                                policies::H2O(policies::H2O::Config{4, 0}));
  const auto tokens = random_tokens(steps, c.vocab, 13);
  for (int pos = 0; pos < steps; ++pos) tf.forward(tokens[static_cast<std::size_t>(pos)], pos);
  const int group = c.heads / c.kv_heads;
  for (int l = 0; l < c.layers; ++l)
    for (int h = 0; h < c.kv_heads; ++h) {
      double sum = 0.0;
      for (float x : tf.cache().policy().scores(l, h)) sum += x;
      CHECK(sum == Approx(steps * group).epsilon(1e-4));
    }
}

TEST_CASE("e2e protocol: KL is 0 for the full cache and positive under eviction", "[llama2c]") {
  Tiny c;
  auto model = std::make_shared<const Model>(Model::parse(serialize(make_weights(c, 5))));
  std::vector<Stream> streams;
  for (std::uint64_t s = 0; s < 2; ++s)
    streams.push_back(sample_stream(model, SampleOptions{c.seq_len, 1.0f, s}));
  REQUIRE(streams[0].size() == static_cast<std::size_t>(c.seq_len));
  CHECK(streams[0].tokens != streams[1].tokens);
  CHECK(sample_stream(model, SampleOptions{c.seq_len, 1.0f, 0}).tokens == streams[0].tokens);
  // Re-scoring a stream's own tokens with the full cache gives back its logits exactly.
  const Stream again = reference_stream(model, streams[1].tokens);
  CHECK(again.full_logits == streams[1].full_logits);

  // Greedy streams follow the full cache's argmax.
  const Stream greedy = sample_stream(model, SampleOptions{20, 0.0f, 0});
  for (std::size_t t = 0; t + 1 < greedy.size(); ++t)
    CHECK(greedy.tokens[t + 1] == static_cast<int>(metrics::argmax(greedy.logits(t))));
  // A tiny nucleus holds only the most likely token: top-p sampling becomes greedy.
  SampleOptions nucleus{20, 1.0f, 3};
  nucleus.top_p = 1e-6f;
  CHECK(sample_stream(model, nucleus).tokens == greedy.tokens);
  nucleus.top_p = 0.9f;
  CHECK(sample_stream(model, nucleus).tokens != greedy.tokens);

  const Summary full =
      evaluate(model, std::span<const Stream>(streams), Budget::unbounded(), policies::FullCache{});
  CHECK(full.mean_kl == 0.0);
  CHECK(full.top1 == 1.0);
  CHECK(full.perplexity == Approx(full.perplexity_full));
  CHECK(full.positions == 2 * static_cast<std::size_t>(c.seq_len));

  const std::size_t budget = 8;
  const auto r = run_stream(model, streams[0], Budget::uniform(budget), policies::StreamingLLM{2});
  for (std::size_t t = 0; t < budget; ++t) CHECK(r.kl[t] == 0.0);  // nothing evicted yet
  const Summary sl = evaluate(model, std::span<const Stream>(streams), Budget::uniform(budget),
                              policies::StreamingLLM{2});
  CHECK(sl.mean_kl > 1e-3);
  CHECK(sl.top1 < 1.0);
  CHECK(sl.perplexity_full == Approx(full.perplexity_full));

  // skip drops leading positions from the means.
  const Summary skipped = evaluate(model, std::span<const Stream>(streams), Budget::uniform(budget),
                                   policies::StreamingLLM{2}, ProtocolOptions{budget});
  CHECK(skipped.positions == 2 * (static_cast<std::size_t>(c.seq_len) - budget));
  CHECK(skipped.mean_kl > sl.mean_kl);

  // The other baselines run through the same path; an Oracle that sees every row is exact.
  CHECK(evaluate(model, std::span<const Stream>(streams), Budget::uniform(budget),
                 policies::H2O(policies::H2O::Config{4, 0}))
            .mean_kl > 0.0);
  CHECK(evaluate(model, std::span<const Stream>(streams), Budget::uniform(budget),
                 policies::Random(policies::Random::Config{1, 1, 1}))
            .mean_kl > 0.0);
  CHECK(evaluate(model, std::span<const Stream>(streams), Budget::unbounded(),
                 policies::Oracle{static_cast<std::size_t>(c.seq_len)})
            .mean_kl < 1e-9);
  CHECK(evaluate(model, std::span<const Stream>(streams), Budget::unbounded(),
                 policies::Oracle{budget})
            .mean_kl > 0.0);

  CHECK_THROWS_WITH(sample_stream(model, SampleOptions{c.seq_len + 1, 1.0f, 0}),
                    Catch::Matchers::Contains("seq_len"));
}

TEST_CASE("e2e protocol: a prompt prefilled in blocks scores like token by token; a selecting "
          "prefill attends over held rows plus the block",
          "[llama2c]") {
  Tiny c;
  auto model = std::make_shared<const Model>(Model::parse(serialize(make_weights(c, 5))));
  const Stream s = sample_stream(model, SampleOptions{c.seq_len, 1.0f, 4});
  ProtocolOptions blocked;
  blocked.prefill = 40;  // of 48 tokens, in blocks of 7 (the last one short)
  blocked.prefill_block = 7;
  auto same = [&](const StreamResult& a, const StreamResult& b) {
    REQUIRE(a.kl.size() == b.kl.size());
    REQUIRE(a.nll.size() == b.nll.size());
    double worst = 0.0;
    for (std::size_t t = 0; t < a.kl.size(); ++t) worst = std::max(worst, std::abs(a.kl[t] - b.kl[t]));
    for (std::size_t t = 0; t < a.nll.size(); ++t)
      worst = std::max(worst, std::abs(a.nll[t] - b.nll[t]));
    CHECK(worst <= 1e-4);
    return worst;
  };
  const std::size_t budget = 8;
  // The full cache: KL stays ~0 (float rounding of the block's matrix products only).
  const auto full = run_stream(model, s, Budget::unbounded(), policies::FullCache{}, blocked);
  for (double kl : full.kl) CHECK(kl < 1e-6);
  same(run_stream(model, s, Budget::uniform(budget), policies::StreamingLLM{2}),
       run_stream(model, s, Budget::uniform(budget), policies::StreamingLLM{2}, blocked));
  // Policies that read attention (H2O) or draw per (layer, head) generators (Random)
  // evict the same rows, so the figures agree too.
  const auto h2o = policies::H2O(policies::H2O::Config{4, 0});
  const auto a = run_stream(model, s, Budget::uniform(budget), h2o);
  CHECK(same(a, run_stream(model, s, Budget::uniform(budget), h2o, blocked)) < 1e-4);
  CHECK(summarize(std::span<const StreamResult>(&a, 1)).mean_kl > 1e-3);  // evictions matter
  const auto rnd = policies::Random(policies::Random::Config{1, 1, 1});
  same(run_stream(model, s, Budget::uniform(budget), rnd),
       run_stream(model, s, Budget::uniform(budget), rnd, blocked));
  // A prompt longer than the stream is the whole stream; a block of 0 tokens is refused.
  ProtocolOptions all = blocked;
  all.prefill = 1000;
  same(run_stream(model, s, Budget::uniform(budget), policies::StreamingLLM{2}),
       run_stream(model, s, Budget::uniform(budget), policies::StreamingLLM{2}, all));
  all.prefill_block = 0;
  CHECK_THROWS_WITH(run_stream(model, s, Budget::uniform(budget), policies::StreamingLLM{2}, all),
                    Catch::Matchers::Contains("prefill_block = 0"));

  // The selecting prefill (chunked prefill as an engine runs it): each block attends over
  // the held rows plus the block, then goes to the cache in one prefill.
  ProtocolOptions select = blocked;
  select.prefill_select = true;
  // Nothing evicted: the block's full attention over held rows + the block is what
  // token-by-token attention computes, up to float rounding.
  const auto full_select = run_stream(model, s, Budget::unbounded(), policies::FullCache{}, select);
  for (double kl : full_select.kl) CHECK(kl < 1e-6);
  // SnapKV within a budget: selects after each block, never holds more than the budget,
  // and differs from its decode rule alone (first block only).
  const policies::SnapKV::Config sc{.window = 4, .kernel = 3};
  Transformer<policies::SnapKV> tf(model, Budget::uniform(12), policies::SnapKV(sc));
  tf.set_prefill_select(true);
  for (int at = 0; at < 40; at += 7) {
    const int n = std::min(7, 40 - at);
    tf.forward_block(std::span<const int>(s.tokens.data() + at, std::size_t(n)), at);
    for (int l = 0; l < c.layers; ++l)
      for (int h = 0; h < c.kv_heads; ++h) REQUIRE(tf.cache().size(l, h) <= 12);
  }
  REQUIRE(tf.cache().size(0, 0) == 12);
  const auto re = run_stream(model, s, Budget::uniform(12), policies::SnapKV(sc), select);
  policies::SnapKV::Config first = sc;
  first.chunked = policies::ChunkedPrefill::first_chunk;
  const auto fc = run_stream(model, s, Budget::uniform(12), policies::SnapKV(first), select);
  REQUIRE(re.kl.size() == fc.kl.size());
  CHECK(re.kl != fc.kl);
  Transformer<policies::StreamingLLM> reindexed(model, Budget::uniform(12), policies::StreamingLLM{2},
                                                Positions::reindex);
  CHECK_THROWS_WITH(reindexed.set_prefill_select(true), Catch::Matchers::Contains("Positions::keep"));
}

TEST_CASE("e2e protocol: a compact stream (hidden states) gives the same logits and figures",
          "[llama2c]") {
  Tiny c;
  c.vocab = 96;  // more logits than hidden floats per token, as in real models
  auto model = std::make_shared<const Model>(Model::parse(serialize(make_weights(c, 6))));
  SampleOptions o{c.seq_len, 1.0f, 9};
  const Stream full = sample_stream(model, o);
  o.keep_logits = false;
  const Stream compact = sample_stream(model, o);
  REQUIRE(compact.compact());
  CHECK_FALSE(full.compact());
  CHECK(compact.full_logits.empty());
  CHECK(compact.full_hidden.size() == full.size() * static_cast<std::size_t>(c.dim));
  CHECK(compact.floats_per_token() == static_cast<std::size_t>(c.dim));
  CHECK(compact.tokens == full.tokens);  // the same draws: the logits were the same
  for (std::size_t t = 0; t < full.size(); ++t) {
    const auto a = full.logits(t);
    const auto b = compact.logits(t);
    REQUIRE(b.size() == a.size());
    CHECK(std::equal(a.begin(), a.end(), b.begin()));  // bit for bit
  }
  ProtocolOptions blocked;
  blocked.prefill = 20;
  blocked.prefill_block = 8;
  const auto h2o = policies::H2O(policies::H2O::Config{4, 0});
  const auto a = run_stream(model, full, Budget::uniform(8), h2o, blocked);
  const auto b = run_stream(model, compact, Budget::uniform(8), h2o, blocked);
  CHECK(a.kl == b.kl);
  CHECK(a.nll == b.nll);
  CHECK(a.nll_full == b.nll_full);
  // Another model cannot score a compact stream (its logits come from the stream's model).
  auto other = std::make_shared<const Model>(Model::parse(serialize(make_weights(c, 7))));
  CHECK_THROWS_WITH(run_stream(other, compact, Budget::uniform(8), h2o),
                    Catch::Matchers::Contains("same model"));
}

TEST_CASE("positions re-indexed inside the cache, past seq_len only with a bounded cache",
          "[llama2c]") {
  Tiny c;
  const TinyWeights w = make_weights(c, 5);
  auto model = std::make_shared<const Model>(Model::parse(serialize(w)));
  const auto tokens = random_tokens(3 * c.seq_len, c.vocab, 13);
  // Nothing evicted: ranks equal positions, so re-indexing changes nothing.
  Transformer<policies::FullCache> reindex(model, Budget::unbounded(), {}, Positions::reindex);
  double worst = 0.0;
  Transformer<policies::FullCache> keep2(model, Budget::unbounded());
  for (int pos = 0; pos < c.seq_len; ++pos) {
    const int tok = tokens[static_cast<std::size_t>(pos)];
    const auto k = keep2.forward(tok, pos);
    const std::vector<float> kv(k.begin(), k.end());
    worst = std::max(worst, max_abs_diff(reindex.forward(tok, pos), kv));
  }
  CHECK(worst < 1e-5);
  // The full cache stops at the checkpoint's positions, naming the limit.
  CHECK_THROWS_WITH(keep2.forward(tokens[0], c.seq_len),
                    Catch::Matchers::Contains("seq_len = 48"));
  // A bounded cache runs on in both modes; re-indexed rows differ from kept positions.
  for (Positions mode : {Positions::keep, Positions::reindex}) {
    Transformer<policies::StreamingLLM> tf(model, Budget::uniform(12), policies::StreamingLLM{2},
                                           mode);
    bool finite = true;
    for (int pos = 0; pos < 3 * c.seq_len; ++pos)
      for (float x : tf.forward(tokens[static_cast<std::size_t>(pos)], pos))
        finite = finite && std::isfinite(x);
    CHECK(finite);
    CHECK(tf.cache().size(0, 0) == 12);
    CHECK(tf.cache().positions(0, 0).size() == 12);
  }
  Transformer<policies::StreamingLLM> a(model, Budget::uniform(12), policies::StreamingLLM{2});
  Transformer<policies::StreamingLLM> b(model, Budget::uniform(12), policies::StreamingLLM{2},
                                        Positions::reindex);
  double differ = 0.0;
  for (int pos = 0; pos < c.seq_len; ++pos) {
    const int tok = tokens[static_cast<std::size_t>(pos)];
    const auto x = a.forward(tok, pos);
    const std::vector<float> xv(x.begin(), x.end());
    differ = std::max(differ, max_abs_diff(b.forward(tok, pos), xv));
  }
  CHECK(differ > 1e-3);  // after eviction the rotations differ
}

TEST_CASE("a directory given as a checkpoint or tokenizer is named in the error") {
  using Catch::Matchers::Contains;
  const std::string dir = std::filesystem::temp_directory_path().string();
  CHECK_THROWS_AS(Model::load(dir), kvevict::Error);
  CHECK_THROWS_WITH(Model::load(dir), Contains("'" + dir + "': is a directory, expected a file"));
  CHECK_THROWS_WITH(Tokenizer::load(dir, 32), Contains("'" + dir + "': is a directory"));
}
