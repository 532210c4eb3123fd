# Smoke run of the serving example (examples/serving): a few requests from a pool that
# holds one full-cache sequence or four budgeted ones; the program checks its pool
# accounting (blocks in use <= reserved, every block back after each request, none left)
# and, with --repeat 2, that runs are deterministic. Needs the shared stories260K model.
if(KVEVICT_BUILD_EXAMPLES)
  set(_model ${PROJECT_SOURCE_DIR}/../shared/models/stories260K)
  if(EXISTS ${_model}/stories260K.bin)
    add_test(NAME "examples: serving smoke"
             COMMAND llama2c_serving --model-dir ${_model} --requests 4 --tokens 64
                     --budget 16 --pool-blocks 80 --policies full,decayed,h2o --repeat 2
                     --quiet)
    # full: 5 layers x 4 KV heads x 4 blocks = 80 (one at a time); budgeted: 20 blocks each.
    set_tests_properties("examples: serving smoke" PROPERTIES TIMEOUT 120
      PASS_REGULAR_EXPRESSION "\\| full \\| 80 \\| 1 \\| 1.00 \\| 80 \\| 256 \\|.*\\| 0.0000 \\|.*\\| decayed \\| 20 \\| 4 \\(4.00x full\\) \\|")
  endif()
endif()
