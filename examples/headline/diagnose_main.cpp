// llama2c_diagnose: where each policy loses attention mass on a llama2.c checkpoint
// (stories260K in docs/quality.md), and how well SimHash ranks keys at head dim 8 (the
// model) against head dim 128 (kvevict-eval's synthetic workloads).
//
// "Mass lost" at step t, layer l, KV head h: the full-cache model's attention probability
// (mean over the G query heads of the group) on the positions the policy's cache does not
// hold (for the Oracle: does not attend) after the policy has processed the same tokens
// 0..t. It is measured against the full model's attention, not the policy's own, so it
// does not depend on how the policy's past diverged. Means are over every step of every
// stream (steps before the cache fills lose nothing and count), layers and KV heads.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli.hpp"
#include "e2e.hpp"
#include "kvevict/kvevict.hpp"
#include "hf.hpp"
#include "llama2c.hpp"
#include "policy_registry.hpp"
#include "workloads.hpp"

namespace {

using namespace kvevict;
using namespace kvevict::llama2c;

// Age buckets: age 0, 1, 2-3, 4-7, ..., 256-511 (bit width of the age), and position 0
// (the sink) on its own, since its age grows with t and it draws a large share.
constexpr int kAgeBuckets = 10;
constexpr int kSink = kAgeBuckets;
constexpr int kBuckets = kAgeBuckets + 1;
constexpr const char* kBucketNames[kBuckets] = {
    "0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128-255", "256-511", "pos 0"};

int bucket_of(int t, int pos) {
  if (pos == 0) return kSink;
  const auto age = static_cast<unsigned>(t - pos);
  return std::min(kAgeBuckets - 1, static_cast<int>(std::bit_width(age)));
}

struct Args {
  std::string model_dir;
  int streams = 16;
  std::uint64_t seed = 1000;
  std::string csv;
  bool synthetic = true;
  int hash_stride = 4;  // sample every n-th step for the SimHash ranking
  std::vector<std::string> policies;  // registry names instead of the built-in list
  std::vector<std::size_t> budgets{16, 32, 64, 128};
  int tokens = 0;  ///< T; 0: min(max positions, 512)
};

// nullopt: exit 0 (--help, --list).
std::optional<Args> parse(int argc, char** argv) {
  using kvevict::cli::Range;
  Args a;
  if (const char* env = std::getenv("KVEVICT_MODEL_DIR")) a.model_dir = env;
  bool no_synthetic = false;
  kvevict::cli::Parser p("llama2c_diagnose",
                         "Where each policy loses attention mass on a llama2.c checkpoint (per "
                         "layer, KV head and token age), and SimHash ranking quality.");
  p.text("--model-dir", "DIR", "model directory (default $KVEVICT_MODEL_DIR, else the shared "
         "stories260K)", a.model_dir);
  p.number("--streams", "N", "streams sampled", a.streams, Range<int>{1, 100000});
  p.number("--seed", "S", "seed of stream 0", a.seed, Range<std::uint64_t>{0});
  p.text("--csv", "FILE", "long-form CSV for the plots", a.csv);
  p.flag("--no-synthetic", "skip the synthetic SimHash comparison", no_synthetic);
  p.number("--tokens", "T",
           "stream length (default min(512, the model's seq_len / max_position_embeddings); "
           "up to that limit; budgets stay in tokens). The full model's attention is held "
           "for the whole stream: T^2 / 2 x layers x KV heads floats",
           a.tokens, Range<int>{2, 1 << 24});
  p.number("--hash-stride", "N", "sample every N-th step for the SimHash ranking", a.hash_stride,
           Range<int>{1, 1 << 20});
  kvevict::registry::add_selection_options(
      p, a.policies, a.budgets,
      "registry policies to diagnose instead of the built-in list (labels = names; "
             "StreamingLLM 1 sink, H2O and Random recent B/4 as in the headline)");
  p.info("--list", "list the registry's policies, then exit",
         [] { fmt::print("policies:\n{}", kvevict::registry::listing()); });
  if (!p.parse(argc, argv)) return std::nullopt;
  a.synthetic = !no_synthetic;
  if (a.model_dir.empty()) a.model_dir = KVEVICT_DEFAULT_MODEL_DIR;
  return a;
}

// ---------------------------------------------------------------------------------------
// Long-form CSV (section, policy, budget, layer, head, bucket, value) for the plots.
struct Csv {
  std::FILE* f = nullptr;
  explicit Csv(const std::string& path) {
    if (path.empty()) return;
    f = std::fopen(path.c_str(), "w");
    kvevict::detail::require(f != nullptr, "--csv ", path, ": cannot open for writing");
    fmt::print(f, "section,policy,budget,layer,head,bucket,value\n");
  }
  ~Csv() {
    if (f) std::fclose(f);
  }
  Csv(const Csv&) = delete;
  Csv& operator=(const Csv&) = delete;
  void row(const char* section, const std::string& policy, int budget, int layer, int head,
           const std::string& bucket, double value) const {
    if (f)
      fmt::print(f, "{},\"{}\",{},{},{},{},{:.6g}\n", section, policy, budget, layer, head,
                   bucket, value);
  }
};

// ---------------------------------------------------------------------------------------
// The full model's attention of one stream: for each step t, layer l and KV head h, the
// group-mean probability of every position 0..t.
struct Reference {
  int layers = 0, kv_heads = 0;
  std::vector<std::vector<float>> p;  // [(t * layers + l) * kv_heads + h][pos]
  const std::vector<float>& at(int t, int l, int h) const {
    return p[static_cast<std::size_t>((t * layers + l) * kv_heads + h)];
  }
};

// Statistics of one ranking (a score per cached row against the true q.k) summed over
// samples: Spearman correlation and the mass kept by the top quarter of rows.
struct RankStats {
  double spearman = 0.0, top_mass = 0.0;
  std::size_t n = 0;
  void add(double s, double m) {
    spearman += s;
    top_mass += m;
    ++n;
  }
  [[nodiscard]] double mean_spearman() const { return n ? spearman / static_cast<double>(n) : 0; }
  [[nodiscard]] double mean_mass() const { return n ? top_mass / static_cast<double>(n) : 0; }
};

constexpr int kBits[] = {8, 16, 32, 64};
constexpr int kNumBits = 4;
// Score kinds: -Hamming(query code, key code) for each b, -Hamming(incoming key code, key
// code) for each b, the exact cosine (SimHash's b -> infinity limit), the true q.k.
struct HashStudy {
  RankStats query[kNumBits], key[kNumBits], cosine, exact, recency;
};

void average_ranks(const std::vector<double>& x, std::vector<double>& rank,
                   std::vector<std::uint32_t>& idx) {
  const std::size_t n = x.size();
  idx.resize(n);
  std::iota(idx.begin(), idx.end(), 0u);
  std::sort(idx.begin(), idx.end(), [&](std::uint32_t a, std::uint32_t b) { return x[a] < x[b]; });
  rank.resize(n);
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i;
    while (j + 1 < n && x[idx[j + 1]] == x[idx[i]]) ++j;
    const double r = 0.5 * static_cast<double>(i + j);
    for (std::size_t k = i; k <= j; ++k) rank[idx[k]] = r;
    i = j + 1;
  }
}

