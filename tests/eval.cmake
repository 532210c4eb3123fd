# The evaluation tool's headers live in examples/eval; their tests include them directly.
# safetensors.hpp reads and writes its JSON header with nlohmann::json.
find_package(nlohmann_json 3 REQUIRED)
foreach(target kvevict_test_workloads kvevict_test_safetensors kvevict_test_eval_runner)
  if(TARGET ${target})
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/examples/eval)
    target_link_libraries(${target} PRIVATE nlohmann_json::nlohmann_json)
  endif()
endforeach()
