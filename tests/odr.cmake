# ODR guard: two translation units that both include kvevict.hpp and instantiate every
# policy, linked into one executable. A non-inline definition in a header fails the link;
# the run checks both TUs compute the same result and share inline functions' addresses.
add_executable(kvevict_test_odr odr/odr_a.cpp odr/odr_b.cpp)
target_link_libraries(kvevict_test_odr PRIVATE kvevict::kvevict kvevict_warnings)
target_include_directories(kvevict_test_odr PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME "odr: two translation units" COMMAND kvevict_test_odr)
