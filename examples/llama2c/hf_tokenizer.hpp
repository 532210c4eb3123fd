#pragma once
// Decodes token ids to text for display with a Hugging Face tokenizer.json (the `tokenizers`
// library's file), when a checkpoint directory has one. Decode only: the protocol samples
// token ids from the model, so nothing here encodes text.
//
// What is read: the id -> token table of "model" (BPE, WordPiece, WordLevel: an object
// {token: id}; Unigram: an array of [token, score], the index being the id), "added_tokens"
// (their ids and contents; special ones are skipped in the output, as tokenizers'
// decode(ids, skip_special_tokens=True)), and the "decoder" pipeline, applied as tokenizers
// applies it to the list of token strings:
//   ByteLevel     GPT-2's byte-to-unicode table reversed (Llama-3, Qwen2/3, GPT-2):
//                 per token, every char mapped back to its byte (a token with a char outside
//                 the table keeps its UTF-8 bytes), joined, invalid UTF-8 shown as U+FFFD
//   Metaspace     the replacement char ('▁') becomes a space; one leading space of the
//                 first token is dropped unless prepend_scheme is "never" /
//                 add_prefix_space is false
//   Replace       a String pattern replaced by `content` in every token (Regex: unsupported)
//   ByteFallback  runs of "<0xNN>" tokens become their bytes (one U+FFFD per byte when the
//                 run is not valid UTF-8)
//   Fuse          every token joined into one
//   Strip         up to `start` leading and `stop` trailing `content` chars removed per token
//   Sequence      the listed decoders in order (Llama-2: Replace '▁' -> ' ', ByteFallback,
//                 Fuse, Strip 1 leading space)
//   null          tokens joined with spaces (tokenizers' behaviour without a decoder)
// Anything else (WordPiece, BPEDecoder, CTC, a Regex Replace, an unknown type) makes the
// tokenizer `unsupported()`: decode() then shows the ids ("[12 345 ...]") and the tools print
// a one-line warning once. A malformed file (bad JSON, no model vocabulary, a duplicate or
// out-of-range id, a decoder field of the wrong type) is a kvevict::Error naming the file and
// the field. Ids the table does not name are skipped (tokenizers does the same).
#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../eval/safetensors.hpp"
#include "kvevict/errors.hpp"
#include "kvevict/file.hpp"

namespace kvevict::llama2c::hf {

namespace tokenizer_detail {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

inline void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

/// Length of the well-formed UTF-8 sequence at s[i] (Unicode table 3-7), or 0 when the
/// bytes there are not one; `prefix` receives the length of its longest valid start (the
/// "maximal subpart" that one U+FFFD replaces, as Python and Rust's lossy decoders do).
inline std::size_t utf8_sequence(std::string_view s, std::size_t i, std::size_t& prefix) {
  const auto b = static_cast<unsigned char>(s[i]);
  prefix = 1;
  if (b < 0x80) return 1;
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    len = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    len = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    len = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (std::size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) return 0;
    prefix = k + 1;
  }
  return len;
}

/// `bytes` as valid UTF-8: every maximal invalid subpart replaced by one U+FFFD.
inline std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    std::size_t prefix = 1;
    const std::size_t n = utf8_sequence(bytes, i, prefix);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += kReplacementChar;
      i += prefix;
    }
  }
  return out;
}

inline bool valid_utf8(std::string_view bytes) {
  for (std::size_t i = 0; i < bytes.size();) {
    std::size_t prefix = 1;
    const std::size_t n = utf8_sequence(bytes, i, prefix);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

/// The code points of a valid UTF-8 string (nlohmann::json has validated every string).
inline std::vector<char32_t> code_points(std::string_view s) {
  std::vector<char32_t> out;
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const std::size_t n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    char32_t c = n == 1 ? b : n == 2 ? (b & 0x1Fu) : n == 3 ? (b & 0x0Fu) : (b & 0x07u);
    for (std::size_t k = 1; k < n && i + k < s.size(); ++k)
      c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3Fu);
    out.push_back(c);
    i += n;
  }
  return out;
}

/// GPT-2's byte -> code point table: printable Latin-1 bytes map to themselves, the other
/// 68 bytes to 256, 257, ... in byte order.
inline const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

/// Its inverse: code point -> byte (nullopt outside the table).
inline std::optional<unsigned char> char_to_byte(char32_t c) {
  static const std::unordered_map<char32_t, unsigned char> inverse = [] {
    std::unordered_map<char32_t, unsigned char> m;
    for (unsigned b = 0; b < 256; ++b) m.emplace(byte_to_char()[b], static_cast<unsigned char>(b));
    return m;
  }();
  const auto it = inverse.find(c);
  if (it == inverse.end()) return std::nullopt;
  return it->second;
}

