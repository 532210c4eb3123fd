# bench_kernels: comparison loops built for this CPU, FAISS (static libfaiss.a from Debian:
# needs OpenMP, LAPACK, BLAS at link time) and Highway's vqsort, each only if found.
# The library target itself never gets -march; only kernels_native_loops.cpp does.
if(TARGET bench_kernels)
  set(_kv_native ${CMAKE_CURRENT_SOURCE_DIR}/kernels_native_loops.cpp)
  target_sources(bench_kernels PRIVATE ${_kv_native})
  set_source_files_properties(${_kv_native} PROPERTIES COMPILE_OPTIONS "-march=native")

  find_path(KVEVICT_FAISS_INCLUDE faiss/utils/hamming.h)
  find_library(KVEVICT_FAISS_LIB NAMES faiss)
  find_package(OpenMP COMPONENTS CXX QUIET)
  find_package(LAPACK QUIET)
  find_package(BLAS QUIET)
  if(KVEVICT_FAISS_INCLUDE AND KVEVICT_FAISS_LIB AND OpenMP_CXX_FOUND AND LAPACK_FOUND AND BLAS_FOUND)
    target_include_directories(bench_kernels PRIVATE ${KVEVICT_FAISS_INCLUDE})
    target_link_libraries(bench_kernels PRIVATE ${KVEVICT_FAISS_LIB} ${LAPACK_LIBRARIES}
                          ${BLAS_LIBRARIES})
    # Link-time only: -fopenmp for libgomp, without changing how our sources compile.
    target_link_options(bench_kernels PRIVATE ${OpenMP_CXX_FLAGS})
    target_compile_definitions(bench_kernels PRIVATE KVEVICT_BENCH_HAVE_FAISS=1)
  else()
    message(STATUS "bench_kernels: FAISS comparison disabled (libfaiss, OpenMP, LAPACK or BLAS missing)")
  endif()

  find_path(KVEVICT_HWY_INCLUDE hwy/contrib/sort/vqsort.h)
  find_library(KVEVICT_HWY_LIB NAMES hwy)
  find_library(KVEVICT_HWY_CONTRIB_LIB NAMES hwy_contrib)
  if(KVEVICT_HWY_INCLUDE AND KVEVICT_HWY_LIB AND KVEVICT_HWY_CONTRIB_LIB)
    target_link_libraries(bench_kernels PRIVATE ${KVEVICT_HWY_CONTRIB_LIB} ${KVEVICT_HWY_LIB})
    target_compile_definitions(bench_kernels PRIVATE KVEVICT_BENCH_HAVE_HWY=1)
  endif()
endif()