double pearson(const std::vector<double>& a, const std::vector<double>& b) {
  const double n = static_cast<double>(a.size());
  double ma = 0, mb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) ma += a[i], mb += b[i];
  ma /= n, mb /= n;
  double sab = 0, saa = 0, sbb = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

// Mass of the k rows with the highest score, ties at the threshold broken at random
// (their mass counted in expectation), so coarse Hamming scores are not flattered.
double top_k_mass(const std::vector<double>& score, const std::vector<double>& p, std::size_t k,
                  std::vector<std::uint32_t>& idx) {
  const std::size_t n = score.size();
  idx.resize(n);
  std::iota(idx.begin(), idx.end(), 0u);
  std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return score[a] > score[b]; });
  const double thr = score[idx[k - 1]];
  double above = 0, tied = 0;
  std::size_t n_above = 0, n_tied = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (score[i] > thr) above += p[i], ++n_above;
    if (score[i] == thr) tied += p[i], ++n_tied;
  }
  return above + tied * static_cast<double>(k - n_above) / static_cast<double>(n_tied);
}

// One sample: a query q (d floats), the incoming key kin, and the n cached keys (rows of
// `keys`, n x d) with their 64-bit codes. Adds every ranking's statistics to `hs`.
struct Scratch {
  std::vector<double> dot, p, score, r_true, r_score;
  std::vector<std::uint32_t> idx;
};

