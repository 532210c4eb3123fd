# The evaluation tool's headers live in examples/eval; their tests include them directly.
foreach(target kvevict_test_workloads kvevict_test_safetensors kvevict_test_eval_runner)
  if(TARGET ${target})
    target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/examples/eval)
  endif()
endforeach()
