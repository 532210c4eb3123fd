#pragma once
// Reading a whole input file (saved caches, XKV profiles, and the example readers'
// checkpoints, tokenizers and safetensors traces) with errors that name the path: a
// directory, a missing or unreadable file, or a failed read is a kvevict::Error, never a
// libstdc++ message or std::bad_alloc from a size a directory reports.
//
// Separate-kernels mode (config.hpp): read_file is compiled in kvevict_kernels, and a
// consumer includes no <fstream> from here (issue 19's include cost).
#include <string>
#include <vector>

#include "errors.hpp"

#if !KVEVICT_KERNELS_DECLARE_ONLY
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#endif

namespace kvevict::detail {

/// The bytes of the file at `path`; `what` names the kind of file in every message.
KVEVICT_KERNEL_FN std::vector<char> read_file(const std::string& path, const char* what);

#if !KVEVICT_KERNELS_DECLARE_ONLY
KVEVICT_KERNEL_FN std::vector<char> read_file(const std::string& path, const char* what) {
  // POSIX stat (follows symbolic links, as std::filesystem::status does) rather than
  // <filesystem>, whose declarations cost ~0.3 s of CPU in every translation unit that
  // includes this header (docs/benchmarks.md, "Fifth pass").
  struct stat st {};
  const bool known = ::stat(path.c_str(), &st) == 0;
  require(!(known && S_ISDIR(st.st_mode)), what, " '", path, "': is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(what, " '", path, "': cannot open (", std::strerror(errno), ")");
  std::vector<char> bytes;
  if (known && S_ISREG(st.st_mode)) {
    const auto size = static_cast<std::uintmax_t>(st.st_size);
    bytes.resize(static_cast<std::size_t>(size));
    if (size > 0) in.read(bytes.data(), static_cast<std::streamsize>(size));
    require(in.good() && in.gcount() == static_cast<std::streamsize>(size), what, " '", path,
            "': read failed after ", in.gcount(), " of ", size, " bytes");
  } else {  // a pipe or device: read to the end
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    require(!in.bad(), what, " '", path, "': read failed");
  }
  return bytes;
}
#endif  // !KVEVICT_KERNELS_DECLARE_ONLY

}  // namespace kvevict::detail