void study_sample(const float* q, std::uint64_t qcode, std::uint64_t kcode, const float* keys,
                  const std::uint64_t* codes, std::size_t n, int d, HashStudy& hs, Scratch& s) {
  if (n < 8) return;
  s.dot.resize(n);
  s.p.resize(n);
  double qn = 0;
  for (int i = 0; i < d; ++i) qn += static_cast<double>(q[i]) * q[i];
  qn = std::sqrt(qn);
  std::vector<double> cosv(n);
  double m = -1e300;
  for (std::size_t r = 0; r < n; ++r) {
    double dot = 0, kn = 0;
    for (int i = 0; i < d; ++i) {
      dot += static_cast<double>(q[i]) * keys[r * static_cast<std::size_t>(d) + i];
      kn += static_cast<double>(keys[r * static_cast<std::size_t>(d) + i]) *
            keys[r * static_cast<std::size_t>(d) + i];
    }
    s.dot[r] = dot;
    cosv[r] = qn > 0 && kn > 0 ? dot / (qn * std::sqrt(kn)) : 0.0;
    m = std::max(m, dot / std::sqrt(static_cast<double>(d)));
  }
  double z = 0;
  for (std::size_t r = 0; r < n; ++r)
    z += s.p[r] = std::exp(s.dot[r] / std::sqrt(static_cast<double>(d)) - m);
  for (double& x : s.p) x /= z;
  const std::size_t k = std::max<std::size_t>(1, n / 4);
  average_ranks(s.dot, s.r_true, s.idx);
  auto add = [&](RankStats& st, const std::vector<double>& score) {
    average_ranks(score, s.r_score, s.idx);
    st.add(pearson(s.r_true, s.r_score), top_k_mass(score, s.p, k, s.idx));
  };
  add(hs.exact, s.dot);
  add(hs.cosine, cosv);
  // A window's ranking: the most recent rows first (rows are in arrival order here).
  s.score.resize(n);
  for (std::size_t r = 0; r < n; ++r) s.score[r] = static_cast<double>(r);
  add(hs.recency, s.score);
  s.score.resize(n);
  for (int b = 0; b < kNumBits; ++b) {
    const std::uint64_t mask = kBits[b] == 64 ? ~0ULL : ((1ULL << kBits[b]) - 1);
    for (std::size_t r = 0; r < n; ++r)
      s.score[r] = -static_cast<double>(std::popcount((qcode ^ codes[r]) & mask));
    add(hs.query[b], s.score);
    for (std::size_t r = 0; r < n; ++r)
      s.score[r] = -static_cast<double>(std::popcount((kcode ^ codes[r]) & mask));
    add(hs.key[b], s.score);
  }
}

std::uint64_t code64(const kernels::SimHashProjection& proj, const float* x) {
  std::uint8_t bytes[8];
  proj.hash_one(x, bytes);
  std::uint64_t c = 0;
  for (int i = 0; i < 8; ++i) c |= static_cast<std::uint64_t>(bytes[i]) << (8 * i);
  return c;
}

// HashEvict's projection of `layer`: a 64-bit draw from the policy's default seed; its
// first b columns are exactly the b-bit projection the policy builds (same seed, same order).
kernels::SimHashProjection layer_projection(int dim, int layer) {
  using HE = policies::HashEvictSimHash<policies::HashMode::key>;
  return kernels::SimHashProjection(dim, 64, HE::layer_seed(HE::Config{}.seed, layer));
}

// ---------------------------------------------------------------------------------------
// Per-policy accumulators over every stream at one budget.
struct Acc {
  std::vector<double> lost_lh;        // [l * H + h]: mass lost, summed over steps
  double lost_bucket[kBuckets] = {};  // summed over steps, layers, heads
  double kept_bucket[kBuckets] = {};  // rows held, summed over full-cache steps x l x h
  double kept_age_sum = 0;            // age of held non-sink rows, same samples
  double kept_rows = 0, full_samples = 0;
  double severe = 0;  // samples that lose more than half of the mass
  double kl = 0;
  std::size_t steps = 0;  // token steps (each counts L x H samples in lost_*)
};

struct Study {
  std::shared_ptr<const Model> model;
  int L = 0, H = 0, T = 0;
  std::vector<std::size_t> budgets{16, 32, 64, 128};
  std::vector<std::string> names;
  std::vector<std::vector<Acc>> acc;     // [policy][budget]
  std::vector<std::array<double, kBuckets>> full_bucket;  // full model's mass by age, per layer
  std::size_t full_steps = 0;
  HashStudy hash;
  std::string progress_label;  ///< what the progress line (T > 512, a terminal) says

