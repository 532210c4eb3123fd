# The Hugging Face checkpoint reader (examples/llama2c/hf.hpp): tests/hf_test.py converts
# stories260K to the Hugging Face layout (scripts/llama2c_to_hf.py) and writes small
# random-weight checkpoints of every supported variant with a numpy reference forward
# pass, plus malformed checkpoints, then drives kvevict_hf_tool on them. Needs python3
# with numpy (scripts/install-deps.sh installs python3-numpy); skipped with a message
# otherwise.
find_package(fmt REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
add_executable(kvevict_hf_tool ${CMAKE_CURRENT_SOURCE_DIR}/hf_tool.cpp)
target_link_libraries(kvevict_hf_tool PRIVATE kvevict::kvevict kvevict_warnings fmt::fmt-header-only
                                              nlohmann_json::nlohmann_json)
# The tool drives example code (examples/llama2c/hf.hpp): KVEVICT_QUICK_BUILD (CI) compiles it
# at -O1 like every target here (tests/CMakeLists.txt); the sanitizer pass runs the same test at -O0.
# The first python3 that imports numpy (a pyenv shim first on PATH may lack it, Debian's
# /usr/bin/python3 with python3-numpy has it); without one the test still runs and skips.
find_package(Python3 COMPONENTS Interpreter)
set(KVEVICT_HF_PYTHON "")
foreach(candidate ${Python3_EXECUTABLE} /usr/bin/python3)
  if(NOT KVEVICT_HF_PYTHON AND EXISTS ${candidate})
    execute_process(COMMAND ${candidate} -c "import numpy" RESULT_VARIABLE numpy_missing
                    OUTPUT_QUIET ERROR_QUIET)
    if(numpy_missing EQUAL 0)
      set(KVEVICT_HF_PYTHON ${candidate})
    endif()
  endif()
endforeach()
if(NOT KVEVICT_HF_PYTHON AND Python3_Interpreter_FOUND)
  set(KVEVICT_HF_PYTHON ${Python3_EXECUTABLE})
endif()
# With the examples, the llama2c demo's generated text from the converted stories260K
# (tokenizer.json) is compared with the llama2.c original's (skipped when not built).
set(KVEVICT_HF_LLAMA2C "")
if(KVEVICT_BUILD_EXAMPLES)
  set(KVEVICT_HF_LLAMA2C $<TARGET_FILE:llama2c>)
endif()
if(KVEVICT_HF_PYTHON)
  add_test(NAME hf_checkpoints
           COMMAND ${KVEVICT_HF_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/hf_test.py
                   $<TARGET_FILE:kvevict_hf_tool>
                   ${PROJECT_SOURCE_DIR}/../shared/models/stories260K
                   ${CMAKE_CURRENT_BINARY_DIR}/hf_checkpoints ${KVEVICT_HF_LLAMA2C})
  set_tests_properties(hf_checkpoints PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300 COST 50)
else()
  message(STATUS "kvevict: python3 not found, test hf_checkpoints not registered")
endif()
