# Consumer builds (find_package after install, add_subdirectory): on by default; the
# sanitizer pass of scripts/test.sh turns them off (they do not build with its flags).
option(KVEVICT_TEST_CONSUMERS "Test kvevict as a consumer project sees it" ON)
if(KVEVICT_TEST_CONSUMERS)
# Two downstream projects: one through the installed package, one through add_subdirectory.
foreach(mode find_package add_subdirectory)
  add_test(NAME consumer_${mode}
           COMMAND ${CMAKE_COMMAND} -DMODE=${mode} -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -DBINARY_DIR=${PROJECT_BINARY_DIR} -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${mode}
                   -DCXX=${CMAKE_CXX_COMPILER}
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/run_consumer.cmake)
  set_tests_properties(consumer_${mode} PROPERTIES COST 20)  # a CMake build each (~8 s)
endforeach()

# README's usage example is compiled and run as a test, so the README cannot rot.
file(READ ${PROJECT_SOURCE_DIR}/README.md KVEVICT_README)
string(REGEX MATCH "<!-- usage-example-begin -->[^`]*```cpp\n(.*)```[^`]*<!-- usage-example-end -->"
       _ "${KVEVICT_README}")
if(NOT CMAKE_MATCH_1)
  message(FATAL_ERROR "README.md has no usage example between usage-example markers")
endif()
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/readme_example.cpp "${CMAKE_MATCH_1}")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/README.md)
add_executable(kvevict_readme_example ${CMAKE_CURRENT_BINARY_DIR}/readme_example.cpp)
target_link_libraries(kvevict_readme_example PRIVATE kvevict::kvevict kvevict_warnings)
add_test(NAME readme_example COMMAND kvevict_readme_example)
endif()