  Acc& slot(const std::string& name, std::size_t bi) {
    auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
      names.push_back(name);
      acc.emplace_back(budgets.size());
      for (auto& a : acc.back()) a.lost_lh.assign(static_cast<std::size_t>(L * H), 0.0);
      it = names.end() - 1;
    }
    return acc[static_cast<std::size_t>(it - names.begin())][bi];
  }

  // Adds one (t, l, h) sample: `held[pos]` says whether the policy holds position pos.
  void add_sample(Acc& a, const Reference& ref, int t, int l, int h, const std::vector<char>& held,
                  std::size_t budget) const {
    const auto& p = ref.at(t, l, h);
    double lost = 0;
    for (int pos = 0; pos <= t; ++pos) {
      if (held[static_cast<std::size_t>(pos)]) continue;
      lost += p[static_cast<std::size_t>(pos)];
      a.lost_bucket[bucket_of(t, pos)] += p[static_cast<std::size_t>(pos)];
    }
    a.lost_lh[static_cast<std::size_t>(l * H + h)] += lost;
    if (lost > 0.5) a.severe += 1;
    if (static_cast<std::size_t>(t) + 1 >= budget) {
      a.full_samples += 1;
      for (int pos = 0; pos <= t; ++pos) {
        if (!held[static_cast<std::size_t>(pos)]) continue;
        a.kept_bucket[bucket_of(t, pos)] += 1;
        a.kept_rows += 1;
        if (pos > 0) a.kept_age_sum += t - pos;
      }
    }
  }

  template <class Policy>
  void run(const std::string& name, std::size_t bi, const Stream& s, const Reference& ref,
           Policy policy, bool unbounded = false) {
    const std::size_t B = budgets[bi];
    run(name, bi, s, ref, std::move(policy),
        unbounded ? Budget::unbounded() : Budget::uniform(static_cast<long long>(B)));
  }
  template <class Policy>
  void run(const std::string& name, std::size_t bi, const Stream& s, const Reference& ref,
           Policy policy, const Budget& budget) {
    const std::size_t B = budgets[bi];
    Acc& a = slot(name, bi);
    progress_label = fmt::format("{} at {} rows:", name, B);
    Transformer<Policy> tf(model, budget, std::move(policy));
    int t = 0;
    std::vector<char> held;
    tf.set_attention_observer([&](int l, std::span<const float>, const AttentionResult& att) {
      for (int h = 0; h < H; ++h) {
        const auto pos = tf.cache().positions(l, h);
        const auto& pr = att.probs[static_cast<std::size_t>(h)];
        held.assign(static_cast<std::size_t>(t) + 1, 0);
        // The Oracle stores every row and attends only its top B: those are what it holds.
        const bool restricted = kvevict::detail::RestrictsAttention<Policy> && pos.size() > B;
        for (std::size_t r = 0; r < pos.size(); ++r) {
          if (restricted && pr.col(static_cast<Eigen::Index>(r)).maxCoeff() <= 0.0f) continue;
          held[static_cast<std::size_t>(pos[r])] = 1;
        }
        add_sample(a, ref, t, l, h, held, B);
      }
    });
    for (t = 0; t < static_cast<int>(s.size()); ++t) {
      llama2c::detail::progress(progress_label.c_str(), static_cast<std::size_t>(t), s.size());
      const auto logits = tf.forward(s.tokens[static_cast<std::size_t>(t)], t);
      a.kl += metrics::kl_divergence(s.logits(static_cast<std::size_t>(t)), logits);
      ++a.steps;
    }
  }

  // The per-step ideal: the B positions of largest full-model mass (no causal policy can
  // know them; the Oracle run approximates them with its own, diverged, queries).
  void ideal(std::size_t bi, const Reference& ref) {
    const std::size_t B = budgets[bi];
    Acc& a = slot("Top-B of full attention (ideal)", bi);
    std::vector<char> held;
    std::vector<std::uint32_t> idx;
    for (int t = 0; t < T; ++t) {
      for (int l = 0; l < L; ++l)
        for (int h = 0; h < H; ++h) {
          const auto& p = ref.at(t, l, h);
          const std::size_t n = static_cast<std::size_t>(t) + 1;
          held.assign(n, 1);
          if (n > B) {
            idx.resize(n);
            std::iota(idx.begin(), idx.end(), 0u);
            std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(B), idx.end(),
                             [&](std::uint32_t x, std::uint32_t y) { return p[x] > p[y]; });
            for (std::size_t i = B; i < n; ++i) held[idx[i]] = 0;
          }
          add_sample(a, ref, t, l, h, held, B);
        }
      ++a.steps;
    }
  }

  // Runs the full model over the stream, filling `ref`, the age profile of its attention
  // and the SimHash ranking study (every hash_stride-th step from t = 32).
  Reference reference(const Stream& s, int hash_stride) {
    Reference ref;
    ref.layers = L;
    ref.kv_heads = H;
    ref.p.resize(static_cast<std::size_t>(T * L * H));
    Transformer<policies::FullCache> tf(model, Budget::unbounded());
    progress_label = "full-cache reference:";
    const int G = model->config().n_heads / H, d = model->config().head_dim();
    std::vector<kernels::SimHashProjection> proj;
    for (int l = 0; l < L; ++l) proj.push_back(layer_projection(d, l));
    std::vector<std::uint64_t> codes;
    Scratch scratch;
    int t = 0;
    tf.set_attention_observer([&](int l, std::span<const float> q, const AttentionResult& att) {
      for (int h = 0; h < H; ++h) {
        const auto pos = tf.cache().positions(l, h);
        const auto& pr = att.probs[static_cast<std::size_t>(h)];
        auto& out = ref.p[static_cast<std::size_t>((t * L + l) * H + h)];
        out.assign(static_cast<std::size_t>(t) + 1, 0.0f);
        for (std::size_t r = 0; r < pos.size(); ++r) {
          const float m = pr.col(static_cast<Eigen::Index>(r)).mean();
          out[static_cast<std::size_t>(pos[r])] = m;
          full_bucket[static_cast<std::size_t>(l)]
                     [static_cast<std::size_t>(bucket_of(t, static_cast<int>(pos[r])))] += m;
        }
        if (t < 32 || t % hash_stride != 0) continue;
        // Rank the cached rows 0..t-1 (the incoming row t is always kept by every policy).
        const auto keys = tf.cache().keys(l, h);
        const std::size_t n = static_cast<std::size_t>(t);
        codes.resize(n + 1);
        for (std::size_t r = 0; r <= n; ++r)
          codes[r] = code64(proj[static_cast<std::size_t>(l)],
                            keys.data() + r * static_cast<std::size_t>(d));
        // FullCache keeps rows in arrival order, so row r is position r.
        for (int g = 0; g < G; ++g) {
          const float* qh = q.data() + static_cast<std::size_t>((h * G + g) * d);
          study_sample(qh, code64(proj[static_cast<std::size_t>(l)], qh), codes[n], keys.data(),
                       codes.data(), n, d, hash, scratch);
        }
      }
    });
    for (t = 0; t < static_cast<int>(s.size()); ++t) {
      llama2c::detail::progress(progress_label.c_str(), static_cast<std::size_t>(t), s.size());
      tf.forward(s.tokens[static_cast<std::size_t>(t)], t);
      ++full_steps;
    }
    return ref;
  }
};

