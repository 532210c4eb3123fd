# Kernel tests also build as their own executable, so they can run while other test files are
# mid-edit, and run again with KVEVICT_ISA forcing each lower level.
file(GLOB KVEVICT_KERNEL_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/test_kernels_*.cpp)
add_executable(kvevict_kernel_tests main.cpp ${KVEVICT_KERNEL_TEST_SOURCES})
target_link_libraries(kvevict_kernel_tests PRIVATE kvevict::kvevict kvevict_warnings)
catch_discover_tests(kvevict_kernel_tests TEST_PREFIX "kernels:")
foreach(level scalar avx2)
  add_test(NAME kernels_isa_${level} COMMAND kvevict_kernel_tests "[kernels]")
  set_tests_properties(kernels_isa_${level} PROPERTIES ENVIRONMENT KVEVICT_ISA=${level})
endforeach()
