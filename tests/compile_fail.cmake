# Compile-fail tests: each tests/compile_fail/<name>.cpp holds a policy type missing a
# required member and must be rejected by the EvictionPolicy concept with a diagnostic
# that names the concept and then the missing requirement (its "// expect-diagnostic:"
# line). A control build of the same file with -DKVEVICT_COMPILE_FAIL_CONTROL supplies the
# member and must compile, so a broken include path cannot pass for a rejection.
get_target_property(_kvevict_cf_eigen Eigen3::Eigen INTERFACE_INCLUDE_DIRECTORIES)
set(_kvevict_cf_flags -std=c++20 -fsyntax-only -I${kvevict_SOURCE_DIR}/include)
foreach(dir ${_kvevict_cf_eigen})
  list(APPEND _kvevict_cf_flags -I${dir})
endforeach()

file(GLOB _kvevict_cf_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail/*.cpp)
foreach(src ${_kvevict_cf_sources})
  get_filename_component(name ${src} NAME_WE)
  file(STRINGS ${src} _expect REGEX "^// expect-diagnostic: " LIMIT_COUNT 1)
  string(REGEX REPLACE "^// expect-diagnostic: " "" _expect "${_expect}")
  if(_expect STREQUAL "")
    message(FATAL_ERROR "${src} has no '// expect-diagnostic: <text>' line")
  endif()
  string(REGEX REPLACE "([][.*+?()^$|\\\\])" "\\\\\\1" _expect_re "${_expect}")
  add_test(NAME "compile_fail: ${name}"
           COMMAND ${CMAKE_CXX_COMPILER} ${_kvevict_cf_flags} ${src})
  # PASS_REGULAR_EXPRESSION ignores the exit code; the regex needs an error diagnostic,
  # which a successful -fsyntax-only run never prints.
  set_tests_properties("compile_fail: ${name}" PROPERTIES
    PASS_REGULAR_EXPRESSION "EvictionPolicy.*${_expect_re}")
  add_test(NAME "compile_fail: ${name} (control)"
           COMMAND ${CMAKE_CXX_COMPILER} ${_kvevict_cf_flags} -DKVEVICT_COMPILE_FAIL_CONTROL ${src})
endforeach()