// kvevict-eval's synthetic workloads (head dim 128): the same ranking study on the
// generated queries and keys, one sample every `stride` decode steps.
HashStudy synthetic_study(const std::string& workload, int stride) {
  eval::SyntheticConfig c;
  const eval::Workload w = eval::make_synthetic(workload, c);
  const Geometry& g = w.geometry;
  const int d = g.head_dim, G = g.group();
  HashStudy hs;
  Scratch scratch;
  std::vector<float> keys;
  std::vector<std::uint64_t> codes;
  for (int l = 0; l < g.n_layers; ++l) {
    const auto proj = layer_projection(d, l);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      keys.resize(w.tokens * static_cast<std::size_t>(d));
      codes.resize(w.tokens);
      for (std::size_t t = 0; t < w.tokens; ++t) {
        std::memcpy(keys.data() + t * static_cast<std::size_t>(d),
                    w.k(l, t) + static_cast<std::size_t>(h * d),
                    sizeof(float) * static_cast<std::size_t>(d));
        codes[t] = code64(proj, keys.data() + t * static_cast<std::size_t>(d));
      }
      for (std::size_t t = w.prompt; t < w.tokens; t += static_cast<std::size_t>(stride))
        for (int gi = 0; gi < G; ++gi) {
          const float* q = w.q(l, t) + static_cast<std::size_t>((h * G + gi) * d);
          study_sample(q, code64(proj, q), codes[t], keys.data(), codes.data(), t, d, hs, scratch);
        }
    }
  }
  return hs;
}

