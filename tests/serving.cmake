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
      PASS_REGULAR_EXPRESSION "\\| full \\| fp32 \\| 80 \\(80.0\\) \\| 80 \\| 1 \\| 1.00 \\| 80 \\| 256 \\|.*\\| 0.0000 \\|.*\\| decayed \\| fp32 \\| 80 \\(80.0\\) \\| 20 \\| 4 \\(4.00x full\\) \\|")
    # Quantized pools at equal bytes (--pool-kib 80): a Q8<8> row of head_dim 8 is 10 bytes
    # against fp32's 32, so 80 KiB hold 256 blocks of 16 tokens (K+V) against 80: the full
    # cache runs 3 sequences at once instead of 1, with a KL above 0 (quantization only).
    add_test(NAME "examples: serving smoke, quantized pool"
             COMMAND llama2c_serving --model-dir ${_model} --requests 4 --tokens 64
                     --budget 16 --pool-kib 80 --kv-format fp32,q8g8 --policies full,decayed
                     --quiet)
    set_tests_properties("examples: serving smoke, quantized pool" PROPERTIES TIMEOUT 120
      PASS_REGULAR_EXPRESSION "\\| full/fp32 \\| fp32 \\| 80 \\(80.0\\) \\| 80 \\| 1 \\|.*\\| full/q8g8 \\| q8g8 \\| 256 \\(80.0\\) \\| 80 \\| 3 \\(3.00x full\\) \\| [0-9.]+ \\| [0-9]+ \\| [0-9]+ \\| [0-9]+ \\([0-9.]+x full\\) \\| 0\\.[0-9]*[1-9].*\\| decayed/q8g8 \\| q8g8 \\| 256 \\(80.0\\) \\| 20 \\| 4 \\(4.00x full\\) \\|")
    add_test(NAME "examples: serving, --kv-format refuses an fp32-only policy"
             COMMAND llama2c_serving --model-dir ${_model} --requests 1 --tokens 8
                     --kv-format q8g8 --policies knorm --quiet)
    set_tests_properties("examples: serving, --kv-format refuses an fp32-only policy" PROPERTIES
      TIMEOUT 60 WILL_FAIL FALSE PASS_REGULAR_EXPRESSION "policy 'knorm' runs in fp32 only")
  endif()
endif()
