// One copy of kvevict's topk_indices per include tree, for bench/select_ab/ab.cpp: the
// namespace renamed (VARIANT_NS) so two trees (main's and a branch's) link into one binary
// and run interleaved in one process. Built by bench/run_select_ab.sh, not by CMake.
#define kvevict VARIANT_NS
#include <kvevict/kernels/select.hpp>
#undef kvevict
void VARIANT_FN(const float* s, std::size_t n, std::size_t k, std::uint32_t* out) {
  VARIANT_NS::kernels::topk_indices(s, n, k, out);
}
