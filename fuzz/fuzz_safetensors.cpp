// Fuzzes the safetensors reader and the trace loader (examples/eval/safetensors.hpp):
// arbitrary bytes must parse or throw kvevict::Error. Inputs that parse as a container
// are also loaded as a trace (through a per-process temporary file, the loader's API).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  try {
    auto f = kvevict::eval::SafetensorsFile::from_bytes(bytes, "fuzz");
    (void)f;
  } catch (const kvevict::Error&) {
    return 0;
  }
  static const std::string path = "/tmp/kvevict_fuzz_trace_" + std::to_string(getpid()) + ".safetensors";
  if (FILE* out = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, out);
    std::fclose(out);
    try {
      auto w = kvevict::eval::load_trace(path);
      (void)w;
    } catch (const kvevict::Error&) {
    }
  }
  return 0;
}
