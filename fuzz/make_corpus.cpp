// Writes the small seed corpora committed under fuzz/corpus/<target>/ (run from the
// repository root: scripts/fuzz.sh does not need it; it documents where seeds came from).
//   clang++ -std=c++20 -DFMT_HEADER_ONLY=1 -Iinclude -Iexamples/llama2c -Iexamples/eval -I/usr/include/eigen3 \
//     fuzz/make_corpus.cpp -o /tmp/make_corpus && /tmp/make_corpus
#include <kvevict/kvevict.hpp>
#include <kvevict/policies/xkv.hpp>
#include <kvevict/serialize.hpp>

#include <filesystem>
#include <fstream>
#include <random>

#include "llama2c.hpp"
#include "safetensors.hpp"

namespace {
namespace fs = std::filesystem;
namespace pol = kvevict::policies;

void put(const std::string& target, const std::string& name, const std::vector<std::uint8_t>& bytes) {
  fs::create_directories("fuzz/corpus/" + target);
  std::ofstream("fuzz/corpus/" + target + "/" + name, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

template <class Cache>
std::vector<std::uint8_t> saved(Cache c, std::uint8_t selector, int steps) {
  std::vector<float> k(8), v(8), q(16);
  for (int t = 0; t < steps; ++t)
    for (int l = 0; l < 2; ++l) {
      for (std::size_t i = 0; i < 8; ++i) k[i] = v[i] = float((t * 3 + int(i)) % 7) - 3.0f;
      for (std::size_t i = 0; i < 16; ++i) q[i] = float((t + int(i)) % 5) - 2.0f;
      c.append(l, t, k, v, q);
      kvevict::attend(c, l, q);
    }
  auto b = kvevict::save_bytes(c);
  b.insert(b.begin(), {selector, 0});  // no structured mutations: the fuzzer adds them
  return b;
}

}  // namespace

int main() {
  const kvevict::Geometry g{2, 4, 2, 4};
  const auto b6 = kvevict::Budget::uniform(6);
  // saved_state: selector byte = (target << 1) | reseal, then the mutation count (0), as
  // fuzz_saved_state reads them; the targets' policies and configurations match it.
  put("saved_state", "h2o", saved(kvevict::KVCache<pol::H2O>(g, b6, pol::H2O(pol::H2O::Config{2, 1})), 1, 9));
  put("saved_state", "random_half",
      saved(kvevict::KVCache<pol::Random, Eigen::half>(g, b6, pol::Random(pol::Random::Config{3, 1, 1})), 3, 9));
  put("saved_state", "knorm_bf16",
      saved(kvevict::KVCache<pol::KNorm, Eigen::bfloat16>(g, b6, pol::KNorm(pol::KNorm::Config{1, 1})), 4, 4));
  put("saved_state", "streaming_empty", saved(kvevict::KVCache<pol::StreamingLLM>(g, b6, pol::StreamingLLM{2}), 7, 0));
  {
    pol::DecayedAttention::Config dc;
    dc.decay = 0.5f;
    dc.sinks = 1;
    dc.recent = 1;
    put("saved_state", "decayed_half",
        saved(kvevict::KVCache<pol::DecayedAttention, Eigen::half>(g, b6, pol::DecayedAttention(dc)), 9, 9));
    pol::BuzzBeehive::Config bc;
    bc.sinks = 1;
    bc.window = 2;
    bc.threshold = 2;
    bc.stride = 3;
    put("saved_state", "buzz", saved(kvevict::KVCache<pol::BuzzBeehive>(g, b6, pol::BuzzBeehive(bc)), 11, 9));
    pol::HashEvictSimHash<>::Config hc;
    hc.sinks = 1;
    hc.recent = 1;
    put("saved_state", "hashevict_bf16",
        saved(kvevict::KVCache<pol::HashEvictSimHash<>, Eigen::bfloat16>(g, b6, pol::HashEvictSimHash<>(hc)), 13, 9));
    pol::SnapKV::Config sc;
    sc.window = 2;
    sc.kernel = 3;
    put("saved_state", "snapkv", saved(kvevict::KVCache<pol::SnapKV>(g, b6, pol::SnapKV(sc)), 15, 9));
  }
  // policy_ops: random programs (every policy selector, both scalar types).
  std::mt19937 gen(1);
  for (int i = 0; i < 26; ++i) {
    std::vector<std::uint8_t> b(600);
    for (auto& x : b) x = std::uint8_t(gen());
    b[0] = std::uint8_t(i % 2);
    b[12] = std::uint8_t(i / 2);  // policy selector position after geometry/budget bytes varies; a hint
    put("policy_ops", "program_" + std::to_string(i), b);
  }
  // paged_pool: random programs; byte 4 picks the block size (1, 2, 4 or 256 here), byte 5
  // the pool size (small, so the pool runs out), then mostly operations.
  for (int i = 0; i < 12; ++i) {
    std::vector<std::uint8_t> b(800);
    for (auto& x : b) x = std::uint8_t(gen());
    const std::uint8_t block_choice[4] = {1, 2, 4, 8};  // fuzz_paged_pool: 8 -> 256 tokens
    b[4] = block_choice[i % 4];
    b[5] = std::uint8_t(8 + i * 3);
    put("paged_pool", "program_" + std::to_string(i), b);
  }
  // llama2c_checkpoint: a tiny valid version-0 checkpoint and tokenizer.
  {
    kvevict::llama2c::Config c;
    c.dim = 8, c.hidden_dim = 16, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 1;
    c.vocab_size = 6, c.seq_len = 8, c.shared_classifier = true;
    const std::int32_t h[7] = {8, 16, 1, 2, 1, 6, 8};
    std::vector<std::uint8_t> b(1, 0);
    b.insert(b.end(), reinterpret_cast<const std::uint8_t*>(h), reinterpret_cast<const std::uint8_t*>(h) + 28);
    const auto n = kvevict::llama2c::expected_floats(c);
    for (std::uint64_t i = 0; i < n; ++i) {
      const float f = float(i % 13) / 13.0f;
      b.insert(b.end(), reinterpret_cast<const std::uint8_t*>(&f), reinterpret_cast<const std::uint8_t*>(&f) + 4);
    }
    put("llama2c_checkpoint", "tiny_model", b);
    std::vector<std::uint8_t> t{11};  // selector: tokenizer, vocab 1 + 11 / 2 = 6
    const std::int32_t max_len = 3;
    t.insert(t.end(), reinterpret_cast<const std::uint8_t*>(&max_len), reinterpret_cast<const std::uint8_t*>(&max_len) + 4);
    for (int i = 0; i < 6; ++i) {
      const float score = float(i);
      const std::int32_t len = 1 + i % 3;
      t.insert(t.end(), reinterpret_cast<const std::uint8_t*>(&score), reinterpret_cast<const std::uint8_t*>(&score) + 4);
      t.insert(t.end(), reinterpret_cast<const std::uint8_t*>(&len), reinterpret_cast<const std::uint8_t*>(&len) + 4);
      for (int j = 0; j < len; ++j) t.push_back(std::uint8_t('a' + i));
    }
    put("llama2c_checkpoint", "tiny_tokenizer", t);
  }
  // safetensors: a two-layer trace.
  {
    using kvevict::eval::TensorToWrite;
    std::vector<TensorToWrite> ts;
    for (int l = 0; l < 2; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      ts.push_back({p + "q", kvevict::eval::DType::f32, {6, 2, 2}, std::vector<float>(24, 0.5f)});
      ts.push_back({p + "k", kvevict::eval::DType::f32, {6, 1, 2}, std::vector<float>(12, -0.25f)});
      ts.push_back({p + "v", kvevict::eval::DType::f32, {6, 1, 2}, std::vector<float>(12, 1.0f)});
    }
    fs::create_directories("fuzz/corpus/safetensors");
    kvevict::eval::write_safetensors("fuzz/corpus/safetensors/trace_2layers", ts, {{"prompt_tokens", "3"}});
  }
  // xkv_profile: a valid profile.
  {
    pol::Profile p;
    p.window = 8;
    p.samples = 3;
    p.tokens = {12, 30, 7};
    const auto s = p.to_text();
    put("xkv_profile", "three_layers", std::vector<std::uint8_t>(s.begin(), s.end()));
  }
  // Chunked prefill and quantized paged pools (their own generator, so the seeds above stay
  // as they were).
  std::mt19937 gen2(2);
  // policy_ops: SnapKV (selector byte 11 after a uniform budget: byte 8 = 0, no edge at
  // byte 7) on float / half, the reselect or first-chunk rule (byte 15), then a chunked
  // prompt as the first operation (byte 17 = 8) and random bytes.
  for (int i = 0; i < 8; ++i) {
    std::vector<std::uint8_t> b(600);
    for (auto& x : b) x = std::uint8_t(gen2());
    b[0] = std::uint8_t(i % 2);
    b[7] = 0, b[8] = 0, b[11] = 10;
    b[15] = std::uint8_t(i / 2);
    b[17] = 8;
    put("policy_ops", "chunked_" + std::to_string(i), b);
  }
  // paged_pool: first byte >= 0xC0 drives PagedCache; byte 1 the format (float, Q8<2>,
  // Q4<2>, E4M3, KV<Q8<2>, Q4<2>>), byte 2 the policy (StreamingLLM, H2O, SnapKV).
  for (int i = 0; i < 15; ++i) {
    std::vector<std::uint8_t> b(700);
    for (auto& x : b) x = std::uint8_t(gen2());
    b[0] = 0xC0;
    b[1] = std::uint8_t(i % 5);
    b[2] = std::uint8_t(i / 5);
    put("paged_pool", "paged_cache_" + std::to_string(i), b);
  }
  return 0;
}
