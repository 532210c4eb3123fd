#pragma once
// The option parser every example program shares: options declared once with their help
// text, every numeric value checked (a number, finite, in range) before the program does
// anything else, and exactly one error line on stderr with exit status 2 on bad input.
//
//   kvevict::cli::Parser p("llama2c", "generate text from a llama2.c checkpoint");
//   p.number("--temperature", "T", "sampling temperature; 0 = greedy", temperature, 0.0f, 100.0f);
//   if (!p.parse(argc, argv)) return 0;   // --help printed
//   return kvevict::cli::main_guard("llama2c", [&] { ...; return 0; });
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdio>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvevict/errors.hpp"

namespace kvevict::cli {

/// A bad command line: the program prints the message on one line and exits with 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Splits "a,b,c" at commas; empty items are kept (and rejected by their consumer).
inline std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    const auto end = std::min(s.find(',', start), s.size());
    out.emplace_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

/// The closed (or left-open) interval a numeric option accepts.
template <class T>
struct Range {
  T lo = std::numeric_limits<T>::lowest();
  T hi = std::numeric_limits<T>::max();
  bool lo_open = false;  ///< (lo, hi] instead of [lo, hi]
  [[nodiscard]] bool contains(T v) const { return (lo_open ? v > lo : v >= lo) && v <= hi; }
  [[nodiscard]] std::string text() const {
    if constexpr (std::is_integral_v<T>) {
      if (hi == std::numeric_limits<T>::max()) return fmt::format("an integer >= {}", lo);
      return fmt::format("an integer in [{}, {}]", lo, hi);
    } else {
      if (hi == std::numeric_limits<T>::max())
        return fmt::format("a finite number {} {}", lo_open ? ">" : ">=", lo);
      return fmt::format("a finite number in {}{}, {}]", lo_open ? "(" : "[", lo, hi);
    }
  }
};

/// Parses `text` as a T for option `flag`: the whole text must be the number (no sign
/// for unsigned types, no trailing characters), finite, and inside `range`.
template <class T>
T parse_number(std::string_view flag, std::string_view text, Range<T> range = {}) {
  T v{};
  const char* end = text.data() + text.size();
  std::from_chars_result r{};
  if constexpr (std::is_integral_v<T>) {
    r = std::from_chars(text.data(), end, v);
  } else {
    double d = 0.0;
    r = std::from_chars(text.data(), end, d, std::chars_format::general);
    if (r.ec == std::errc() && !(std::isfinite(d) && std::abs(d) <= std::numeric_limits<T>::max()))
      r.ec = std::errc::result_out_of_range;
    v = static_cast<T>(d);
  }
  if (text.empty() || r.ec != std::errc() || r.ptr != end || !range.contains(v))
    throw UsageError(fmt::format("{} = '{}', expected {}", flag, text, range.text()));
  return v;
}

/// Options declared with their help; parse() fills the bound variables.
class Parser {
 public:
  Parser(std::string program, std::string summary)
      : program_(std::move(program)), summary_(std::move(summary)) {}

  /// --name without a value.
  void flag(std::string name, std::string help, bool& out) {
    add(std::move(name), "", std::move(help), [&out](const std::string&) { out = true; });
  }
  /// --name VALUE, a number in `range`.
  template <class T>
  requires std::is_arithmetic_v<T>
  void number(std::string name, std::string metavar, std::string help, T& out,
              Range<T> range = {}) {
    auto n = name;
    add(std::move(name), std::move(metavar), with_default(std::move(help), out),
        [&out, n, range](const std::string& v) { out = parse_number<T>(n, v, range); });
  }
  template <class T>
  requires std::is_arithmetic_v<T>
  void number(std::string name, std::string metavar, std::string help, std::optional<T>& out,
              Range<T> range = {}) {
    auto n = name;
    add(std::move(name), std::move(metavar), std::move(help),
        [&out, n, range](const std::string& v) { out = parse_number<T>(n, v, range); });
  }
  /// --name VALUE, any text (non-empty).
  void text(std::string name, std::string metavar, std::string help, std::string& out) {
    auto n = name;
    add(std::move(name), std::move(metavar), std::move(help), [&out, n](const std::string& v) {
      if (v.empty()) throw UsageError(fmt::format("{}: empty value", n));
      out = v;
    });
  }
  /// --name VALUE handed to `handle`, which throws UsageError on a bad value.
  void custom(std::string name, std::string metavar, std::string help,
              std::function<void(const std::string&)> handle) {
    add(std::move(name), std::move(metavar), std::move(help), std::move(handle));
  }
  /// --name without a value that prints `show()` to stdout and stops parsing (--list).
  void info(std::string name, std::string help, std::function<void()> show) {
    add(std::move(name), "", std::move(help), [this, show = std::move(show)](const std::string&) {
      show();
      stop_ = true;
    });
  }
  /// A positional argument (filled in declaration order, each optional).
  void positional(std::string metavar, std::string help, std::string& out) {
    positionals_.push_back({std::move(metavar), std::move(help), &out});
  }
  /// Text printed after the options in --help.
  void epilog(std::string text) { epilog_ = std::move(text); }

