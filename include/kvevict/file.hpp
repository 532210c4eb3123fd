#pragma once
// Reading a whole input file (saved caches, XKV profiles, and the example readers'
// checkpoints, tokenizers and safetensors traces) with errors that name the path: a
// directory, a missing or unreadable file, or a failed read is a kvevict::Error, never a
// libstdc++ message or std::bad_alloc from a size a directory reports.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

#include "errors.hpp"

namespace kvevict::detail {

/// The bytes of the file at `path`; `what` names the kind of file in every message.
inline std::vector<char> read_file(const std::string& path, const char* what) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  require(!std::filesystem::is_directory(st), what, " '", path, "': is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(what, " '", path, "': cannot open (", std::strerror(errno), ")");
  std::vector<char> bytes;
  if (std::filesystem::is_regular_file(st)) {
    const auto size = std::filesystem::file_size(path, ec);
    require(!ec, what, " '", path, "': cannot determine its size (", ec.message(), ")");
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

}  // namespace kvevict::detail