// ---------------------------------------------------------------------------------------
void print_hash_row(const char* label, const HashStudy& hs, const Csv& csv) {
  // Mass of the top quarter, as the share of the random -> exact-ranking gap it closes.
  const double exact = hs.exact.mean_mass();
  auto gap = [&](const RankStats& st) { return (st.mean_mass() - 0.25) / (exact - 0.25); };
  fmt::print("| {} | Spearman | ", label);
  for (int b = 0; b < kNumBits; ++b)
    fmt::print("{:.3f} / {:.3f} | ", hs.query[b].mean_spearman(), hs.key[b].mean_spearman());
  fmt::print("{:.3f} | {:.3f} |\n", hs.cosine.mean_spearman(), hs.recency.mean_spearman());
  fmt::print("| {} | top-1/4 mass, gap closed | ", label);
  for (int b = 0; b < kNumBits; ++b)
    fmt::print("{:.0f}% / {:.0f}% | ", 100 * gap(hs.query[b]), 100 * gap(hs.key[b]));
  fmt::print("{:.0f}% (exact q.k keeps {:.3f}) | {:.0f}% |\n", 100 * gap(hs.cosine), exact,
              100 * gap(hs.recency));
  for (int b = 0; b < kNumBits; ++b) {
    const std::string bits = std::to_string(kBits[b]);
    csv.row("hash_spearman", label, kBits[b], -1, -1, "query", hs.query[b].mean_spearman());
    csv.row("hash_spearman", label, kBits[b], -1, -1, "key", hs.key[b].mean_spearman());
    csv.row("hash_gap", label, kBits[b], -1, -1, "query", gap(hs.query[b]));
    csv.row("hash_gap", label, kBits[b], -1, -1, "key", gap(hs.key[b]));
  }
  csv.row("hash_spearman", label, 0, -1, -1, "cosine", hs.cosine.mean_spearman());
  csv.row("hash_gap", label, 0, -1, -1, "cosine", gap(hs.cosine));
  csv.row("hash_spearman", label, 0, -1, -1, "recency", hs.recency.mean_spearman());
  csv.row("hash_gap", label, 0, -1, -1, "recency", gap(hs.recency));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("llama2c_diagnose", [&] {
    const auto parsed = parse(argc, argv);
    if (!parsed) return 0;
    const Args& a = *parsed;
    const Csv csv(a.csv);
    Study st;
    st.budgets = a.budgets;
    st.model = std::make_shared<const Model>(load_model_dir(a.model_dir, "stories260K.bin"));
    std::string model_name = a.model_dir;  // the directory's last component
    while (model_name.size() > 1 && model_name.back() == '/') model_name.pop_back();
    if (const auto slash = model_name.rfind('/'); slash != std::string::npos)
      model_name.erase(0, slash + 1);
    const Config& c = st.model->config();
    st.L = c.n_layers;
    st.H = c.n_kv_heads;
    st.T = a.tokens > 0 ? a.tokens : std::min(c.seq_len, 512);  // stories260K: its whole seq_len
    if (st.T > c.seq_len)
      throw kvevict::cli::UsageError(fmt::format(
          "--tokens = {}: the model has {} positions (seq_len / max_position_embeddings)", st.T,
          c.seq_len));
    st.full_bucket.assign(static_cast<std::size_t>(st.L), {});
    // The reference holds every step's attention over every earlier position.
    const double ref_bytes = 0.5 * st.T * (st.T + 1.0) * st.L * st.H * sizeof(float);
    fmt::print(stderr, "llama2c_diagnose: {} streams of {} tokens; the full model's attention "
               "takes {:.1f} MB per stream\n", a.streams, st.T, ref_bytes / 1e6);
    // The age buckets end at 256-511; longer streams put every older row in the last one.
    const auto bucket_name = [&](int b) -> std::string {
      return b == kAgeBuckets - 1 && st.T > 512 ? "256+" : kBucketNames[b];
    };
    for (int i = 0; i < a.streams; ++i) {
      SampleOptions o;
      o.seed = a.seed + static_cast<std::uint64_t>(i);
      o.temperature = 1.0f;
      o.tokens = st.T;
      o.keep_logits = logits_fit(c, static_cast<std::size_t>(st.T), 1);
      const Stream s = sample_stream(st.model, o);
      const Reference ref = st.reference(s, a.hash_stride);
      for (std::size_t bi = 0; bi < st.budgets.size(); ++bi) {
        const std::size_t B = st.budgets[bi];
        if (!a.policies.empty()) {  // registry policies, the headline's knobs
          registry::Knobs k = registry::Knobs::reference_protocol();
          set_model_rope(k, st.model->config());
          for (const auto& name : a.policies)
            registry::with_policy(name, registry::Args{B, k, nullptr},
                                  [&](auto pol, const Budget& b) { st.run(name, bi, s, ref, pol, b); });
          st.ideal(bi, ref);
          continue;
        }
        st.run("StreamingLLM (1 sink)", bi, s, ref, policies::StreamingLLM{.sinks = 1});
        st.run("H2O (recent B/4)", bi, s, ref, policies::H2O({.recent = B / 4}));
        st.run("TOVA (decay 0, 1 sink)", bi, s, ref,
               policies::DecayedAttention({.decay = 0.0f, .sinks = 1}));
        st.run("DecayedAttention (h 3, f 1/2, no recall)", bi, s, ref,
               policies::DecayedAttention({.sinks = 1, .horizon = 3.0f, .recent_fraction = 0.5f}));
        st.run("DecayedAttention::recommended()", bi, s, ref,
               policies::DecayedAttention::recommended());
        st.run("HashEvict query", bi, s, ref,
               policies::HashEvictSimHash<policies::HashMode::query>{});
        st.run("HashEvict key", bi, s, ref, policies::HashEvictSimHash<policies::HashMode::key>{});
        st.run("BUZZ (budget mode)", bi, s, ref, policies::BuzzBeehive({.budget_mode = true}));
        st.run("Oracle (non-causal)", bi, s, ref, policies::Oracle{.rows = B}, true);
        st.ideal(bi, ref);
      }
      fmt::print(stderr, "  stream {} done\n", i);
    }
    const double samples_per_lh = static_cast<double>(st.full_steps);  // steps x streams
    fmt::print(
        "{}: {} streams (seeds {}..{}), T = {}, temperature 1; mass lost = "
        "full model's attention (mean of the group's query heads) on positions the "
        "policy does not hold, mean over every step, layer and KV head\n\n",
        model_name, a.streams, static_cast<unsigned long long>(a.seed),
        static_cast<unsigned long long>(a.seed + static_cast<std::uint64_t>(a.streams) - 1), st.T);

    // 1. Mass lost and KL per policy and budget.
    fmt::print("### Mass lost and streaming KL\n\n| policy |");
    for (auto B : st.budgets) fmt::print(" lost {} | KL {} |", B, B);
    fmt::print("\n|---|");
    for (std::size_t i = 0; i < st.budgets.size(); ++i) fmt::print("---|---|");
    fmt::print("\n");
    for (std::size_t p = 0; p < st.names.size(); ++p) {
      fmt::print("| {} |", st.names[p]);
      for (std::size_t bi = 0; bi < st.budgets.size(); ++bi) {
        const Acc& x = st.acc[p][bi];
        double lost = 0;
        for (double v : x.lost_lh) lost += v;
        lost /= samples_per_lh * st.L * st.H;
        const bool ideal = st.names[p].rfind("Top-B", 0) == 0;
        if (ideal)
          fmt::print(" {:.4f} | - |", lost);
        else
          fmt::print(" {:.4f} | {:.4f} |", lost, x.kl / static_cast<double>(x.steps));
        csv.row("lost", st.names[p], static_cast<int>(st.budgets[bi]), -1, -1, "all", lost);
        if (!ideal)
          csv.row("kl", st.names[p], static_cast<int>(st.budgets[bi]), -1, -1, "all",
                  x.kl / static_cast<double>(x.steps));
        for (int l = 0; l < st.L; ++l) {
          double ll = 0;
          for (int h = 0; h < st.H; ++h) {
            const double v = x.lost_lh[static_cast<std::size_t>(l * st.H + h)] / samples_per_lh;
            ll += v;
            csv.row("lost_lh", st.names[p], static_cast<int>(st.budgets[bi]), l, h, "all", v);
          }
          csv.row("lost_layer", st.names[p], static_cast<int>(st.budgets[bi]), l, -1, "all",
                  ll / st.H);
        }
        for (int b = 0; b < kBuckets; ++b) {
          csv.row("lost_age", st.names[p], static_cast<int>(st.budgets[bi]), -1, -1,
                  bucket_name(b), x.lost_bucket[b] / (samples_per_lh * st.L * st.H));
          csv.row("kept_age", st.names[p], static_cast<int>(st.budgets[bi]), -1, -1,
                  bucket_name(b), x.kept_bucket[b] / std::max(1.0, x.full_samples));
        }
      }
      fmt::print("\n");
    }

    // 1b. The tail: how often one (step, layer, KV head) loses more than half its mass.
    fmt::print(
        "\n### Share of (step, layer, KV head) samples losing more than half the mass\n\n"
        "| policy |");
    for (auto B : st.budgets) fmt::print(" {} |", B);
    fmt::print("\n|---|");
    for (std::size_t i = 0; i < st.budgets.size(); ++i) fmt::print("---|");
    fmt::print("\n");
    for (std::size_t p = 0; p < st.names.size(); ++p) {
      fmt::print("| {} |", st.names[p]);
      for (std::size_t bi = 0; bi < st.budgets.size(); ++bi) {
        const double v = st.acc[p][bi].severe / (samples_per_lh * st.L * st.H);
        fmt::print(" {:.4f} |", v);
        csv.row("severe", st.names[p], static_cast<int>(st.budgets[bi]), -1, -1, "all", v);
      }
      fmt::print("\n");
    }

    // 2. Where the full model's attention sits by age, per layer.
    fmt::print(
        "\n### Full model's attention mass by token age (mean over steps and KV heads)\n\n"
        "| layer |");
    for (int b = 0; b < kBuckets; ++b) fmt::print(" {} |", bucket_name(b));
    fmt::print("\n|---|");
    for (int b = 0; b < kBuckets; ++b) fmt::print("---|");
    fmt::print("\n");
    double all_bucket[kBuckets] = {};
    for (int l = 0; l <= st.L; ++l) {
      if (l < st.L)
        fmt::print("| {} |", l);
      else
        fmt::print("| all |");
      for (int b = 0; b < kBuckets; ++b) {
        const double v =
            l < st.L ? st.full_bucket[static_cast<std::size_t>(l)][static_cast<std::size_t>(b)] /
                           (samples_per_lh * st.H) : all_bucket[b] / st.L;
        if (l < st.L) all_bucket[b] += v;
        fmt::print(" {:.4f} |", v);
        csv.row("full_age", "full", 0, l < st.L ? l : -1, -1, bucket_name(b), v);
      }
      fmt::print("\n");
    }

    // 3. Per-layer and per-(layer, head) mass lost at each budget; age tables at 32.
    for (std::size_t bi = 0; bi < st.budgets.size(); ++bi) {
      const std::size_t B = st.budgets[bi];
      fmt::print("\n### Mass lost per layer at {} rows\n\n| policy |", B);
      for (int l = 0; l < st.L; ++l) fmt::print(" layer {} |", l);
      fmt::print("\n|---|");
      for (int l = 0; l < st.L; ++l) fmt::print("---|");
      fmt::print("\n");
      for (std::size_t p = 0; p < st.names.size(); ++p) {
        fmt::print("| {} |", st.names[p]);
        for (int l = 0; l < st.L; ++l) {
          double v = 0;
          for (int h = 0; h < st.H; ++h)
            v += st.acc[p][bi].lost_lh[static_cast<std::size_t>(l * st.H + h)];
          fmt::print(" {:.4f} |", v / (samples_per_lh * st.H));
        }
        fmt::print("\n");
      }
    }
    // The per-head and age tables at 32 rows (or the second budget given) and at the last.
    const std::size_t n_budgets = st.budgets.size();
    std::size_t b32 = std::min<std::size_t>(1, n_budgets - 1);
    for (std::size_t bi = 0; bi < n_budgets; ++bi)
      if (st.budgets[bi] == 32) b32 = bi;
    const std::size_t b_last = n_budgets - 1;
    std::vector<std::size_t> age_budgets{0}, held_budgets{b32};
    if (b32 != 0) age_budgets.push_back(b32);
    if (b_last != b32) {
      age_budgets.push_back(b_last);
      held_budgets.push_back(b_last);
    }
    fmt::print("\n### Mass lost per (layer, KV head) at {} rows\n\n| layer.head |",
               st.budgets[b32]);
    for (const auto& n : st.names) fmt::print(" {} |", n);
    fmt::print("\n|---|");
    for (std::size_t p = 0; p < st.names.size(); ++p) fmt::print("---|");
    fmt::print("\n");
    for (int l = 0; l < st.L; ++l)
      for (int h = 0; h < st.H; ++h) {
        fmt::print("| {}.{} |", l, h);
        for (std::size_t p = 0; p < st.names.size(); ++p)
          fmt::print(" {:.4f} |", st.acc[p][b32].lost_lh[static_cast<std::size_t>(l * st.H + h)] /
                                     samples_per_lh);
        fmt::print("\n");
      }
    for (std::size_t bi : age_budgets) {
      fmt::print("\n### Mass lost by token age at {} rows\n\n| policy |", st.budgets[bi]);
      for (int b = 0; b < kBuckets; ++b) fmt::print(" {} |", bucket_name(b));
      fmt::print("\n|---|");
      for (int b = 0; b < kBuckets; ++b) fmt::print("---|");
      fmt::print("\n");
      for (std::size_t p = 0; p < st.names.size(); ++p) {
        fmt::print("| {} |", st.names[p]);
        for (int b = 0; b < kBuckets; ++b)
          fmt::print(" {:.4f} |", st.acc[p][bi].lost_bucket[b] / (samples_per_lh * st.L * st.H));
        fmt::print("\n");
      }
    }
    for (std::size_t bi : held_budgets) {
      fmt::print(
          "\n### Rows held by token age at {} rows (mean rows per layer and KV head, "
          "steps where the cache is full)\n\n| policy |",
          st.budgets[bi]);
      for (int b = 0; b < kBuckets; ++b) fmt::print(" {} |", bucket_name(b));
      fmt::print(" mean age (non-sink) |\n|---|");
      for (int b = 0; b <= kBuckets; ++b) fmt::print("---|");
      fmt::print("\n");
      for (std::size_t p = 0; p < st.names.size(); ++p) {
        const Acc& x = st.acc[p][bi];
        fmt::print("| {} |", st.names[p]);
        for (int b = 0; b < kBuckets; ++b)
          fmt::print(" {:.2f} |", x.kept_bucket[b] / std::max(1.0, x.full_samples));
        fmt::print(" {:.1f} |\n",
                    x.kept_age_sum / std::max(1.0, x.kept_rows - x.kept_bucket[kSink]));
      }
    }

    // 4. SimHash ranking quality: head dim 8 (this model) against 128 (synthetic).
    fmt::print(
        "\n### SimHash ranking against the true q.k (query mode / key mode)\n\n"
        "Spearman: rank correlation of -Hamming(code(q or incoming k), code(k_i)) with "
        "q.k_i over the cached rows; top-1/4 mass: attention mass of the quarter of rows "
        "the score ranks highest (ties at random), as the share of the random (0.25) -> "
        "exact-q.k gap it closes. cosine: the exact angle (SimHash's b -> infinity limit); "
        "recency: newest rows first (a window's ranking).\n\n"
        "| data | measure | b = 8 | b = 16 | b = 32 | b = 64 | cosine | recency |\n"
        "|---|---|---|---|---|---|---|---|\n");
    print_hash_row("stories260K d=8", st.hash, csv);
    if (a.synthetic) {
      for (const auto& wname : eval::synthetic_workload_names()) {
        const HashStudy hs = synthetic_study(wname, 16);
        print_hash_row(("synthetic " + wname + " d=128").c_str(), hs, csv);
      }
    }
    return 0;
  });
}
