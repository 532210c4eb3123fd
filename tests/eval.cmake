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
