// The test executables' precompiled header under g++ (tests/CMakeLists.txt; clang uses
// support/pch.hpp): Catch2, Eigen/Core and the standard headers, not kvevict.hpp. g++ 12 does
// not keep, in a PCH, its intrinsics headers' own warning suppressions: kvevict's kernels
// (<immintrin.h>) from a PCH print hundreds of -Wuninitialized warnings about
// _mm256_undefined_pd per TU. Eigen/Core without -mavx includes only the SSE headers.
#include <catch2/catch.hpp>
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
