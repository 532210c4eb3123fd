#pragma once
// The main() of the per-step policy benchmarks: prints the CPU and kvevict's active kernel
// ISA (also as Google Benchmark context), then runs the registered benchmarks.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <kvevict/kernels/kernels.hpp>
#include <string>

#include "cpu_model.hpp"

namespace kvbench {

inline int run_benchmarks(int argc, char** argv) {
  namespace kernels = kvevict::kernels;
  const std::string cpu = kvevict::examples::cpu_model();
  std::printf("CPU: %s; kvevict kernels ISA: %s\n", cpu.c_str(),
              kernels::isa_name(kernels::active_isa()));
  benchmark::AddCustomContext("cpu_model", cpu);
  benchmark::AddCustomContext("kvevict_isa", kernels::isa_name(kernels::active_isa()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace kvbench
