// ISA detection, the KVEVICT_ISA cap, and guards on pinned levels.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kvevict/kernels/dispatch.hpp"
#include "kvevict/kernels/hamming.hpp"

namespace kk = kvevict::kernels;
using kk::Isa;

TEST_CASE("active level never exceeds the detected level or the KVEVICT_ISA cap",
          "[kernels][dispatch]") {
  const Isa det = kk::detected_isa();
  const Isa act = kk::active_isa();
  REQUIRE(static_cast<int>(act) <= static_cast<int>(det));
  REQUIRE(kk::detected_isa() == det);  // stable across calls
  REQUIRE(kk::isa_supported(Isa::scalar));
  REQUIRE(kk::isa_supported(det));
  if (const char* env = std::getenv("KVEVICT_ISA"); env && *env)
    REQUIRE(static_cast<int>(act) <= static_cast<int>(kk::detail::parse_isa(env)));
  else
    REQUIRE(act == det);
  UNSCOPED_INFO("detected " << kk::isa_name(det) << ", active " << kk::isa_name(act));
}

TEST_CASE("KVEVICT_ISA values are parsed strictly", "[kernels][dispatch]") {
  REQUIRE(kk::detail::parse_isa("scalar") == Isa::scalar);
  REQUIRE(kk::detail::parse_isa("avx2") == Isa::avx2);
  REQUIRE(kk::detail::parse_isa("avx512") == Isa::avx512);
  REQUIRE(kk::detail::parse_isa("avx512vbmi2") == Isa::avx512);
  REQUIRE_THROWS_WITH(kk::detail::parse_isa("sse9"),
                      Catch::Contains("sse9") && Catch::Contains("scalar, avx2, avx512, avx512vbmi2"));
}

TEST_CASE("pinned levels above the CPU's throw instead of faulting", "[kernels][dispatch]") {
  std::uint8_t q[8] = {}, c[8] = {};
  std::uint16_t out[1];
  if (!kk::isa_supported(Isa::avx512))
    REQUIRE_THROWS_WITH(kk::hamming_distances<Isa::avx512>(q, c, 1, 64, out),
                        Catch::Contains("avx512"));
  else
    REQUIRE_NOTHROW(kk::hamming_distances<Isa::avx512>(q, c, 1, 64, out));
  if (!kk::isa_supported(Isa::avx2))
    REQUIRE_THROWS_AS(kk::hamming_distances<Isa::avx2>(q, c, 1, 64, out), std::invalid_argument);
}

TEST_CASE("compile-time guarantees match the runtime detection", "[kernels][dispatch]") {
#if KVEVICT_COMPILED_AVX512
  REQUIRE(kk::detected_isa() == Isa::avx512);
#endif
#if KVEVICT_COMPILED_AVX2
  REQUIRE(static_cast<int>(kk::detected_isa()) >= static_cast<int>(Isa::avx2));
#endif
  REQUIRE(std::string(kk::isa_name(Isa::avx2)) == "avx2");
}
