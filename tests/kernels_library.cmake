# The compiled-kernels mode (kvevict::kernels, include/kvevict/config.hpp): README's example,
# the two-translation-unit ODR test and the unit tests of what the library compiles (Hamming
# and attention kernels, SimHash, the observation window, error formatting), built against
# the static library instead of header-only. "same result" checks that the ODR exercise (every policy on one stream)
# prints the same 17-digit figure in both modes.
if(TARGET kvevict_kernels)
  # README's example is extracted by consumers.cmake (KVEVICT_TEST_CONSUMERS): without it
  # there is no readme_example.cpp to build.
  if(TARGET kvevict_readme_example)
    add_executable(kvevict_readme_example_separate ${CMAKE_CURRENT_BINARY_DIR}/readme_example.cpp)
    target_link_libraries(kvevict_readme_example_separate PRIVATE kvevict::kernels kvevict_warnings)
    add_test(NAME "kernels library: readme_example" COMMAND kvevict_readme_example_separate)
  endif()

  add_executable(kvevict_test_odr_separate odr/odr_a.cpp odr/odr_b.cpp)
  target_link_libraries(kvevict_test_odr_separate PRIVATE kvevict::kernels kvevict_warnings)
  target_include_directories(kvevict_test_odr_separate PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  add_test(NAME "kernels library: odr, same result as header-only"
           COMMAND sh -c "a=$($<TARGET_FILE:kvevict_test_odr>) && b=$($<TARGET_FILE:kvevict_test_odr_separate>) && echo \"header-only: $a\" && echo \"kernels lib: $b\" && test \"$a\" = \"$b\"")

  # (test_kernels_select is left out: it calls the per-ISA internals, kernels::detail::scalar
  # and ::avx2, which a separate-kernels TU does not see.)
  # decayed_attention and snapkv (and README, odr: H2O, StreamingLLM, FullCache) run on the
  # KVCache<P> / attend() instantiations compiled into the library (extern_templates.hpp).
  # Their own precompiled header (tests/CMakeLists.txt): KVEVICT_SEPARATE_KERNELS changes
  # what kvevict.hpp declares.
  if(KVEVICT_TEST_PCH)
    kvevict_test_pch_owner(kvevict_test_pch_separate kvevict::kernels kvevict_catch_main
                                                     kvevict_warnings)
  endif()
  foreach(name errors hash_evict snapkv decayed_attention kernels_hamming kernels_simhash
          kernels_attention)
    add_executable(kvevict_test_${name}_separate ${CMAKE_CURRENT_SOURCE_DIR}/test_${name}.cpp)
    target_link_libraries(kvevict_test_${name}_separate
                          PRIVATE kvevict::kernels kvevict_catch_main kvevict_warnings)
    target_include_directories(kvevict_test_${name}_separate PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
    if(KVEVICT_TEST_PCH AND NOT name IN_LIST KVEVICT_TEST_NO_PCH)
      target_precompile_headers(kvevict_test_${name}_separate REUSE_FROM kvevict_test_pch_separate)
    endif()
    catch_discover_tests(kvevict_test_${name}_separate TEST_PREFIX "kernels library, ${name}: ")
  endforeach()
endif()
