# The evaluation tool's headers live in examples/eval (and examples/common: the option
# parser and policy registry every example shares); their tests include them directly.
# safetensors.hpp reads and writes its JSON header with nlohmann::json.
find_package(fmt REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
foreach(target kvevict_test_workloads kvevict_test_safetensors kvevict_test_eval_runner
               kvevict_test_example_cli)
  if(TARGET ${target})
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/examples/eval
                                                 ${PROJECT_SOURCE_DIR}/examples/common)
    target_link_libraries(${target} PRIVATE fmt::fmt-header-only nlohmann_json::nlohmann_json)
  endif()
endforeach()
# test_eval_runner includes examples/eval/registry.hpp, whose runners reach the engines in
# every storage format (model_formats.hpp: 5 policy types x 9 formats x 2 protocols). The
# test exercises fp32 only (tests/kv_format_test.sh covers --kv-format through
# kvevict-eval), so it builds the registry without them: minutes less compile per pass.
if(TARGET kvevict_test_eval_runner)
  target_compile_definitions(kvevict_test_eval_runner PRIVATE KVEVICT_EVAL_FP32_ONLY)
endif()
