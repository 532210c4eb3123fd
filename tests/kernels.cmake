# The kernel test binaries (kvevict_test_kernels_*) run again with KVEVICT_ISA capping the
# level, so the scalar and AVX2 paths are checked on an AVX-512 machine too.
file(GLOB KVEVICT_KERNEL_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/test_kernels_*.cpp)
# KVEVICT_TEST_ISA_RERUNS (tests/CMakeLists.txt) off: no reruns.
if(NOT KVEVICT_TEST_ISA_RERUNS)
  set(KVEVICT_KERNEL_TEST_SOURCES "")
endif()
foreach(src ${KVEVICT_KERNEL_TEST_SOURCES})
  get_filename_component(name ${src} NAME_WE)
  string(REGEX REPLACE "^test_" "kvevict_test_" target ${name})
  set(levels scalar avx2)
  # avx512 below its VBMI2 sub-level: the plain AVX-512 float top-k on a VBMI2 CPU too.
  if(name STREQUAL "test_kernels_select")
    list(APPEND levels avx512)
  endif()
  foreach(level ${levels})
    add_test(NAME "${name}: all, KVEVICT_ISA=${level}" COMMAND ${target})
    set_tests_properties("${name}: all, KVEVICT_ISA=${level}" PROPERTIES ENVIRONMENT KVEVICT_ISA=${level})
  endforeach()
endforeach()
