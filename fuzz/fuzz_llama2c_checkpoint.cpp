// Fuzzes the llama2.c readers (examples/llama2c/llama2c.hpp): checkpoint and tokenizer
// parsing from arbitrary bytes must succeed or throw kvevict::Error, never crash, read out
// of bounds or allocate from an unchecked header. The first byte picks the reader.
#include <cstdint>
#include <vector>

#include "llama2c.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  std::vector<char> bytes(reinterpret_cast<const char*>(data) + 1,
                          reinterpret_cast<const char*>(data) + size);
  try {
    if (data[0] & 1) {
      auto t = kvevict::llama2c::Tokenizer::parse(bytes, 1 + data[0] / 2);
      (void)t;
    } else {
      auto m = kvevict::llama2c::Model::parse(std::move(bytes), "fuzz");
      (void)m;
    }
  } catch (const kvevict::Error&) {
  }
  return 0;
}
