// Fuzzes the Hugging Face checkpoint reader (examples/llama2c/hf.hpp): config.json text and
// one safetensors shard from arbitrary bytes must assemble a model or throw kvevict::Error,
// never crash or read out of bounds; a model that assembles runs one forward step.
// Input: 2-byte little-endian config length n, n bytes of config.json, then the shard.
// Seeds: fuzz/corpus/hf_checkpoint (written by scripts/hf_fuzz_seeds.py).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hf.hpp"
#include "kvevict/policies/full_cache.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t n = std::min<std::size_t>(data[0] | (std::size_t{data[1]} << 8), size - 2);
  const std::string config(reinterpret_cast<const char*>(data) + 2, n);
  std::vector<char> shard(reinterpret_cast<const char*>(data) + 2 + n,
                          reinterpret_cast<const char*>(data) + size);
  try {
    std::vector<kvevict::eval::SafetensorsFile> shards;
    shards.push_back(kvevict::eval::SafetensorsFile::from_bytes(std::move(shard), "fuzz"));
    auto m = std::make_shared<const kvevict::llama2c::Model>(
        kvevict::llama2c::hf::assemble(config, std::move(shards), "fuzz"));
    kvevict::llama2c::Transformer<kvevict::policies::FullCache> tf(m, kvevict::Budget::unbounded());
    (void)tf.forward(m->config().vocab_size - 1, 0);
  } catch (const kvevict::Error&) {
  }
  return 0;
}
