# bench_decode: the -march=native anchors live in their own translation unit; the library
# and bench_decode.cpp itself are built without -march (runtime dispatch, as a user gets).
if(TARGET bench_decode)
  set(_kv_decode_native ${CMAKE_CURRENT_SOURCE_DIR}/decode_native.cpp)
  target_sources(bench_decode PRIVATE ${_kv_decode_native})
  set_source_files_properties(${_kv_decode_native} PROPERTIES COMPILE_OPTIONS "-march=native")
endif()
