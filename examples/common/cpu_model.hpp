#pragma once
// The CPU a benchmark or example ran on, for its printed header: the first "model name"
// line of /proc/cpuinfo, or "unknown" (not Linux, or no such line). Shared by bench/ and
// the example programs, so every reported figure names its machine the same way.
#include <fstream>
#include <string>

namespace kvevict::examples {

inline std::string cpu_model() {
#ifdef KVEVICT_QUICK_BUILD  // CMake option KVEVICT_QUICK_BUILD (CI): not optimised as released
  const std::string note = " [KVEVICT_QUICK_BUILD: compiled at -O0/-O1, timings are not meaningful]";
#else
  const std::string note;
#endif
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto c = line.find(':');
      return (c == std::string::npos || c + 2 > line.size() ? line : line.substr(c + 2)) + note;
    }
  return "unknown" + note;
}

}  // namespace kvevict::examples
