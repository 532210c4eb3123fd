# Every registry policy through every example program once, and the tools' bad-argument
# handling (tests/example_policies.sh). Needs the example programs and the shared model.
if(KVEVICT_BUILD_EXAMPLES)
  add_test(NAME "examples: every policy in every program"
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/example_policies.sh
                   ${PROJECT_BINARY_DIR}/examples ${PROJECT_SOURCE_DIR}/../shared/models/stories260K)
  set_tests_properties("examples: every policy in every program" PROPERTIES SKIP_RETURN_CODE 77
                       TIMEOUT 600 COST 100)
endif()
