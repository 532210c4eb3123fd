// Fuzzes the tokenizer.json decoder (examples/llama2c/hf_tokenizer.hpp): arbitrary bytes
// must parse or throw kvevict::Error, never crash or read out of bounds; a tokenizer that
// parses decodes the given ids whole and piece by piece (IncrementalDecoder).
// Input: 1 byte n, n little-endian uint16 ids, then the tokenizer.json text.
// Seeds: fuzz/corpus/hf_tokenizer (written by scripts/hf_tokenizer_fixture.py --fuzz-seeds).
#include <cstdint>
#include <string_view>
#include <vector>

#include "hf_tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::size_t n = std::min<std::size_t>(data[0], (size - 1) / 2);
  std::vector<int> ids;
  for (std::size_t i = 0; i < n; ++i)
    ids.push_back(data[1 + 2 * i] | (data[2 + 2 * i] << 8));
  const std::size_t at = 1 + 2 * n;
  const std::string_view text(reinterpret_cast<const char*>(data) + at, size - at);
  try {
    const auto tok = kvevict::llama2c::hf::TokenizerJson::parse(text, "fuzz");
    (void)tok.decode(ids);
    kvevict::llama2c::hf::IncrementalDecoder inc(tok);
    for (int id : ids) (void)inc.push(id);
  } catch (const kvevict::Error&) {
  }
  return 0;
}
