// safetensors reader/writer of kvevict-eval: round trips in F32, F16 and BF16, exact
// half/bfloat16 conversions, trace loading, and a clear kvevict::Error for every kind of
// malformed file.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "safetensors.hpp"

using namespace kvevict::eval;
using Catch::Contains;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("kvevict_test_safetensors_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

// Writes raw bytes: an 8-byte little-endian length (given, or the header's), header, data.
std::string write_raw(const std::string& name, const std::string& header, const std::string& data,
                      std::uint64_t length = std::numeric_limits<std::uint64_t>::max()) {
  const std::string path = temp_path(name);
  std::ofstream f(path, std::ios::binary);
  const std::uint64_t n =
      length == std::numeric_limits<std::uint64_t>::max() ? header.size() : length;
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  f << header << data;
  return path;
}

std::string open_error(const std::string& path) {
  try {
    SafetensorsFile::open(path);
  } catch (const kvevict::Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("half and bfloat16 conversions are exact where representable, round to even") {
  CHECK(float_to_half(1.0f) == 0x3C00);
  CHECK(float_to_half(-2.0f) == 0xC000);
  CHECK(float_to_half(65504.0f) == 0x7BFF);
  CHECK(float_to_half(65520.0f) == 0x7C00);                      // rounds up to infinity
  CHECK(float_to_half(std::ldexp(1.0f, -24)) == 0x0001);         // smallest subnormal
  CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);  // tie: to even
  CHECK(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);
  CHECK(half_to_float(0x3C00) == 1.0f);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(std::isinf(half_to_float(0x7C00)));
  CHECK(std::isnan(half_to_float(0x7E00)));
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);  // tie: to even
  CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
  CHECK(bf16_to_float(0xC040) == -3.0f);
  for (std::uint32_t h = 0; h < 0x7C00; ++h)  // every finite positive half round-trips
    REQUIRE(float_to_half(half_to_float(static_cast<std::uint16_t>(h))) == h);
}

TEST_CASE("tensors round-trip in F32, F16 and BF16") {
  const std::vector<float> vals{0.0f, 1.0f, -2.5f, 0.125f, 3.0f, -0.75f};  // exact in all three
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path,
                    {{"a", DType::f32, {2, 3}, vals},
                     {"b", DType::f16, {3, 2}, vals},
                     {"c", DType::bf16, {6}, vals}},
                    {{"note", "x\"y"}});
  const auto f = SafetensorsFile::open(path);
  REQUIRE(f.tensors().size() == 3);
  CHECK(f.metadata().at("note") == "x\"y");
  for (const char* n : {"a", "b", "c"}) {
    const TensorInfo* t = f.find(n);
    REQUIRE(t != nullptr);
    CHECK(f.read(*t) == vals);
  }
  CHECK(f.find("a")->shape == std::vector<std::size_t>{2, 3});
  CHECK(f.find("b")->dtype == DType::f16);
  CHECK(f.find("c")->end - f.find("c")->begin == 12);
  std::filesystem::remove(path);
}

TEST_CASE("a trace round-trips into a workload with its geometry and prompt") {
  SyntheticConfig c;
  c.layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.prompt = 16;
  c.steps = 16;
  const auto w = make_synthetic("mixed", c);
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    std::vector<TensorToWrite> ts;
    for (int l = 0; l < 2; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      ts.push_back({p + "q", dt, {32, 4, 64}, w.layers[l].q});
      ts.push_back({p + "k", dt, {32, 2, 64}, w.layers[l].k});
      ts.push_back({p + "v", dt, {32, 2, 64}, w.layers[l].v});
    }
    const std::string path = temp_path(std::string("trace_") + dtype_name(dt) + ".safetensors");
    write_safetensors(path, ts, {{"prompt_tokens", "10"}});
    const auto t = load_trace(path);
    CHECK(t.geometry == w.geometry);
    CHECK(t.tokens == 32);
    CHECK(t.prompt == 10);
    if (dt == DType::f32) {
      CHECK(t.layers[1].k == w.layers[1].k);
      CHECK(t.layers[0].q == w.layers[0].q);
    } else {
      const double tol = dt == DType::f16 ? 1e-3 : 8e-3;  // relative precision of the format
      for (std::size_t i = 0; i < w.layers[0].k.size(); ++i)
        REQUIRE(std::abs(t.layers[0].k[i] - w.layers[0].k[i]) <=
                tol * (std::abs(w.layers[0].k[i]) + 1e-3));
    }
    TraceOptions o;
    o.prompt = 20;
    o.steps = 5;
    const auto cut = load_trace(path, o);
    CHECK(cut.prompt == 20);
    CHECK(cut.tokens == 25);
    o.prompt = 32;
    CHECK_THROWS_WITH(load_trace(path, o), Contains("prompt = 32 tokens, expected < T = 32"));
    std::filesystem::remove(path);
  }
}

