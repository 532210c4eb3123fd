// Fuzzes the XKV allocation profile reader (policies/xkv.hpp, Profile::from_text): any
// text must parse or throw kvevict::Error; a parsed profile must survive to_text/from_text.
#include <kvevict/policies/xkv.hpp>

#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto p = kvevict::policies::Profile::from_text(text);
    const auto q = kvevict::policies::Profile::from_text(p.to_text());
    if (q.tokens != p.tokens || q.window != p.window || q.samples != p.samples) std::abort();
  } catch (const kvevict::Error&) {
  }
  return 0;
}
