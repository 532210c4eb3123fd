if(KVEVICT_TEST_ISA_RERUNS)
# HashEvict's whole test binary again with the kernels capped at lower ISA levels: the brute
# force it compares against is level-independent, so every level must pass it.
foreach(level scalar avx2)
  add_test(NAME "test_hash_evict: all, KVEVICT_ISA=${level}" COMMAND kvevict_test_hash_evict)
  set_tests_properties("test_hash_evict: all, KVEVICT_ISA=${level}"
                       PROPERTIES ENVIRONMENT "KVEVICT_ISA=${level}")
endforeach()
endif()