TEST_CASE("malformed files get a clear kvevict::Error") {
  const std::string ok_tensor = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string eight(8, '\0');
  CHECK(open_error(write_raw("ok", ok_tensor, eight)) == "no error");

  SECTION("missing or truncated") {
    CHECK_THROWS_WITH(SafetensorsFile::open(temp_path("does_not_exist")), Contains("cannot open"));
    const std::string p = temp_path("short");
    std::ofstream(p, std::ios::binary) << "abc";
    CHECK_THROWS_WITH(SafetensorsFile::open(p), Contains("expected at least 8"));
  }
  SECTION("bad header lengths") {
    CHECK_THAT(open_error(write_raw("len_big", ok_tensor, eight, 1000)),
               Contains("header length 1000"));
    CHECK_THAT(open_error(write_raw("len_huge", ok_tensor, eight, ~std::uint64_t{0} - 1)),
               Contains("header length"));
    CHECK_THAT(open_error(write_raw("len_zero", ok_tensor, eight, 0)), Contains("header length 0"));
  }
  SECTION("bad JSON") {
    for (const char* h :
         {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})",
          R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})",
          R"({"t":{"dtype":"F32,"shape":[2],"data_offsets":[0,8]}})", R"({"t":1,"t":2})",
          R"({"t":{"dtype":"F32"}} x)", R"([1, 2])",
          R"({"t":{"dtype":"F32","shape":[01],"data_offsets":[0,8]}})", "{\"t\":\"a\x01\"}"}) {
      const auto msg = open_error(write_raw("badjson", h, eight));
      INFO(h << " -> " << msg);
      CHECK_THAT(msg, Contains("safetensors"));
      CHECK(msg != "no error");
    }
    CHECK_THAT(open_error(write_raw("dup", R"({"t":1,"t":2})", eight)), Contains("duplicate key"));
    CHECK_THAT(open_error(write_raw("trail", R"({} x)", eight)), Contains("expected end of input"));
  }
  SECTION("strictness kept around the JSON library") {
    // nlohmann's lexer stops at a NUL byte: without the explicit check, bytes after it
    // would pass unread.
    const std::string ok = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    CHECK_THAT(open_error(write_raw("nul", ok + std::string(1, '\0') + "x", eight)),
               Contains("NUL byte"));
    CHECK_THAT(open_error(write_raw("nul_pad", "{}" + std::string(6, '\0'), eight)),
               Contains("NUL byte"));
    CHECK(open_error(write_raw("space_pad", "{}      ", eight)) == "no error");
    CHECK_THAT(open_error(write_raw("bom", "\xEF\xBB\xBF{}", eight)), Contains("byte-order mark"));
    CHECK_THAT(open_error(write_raw("dupmeta", R"({"__metadata__":{"a":"b","a":"c"}})", eight)),
               Contains("duplicate key \"a\""));
    CHECK_THAT(open_error(write_raw(
                   "dupfield",
                   R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"dtype":"F32"}})",
                   eight)),
               Contains("duplicate key \"dtype\""));
    // Depth: 64 nested arrays inside the header object pass the parser, 65 do not.
    auto nested = [](int d) {
      return R"({"__metadata__":)" + std::string(std::size_t(d), '[') +
             std::string(std::size_t(d), ']') + "}";
    };
    CHECK_THAT(open_error(write_raw("deep64", nested(64), eight)), Contains("not an object"));
    CHECK_THAT(open_error(write_raw("deep65", nested(65), eight)), Contains("nesting deeper than 64"));
    CHECK_THAT(open_error(write_raw("deep_huge", std::string(100000, '[') + std::string(100000, ']'),
                                    eight)),
               Contains("nesting deeper than 64"));
    // Offsets and shape entries: exact non-negative integers of at most 19 digits.
    for (const char* n : {"2.0", "2e0", "-0", "-2", "10000000000000000000", "18446744073709551615",
                          "18446744073709551616", "1e400"}) {
      const auto msg = open_error(write_raw(
          "num", std::string(R"({"t":{"dtype":"F32","shape":[)") + n + R"(, 0],"data_offsets":[0,0]}})",
          eight));
      INFO(n << " -> " << msg);
      CHECK_THAT(msg, Contains("safetensors"));
      CHECK(msg != "no error");
    }
    CHECK(open_error(write_raw("num19",
                               R"({"t":{"dtype":"F32","shape":[9999999999999999999, 0],"data_offsets":[0,0]}})",
                               eight)) == "no error");
    // Strings: escapes decoded, surrogates paired, control characters and ill-formed UTF-8
    // rejected (the hand-written parser accepted ill-formed UTF-8; RFC 8259 does not).
    CHECK(open_error(write_raw("esc", R"({"__metadata__":{"k\u00e9":"\ud83d\ude00 a\/b\n"}})",
                               eight)) == "no error");
    for (const std::string& h : {std::string(R"({"__metadata__":{"k":"\ud83d"}})"), std::string(R"({"__metadata__":{"k":"\ude00"}})"),
                                std::string(R"({"__metadata__":{"k":")") + "\xff" + "\"}}",
                                std::string(R"({"__metadata__":{"k":")") + "\xed\xa0\x80" + "\"}}",
                                std::string(R"({"__metadata__":{"k":"a)") + "\t" + "\"}}"}) {
      const auto msg = open_error(write_raw("str", h, eight));
      INFO(h << " -> " << msg);
      CHECK_THAT(msg, Contains("bad JSON header"));
    }
  }
  SECTION("offsets out of range or inconsistent with the shape") {
    CHECK_THAT(open_error(write_raw(
                   "off", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", eight)),
               Contains("data_offsets [0, 16] out of range"));
    CHECK_THAT(open_error(write_raw(
                   "rev", R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", eight)),
               Contains("out of range"));
    CHECK_THAT(open_error(write_raw(
                   "size", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight)),
               Contains("has 8 bytes of data, expected 12"));
    CHECK_THAT(open_error(write_raw(
                   "neg", R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight)),
               Contains("not a non-negative integer"));
    CHECK_THAT(
        open_error(write_raw(
            "overlap",
            R"({"a":{"dtype":"F16","shape":[4],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}})",
            eight)),
        Contains("overlap"));
    CHECK_THAT(
        open_error(write_raw(
            "huge", R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})",
            eight)),
        Contains("shape overflows"));
  }
  SECTION("wrong dtype or fields") {
    CHECK_THAT(open_error(write_raw(
                   "dtype", R"({"t":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})", eight)),
               Contains("dtype I8, expected F32, F16 or BF16"));
    CHECK_THAT(
        open_error(write_raw(
            "field", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight)),
        Contains("unknown field 'x'"));
    CHECK_THAT(open_error(write_raw("nooff", R"({"t":{"dtype":"F32","shape":[2]}})", eight)),
               Contains("needs dtype, shape and data_offsets"));
  }
  SECTION("traces with missing tensors or wrong shapes") {
    const std::string p = temp_path("trace_bad.safetensors");
    std::vector<float> q(2 * 4 * 8, 0.5f), kv(2 * 2 * 8, 0.25f);
    write_safetensors(
        p, {{"layers.0.q", DType::f32, {2, 4, 8}, q}, {"layers.0.k", DType::f32, {2, 2, 8}, kv}});
    CHECK_THROWS_WITH(load_trace(p), Contains("tensor 'layers.0.v' is missing"));
    write_safetensors(p, {{"layers.0.q", DType::f32, {2, 4, 8}, q},
                          {"layers.0.k", DType::f32, {2, 2, 8}, kv},
                          {"layers.0.v", DType::f32, {2, 8, 2}, kv}});
    CHECK_THROWS_WITH(load_trace(p),
                      Contains("'layers.0.v' has shape [2, 8, 2], expected [2, 2, 8]"));
    write_safetensors(p, {{"layers.0.q", DType::f32, {2, 3, 8}, std::vector<float>(48, 0.5f)},
                          {"layers.0.k", DType::f32, {2, 2, 8}, kv},
                          {"layers.0.v", DType::f32, {2, 2, 8}, kv}});
    CHECK_THROWS_WITH(load_trace(p), Contains("3 query heads is not a multiple of 2 KV heads"));
    write_safetensors(p, {{"q", DType::f32, {2, 4, 8}, q}});
    CHECK_THROWS_WITH(load_trace(p), Contains("no tensor 'layers.0.q'"));
    std::vector<float> bad = q;
    bad[3] = std::numeric_limits<float>::quiet_NaN();
    write_safetensors(p, {{"layers.0.q", DType::f32, {2, 4, 8}, bad},
                          {"layers.0.k", DType::f32, {2, 2, 8}, kv},
                          {"layers.0.v", DType::f32, {2, 2, 8}, kv}});
    CHECK_THROWS_WITH(load_trace(p), Contains("NaN or infinite"));
    std::filesystem::remove(p);
  }
}

TEST_CASE("a directory given as a safetensors file or trace is named in the error") {
  const std::string dir = std::filesystem::temp_directory_path().string();
  CHECK_THROWS_AS(SafetensorsFile::open(dir), kvevict::Error);
  CHECK_THROWS_WITH(SafetensorsFile::open(dir), Contains("safetensors '" + dir + "': is a directory"));
  CHECK_THROWS_WITH(load_trace(dir), Contains("is a directory"));
}
