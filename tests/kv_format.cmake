# kvevict-eval --kv-format (the memory/quality frontier's option, docs/quality.md): one small
# stories260K run checked by tests/kv_format_test.sh (row bytes of fp32, Q8<8> and Q4<8>,
# bytes held, full-cache KL fp32 ~ 0 < Q8 < Q4), one small synthetic run (head_dim 128:
# row bytes, output error fp32 = 0 < Q8) and the option's bad arguments.
if(KVEVICT_BUILD_EXAMPLES)
  add_test(NAME "examples: kvevict-eval --kv-format"
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/kv_format_test.sh
                   $<TARGET_FILE:kvevict-eval> ${PROJECT_SOURCE_DIR}/../shared/models/stories260K)
  set_tests_properties("examples: kvevict-eval --kv-format" PROPERTIES SKIP_RETURN_CODE 77
                       TIMEOUT 300)
endif()
