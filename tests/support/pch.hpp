// Precompiled once per flag set for the test executables under clang (tests/CMakeLists.txt,
// KVEVICT_TEST_PCH): Catch2's single header and the whole library, which almost every test
// TU parses. Tests that define configuration macros before their includes
// (KVEVICT_TEST_NO_PCH) do not use it.
#include <catch2/catch.hpp>
#include <kvevict/kvevict.hpp>