  /// Parses argv. Returns false when the program should exit 0 (--help or an info option
  /// printed its text); throws UsageError on a bad or unknown argument.
  bool parse(int argc, char** argv) {
    std::size_t next_positional = 0;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        std::fputs(help().c_str(), stdout);
        return false;
      }
      std::string name = a, value;
      bool inline_value = false;
      if (const auto eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
      const Option* o = find(name);
      if (o == nullptr) {
        if (a.rfind("-", 0) != 0 && next_positional < positionals_.size()) {
          *positionals_[next_positional++].out = a;
          continue;
        }
        throw UsageError(fmt::format("unknown argument '{}' (see --help)", a));
      }
      if (!o->metavar.empty() && !inline_value) {
        if (i + 1 >= argc) throw UsageError(fmt::format("{} needs a value ({})", name, o->metavar));
        value = argv[++i];
      } else if (o->metavar.empty() && inline_value) {
        throw UsageError(fmt::format("{} takes no value", name));
      }
      o->handle(value);
      if (stop_) return false;
    }
    return true;
  }

  [[nodiscard]] std::string help() const {
    std::string out = fmt::format("usage: {} [options]", program_);
    for (const auto& p : positionals_) out += fmt::format(" [{}]", p.metavar);
    out += fmt::format("\n{}\n\nOptions:\n", summary_);
    for (const auto& p : positionals_) out += line(p.metavar, p.help);
    for (const auto& o : options_)
      out += line(o.metavar.empty() ? o.name : o.name + " " + o.metavar, o.help);
    out += line("-h, --help", "this text");
    if (!epilog_.empty()) out += fmt::format("\n{}", epilog_);
    return out;
  }

 private:
  struct Option {
    std::string name, metavar, help;
    std::function<void(const std::string&)> handle;
  };
  struct Positional {
    std::string metavar, help;
    std::string* out;
  };
  void add(std::string name, std::string metavar, std::string help,
           std::function<void(const std::string&)> handle) {
    if (find(name) != nullptr) throw std::logic_error(fmt::format("cli: option {} declared twice", name));
    options_.push_back({std::move(name), std::move(metavar), std::move(help), std::move(handle)});
  }
  [[nodiscard]] const Option* find(const std::string& name) const {
    for (const auto& o : options_)
      if (o.name == name) return &o;
    return nullptr;
  }
  template <class T>
  static std::string with_default(std::string help, const T& v) {
    return fmt::format("{} (default {})", help, v);
  }
  static std::string line(const std::string& left, const std::string& help) {
    // Help text wrapped at 88 columns, indented under a 26-column left part.
    std::string out = fmt::format("  {:<24}", left);
    if (left.size() > 24) out += fmt::format("\n{:26}", "");
    std::size_t col = 26;
    std::size_t start = 0;
    while (start < help.size()) {
      auto end = help.find(' ', start);
      if (end == std::string::npos) end = help.size();
      const auto word = help.substr(start, end - start);
      if (col > 26 && col + 1 + word.size() > 88) {
        out += fmt::format("\n{:26}", "");
        col = 26;
      } else if (col > 26) {
        out += ' ';
        ++col;
      }
      out += word;
      col += word.size();
      start = end + 1;
    }
    return out + "\n";
  }

  std::string program_, summary_, epilog_;
  std::vector<Option> options_;
  std::vector<Positional> positionals_;
  bool stop_ = false;
};

/// Runs `body` and turns its exceptions into one line on stderr and an exit status:
/// 2 for a bad command line or bad input (UsageError, kvevict::Error), 1 otherwise.
template <class Body>
int main_guard(const char* program, Body&& body) {
  auto one_line = [](std::string s) {
    for (char& c : s)
      if (c == '\n' || c == '\r') c = ' ';
    return s;
  };
  try {
    return body();
  } catch (const UsageError& e) {
    fmt::print(stderr, "{}: {}\n", program, one_line(e.what()));
    return 2;
  } catch (const kvevict::Error& e) {
    fmt::print(stderr, "{}: {}\n", program, one_line(e.what()));
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: error: {}\n", program, one_line(e.what()));
    return 1;
  }
}

}  // namespace kvevict::cli