/// One step of the decoder pipeline.
struct Step {
  enum class Kind { byte_level, metaspace, replace, byte_fallback, fuse, strip } kind;
  std::string from, to;       // replace: pattern -> content; metaspace: replacement -> " "
  bool strip_first = false;   // metaspace: drop one leading space of the first token
  char32_t strip_char = ' ';  // strip
  std::size_t start = 0, stop = 0;
};

inline void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  std::size_t at = 0;
  for (std::size_t p; (p = s.find(from, at)) != std::string::npos; at = p + from.size())
    out.append(s, at, p - at).append(to);
  out.append(s, at, std::string::npos);
  s = std::move(out);
}

inline void apply(const Step& st, std::vector<std::string>& tokens) {
  using K = Step::Kind;
  switch (st.kind) {
    case K::byte_level: {
      std::string bytes;
      for (const auto& t : tokens) {
        std::string mapped;
        bool all = true;
        for (char32_t c : code_points(t)) {
          const auto b = char_to_byte(c);
          if (!b) {
            all = false;
            break;
          }
          mapped += static_cast<char>(*b);
        }
        bytes += all ? mapped : t;
      }
      tokens.assign(1, utf8_lossy(bytes));
      return;
    }
    case K::metaspace:
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        replace_all(tokens[i], st.from, " ");
        if (i == 0 && st.strip_first && !tokens[i].empty() && tokens[i][0] == ' ')
          tokens[i].erase(0, 1);
      }
      return;
    case K::replace:
      for (auto& t : tokens) replace_all(t, st.from, st.to);
      return;
    case K::byte_fallback: {
      std::vector<std::string> out;
      std::string run;
      std::size_t run_bytes = 0;
      auto flush = [&] {
        if (run_bytes == 0) return;
        if (valid_utf8(run)) {
          out.push_back(run);
        } else {
          std::string r;
          for (std::size_t k = 0; k < run_bytes; ++k) r += kReplacementChar;
          out.push_back(r);
        }
        run.clear();
        run_bytes = 0;
      };
      for (auto& t : tokens) {
        auto hex = [](char c) -> int {
          if (c >= '0' && c <= '9') return c - '0';
          if (c >= 'A' && c <= 'F') return c - 'A' + 10;
          if (c >= 'a' && c <= 'f') return c - 'a' + 10;
          return -1;
        };
        if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>' && hex(t[3]) >= 0 &&
            hex(t[4]) >= 0) {
          run += static_cast<char>(hex(t[3]) * 16 + hex(t[4]));
          ++run_bytes;
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      tokens = std::move(out);
      return;
    }
    case K::fuse: {
      std::string all;
      for (const auto& t : tokens) all += t;
      tokens.assign(1, all);
      return;
    }
    case K::strip:
      for (auto& t : tokens) {
        const auto cps = code_points(t);
        std::size_t a = 0, b = cps.size();
        while (a < st.start && a < b && cps[a] == st.strip_char) ++a;
        std::size_t cut = 0;
        while (cut < st.stop && b > a && cps[b - 1] == st.strip_char) --b, ++cut;
        std::string s;
        for (std::size_t i = a; i < b; ++i) append_utf8(s, cps[i]);
        t = std::move(s);
      }
      return;
  }
}

}  // namespace tokenizer_detail

/// A tokenizer.json's decoding side (see the file comment).
class TokenizerJson {
 public:
  /// Parses tokenizer.json's text; `where` names it in errors.
  static TokenizerJson parse(std::string_view text, const std::string& where) {
    using kvevict::detail::fail;
    using kvevict::detail::require;
    const eval::json::Value root = eval::json::parse(text, where, "JSON");
    require(root.is_object(), where, ": not a JSON object");
    TokenizerJson t;
    // The model's vocabulary.
    require(root.contains("model") && root["model"].is_object(), where,
            ": has no object 'model'");
    const auto& model = root["model"];
    require(model.contains("vocab"), where, ": has no 'model.vocab'");
    const auto& vocab = model["vocab"];
    constexpr std::int64_t kMaxId = (std::int64_t{1} << 24) - 1;
    auto set = [&](std::int64_t id, const std::string& token, const char* field) {
      require(id >= 0 && id <= kMaxId, where, ": ", field, " gives '", token, "' id ", id,
              ", expected 0..", kMaxId);
      // A map, not a vector indexed by id: a tiny file naming id 2^24 - 1 costs one entry.
      const auto [it, fresh] = t.tokens_.emplace(static_cast<int>(id), token);
      require(fresh || it->second == token, where, ": ", field, " gives id ", id, " to '", token,
              "', which already names '", it->second, "'");
      t.size_ = std::max(t.size_, static_cast<std::size_t>(id) + 1);
    };
    if (vocab.is_object()) {
      for (const auto& [token, id] : vocab.items()) {
        require(id.is_number_integer(), where, ": model.vocab['", token, "'] = ", id.dump(),
                ", expected an integer id");
        set(id.get<std::int64_t>(), token, "model.vocab");
      }
    } else if (vocab.is_array()) {  // Unigram: [[piece, score], ...], the index is the id
      std::int64_t id = 0;
      for (const auto& e : vocab) {
        require(e.is_array() && !e.empty() && e[0].is_string(), where, ": model.vocab[", id,
                "] = ", e.dump(), ", expected [piece, score]");
        set(id++, e[0].get<std::string>(), "model.vocab");
      }
    } else {
      fail(where, ": model.vocab is ", vocab.type_name(), ", expected an object or an array");
    }
    // Added tokens: their ids and contents; special ones are left out of the text.
    if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
      const auto& added = root["added_tokens"];
      require(added.is_array(), where, ": added_tokens is ", added.type_name(),
              ", expected an array");
      for (const auto& a : added) {
        require(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                    a.contains("content") && a["content"].is_string(),
                where, ": added_tokens entry ", a.dump(),
                " needs an integer 'id' and a string 'content'");
        const std::string content = a["content"].get<std::string>();
        const std::int64_t id = a["id"].get<std::int64_t>();
        // An added token may repeat its vocab entry (Llama-2's <s>); another name is an error.
        set(id, content, "added_tokens");
        if (a.contains("special")) {
          require(a["special"].is_boolean(), where, ": added_tokens '", content,
                  "' special = ", a["special"].dump(), ", expected true or false");
          if (a["special"].get<bool>()) {
            t.special_.insert(static_cast<int>(id));
          }
        }
      }
    }
    // The decoder pipeline.
    if (root.contains("decoder") && !root["decoder"].is_null())
      t.read_decoder(root["decoder"], where, "decoder");
    else
      t.join_with_spaces_ = true;
    return t;
  }

  static TokenizerJson load(const std::string& path) {
    const auto bytes = kvevict::detail::read_file(path, "tokenizer.json");
    return parse(std::string_view(bytes.data(), bytes.size()), "tokenizer '" + path + "'");
  }

  /// dir/tokenizer.json when the file exists (errors in it are thrown), else nullopt.
  static std::optional<TokenizerJson> load_if_present(const std::string& dir) {
    std::error_code ec;
    const auto path = std::filesystem::path(dir) / "tokenizer.json";
    if (!std::filesystem::exists(path, ec)) return std::nullopt;
    return load(path.string());
  }

  /// Ids the table names (the largest id + 1).
  [[nodiscard]] std::size_t size() const { return size_; }
  /// Empty when every decoder step is supported; else what is not (decode() shows ids).
  [[nodiscard]] const std::string& unsupported() const { return unsupported_; }

  /// The text of `ids` (special tokens and ids without a token skipped), or "[id id ...]"
  /// when the decoder is unsupported.
  [[nodiscard]] std::string decode(std::span<const int> ids) const {
    if (!unsupported_.empty()) {
      std::string s = "[";
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (i > 0) s += ' ';
        s += std::to_string(ids[i]);
      }
      s += ']';
      return s;
    }
    std::vector<std::string> tokens;
    for (int id : ids) {
      const auto it = tokens_.find(id);
      if (it == tokens_.end() || special_.count(id) != 0) continue;
      tokens.push_back(it->second);
    }
    if (join_with_spaces_) {
      std::string s;
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0) s += ' ';
        s += tokens[i];
      }
      return s;
    }
    for (const auto& st : steps_) tokenizer_detail::apply(st, tokens);
    std::string s;
    for (const auto& x : tokens) s += x;
    return s;
  }

 private:
  void read_decoder(const eval::json::Value& d, const std::string& where, const std::string& field) {
    using kvevict::detail::require;
    using K = tokenizer_detail::Step::Kind;
    require(d.is_object() && d.contains("type") && d["type"].is_string(), where, ": ", field,
            " = ", d.dump(), ", expected an object with a string 'type'");
    const std::string type = d["type"].get<std::string>();
    auto text = [&](const char* key, const std::string& fallback) {
      if (!d.contains(key) || d[key].is_null()) return fallback;
      require(d[key].is_string(), where, ": ", field, ".", key, " = ", d[key].dump(),
              ", expected a string");
      return d[key].get<std::string>();
    };
    auto count = [&](const char* key) -> std::size_t {
      if (!d.contains(key)) return 0;
      require(d[key].is_number_unsigned() && d[key].get<std::uint64_t>() <= 1u << 20, where, ": ",
              field, ".", key, " = ", d[key].dump(), ", expected a count");
      return static_cast<std::size_t>(d[key].get<std::uint64_t>());
    };
    tokenizer_detail::Step st{};
    if (type == "Sequence") {
      require(d.contains("decoders") && d["decoders"].is_array(), where, ": ", field,
              ".decoders is missing or not an array");
      std::size_t i = 0;
      for (const auto& sub : d["decoders"])
        read_decoder(sub, where, field + ".decoders[" + std::to_string(i++) + "]");
      return;
    }
    if (type == "ByteLevel") {
      st.kind = K::byte_level;
    } else if (type == "ByteFallback") {
      st.kind = K::byte_fallback;
    } else if (type == "Fuse") {
      st.kind = K::fuse;
    } else if (type == "Metaspace") {
      st.kind = K::metaspace;
      st.from = text("replacement", "\xE2\x96\x81");  // U+2581
      const std::string scheme = text("prepend_scheme", "");
      bool prefix = true;
      if (d.contains("add_prefix_space")) {
        require(d["add_prefix_space"].is_boolean(), where, ": ", field,
                ".add_prefix_space = ", d["add_prefix_space"].dump(), ", expected true or false");
        prefix = d["add_prefix_space"].get<bool>();
      }
      st.strip_first = scheme.empty() ? prefix : scheme != "never";
    } else if (type == "Replace") {
      st.kind = K::replace;
      require(d.contains("pattern") && d["pattern"].is_object(), where, ": ", field,
              ".pattern is missing or not an object");
      const auto& p = d["pattern"];
      if (!p.contains("String")) {
        unsupported_ = field + ": Replace with pattern " + p.dump() + " (only String patterns)";
        return;
      }
      require(p["String"].is_string(), where, ": ", field, ".pattern.String = ", p["String"].dump(),
              ", expected a string");
      st.from = p["String"].get<std::string>();
      st.to = text("content", "");
    } else if (type == "Strip") {
      st.kind = K::strip;
      const std::string c = text("content", " ");
      const auto cps = tokenizer_detail::code_points(c);
      require(cps.size() == 1, where, ": ", field, ".content = \"", c,
              "\", expected one character");
      st.strip_char = cps[0];
      st.start = count("start");
      st.stop = count("stop");
    } else {
      if (unsupported_.empty()) unsupported_ = field + ": decoder type '" + type + "'";
      return;
    }
    steps_.push_back(std::move(st));
  }

  std::unordered_map<int, std::string> tokens_;  // id -> token
  std::unordered_set<int> special_;                // ids left out of the text
  std::size_t size_ = 0;                           // largest id + 1
  std::vector<tokenizer_detail::Step> steps_;
  bool join_with_spaces_ = false;
  std::string unsupported_;
};

/// Prints a growing id sequence's text piece by piece: each call returns the text the
/// new ids add. It decodes a short window of recent ids twice (with and without the new
/// ones) and holds back text that ends in U+FFFD (a character whose bytes are still
/// arriving), as streaming detokenizers do; the pieces concatenate to decode(all ids)
/// whenever that does not end in an incomplete character.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const TokenizerJson& t) : tok_(&t) {}
  std::string push(int id) {
    ids_.push_back(id);
    const std::span<const int> all(ids_);
    const std::string before = tok_->decode(all.subspan(prefix_, read_ - prefix_));
    const std::string now = tok_->decode(all.subspan(prefix_));
    if (now.size() <= before.size() || now.ends_with(tokenizer_detail::kReplacementChar) ||
        !now.starts_with(before))
      return "";
    prefix_ = read_;
    read_ = ids_.size();
    return now.substr(before.size());
  }

 private:
  const TokenizerJson* tok_;
  std::vector<int> ids_;
  std::size_t prefix_ = 0, read_ = 0;
};

}  // namespace kvevict::llama2c::hf
