// expect-diagnostic: P::signals
// Must NOT compile: a policy that does not declare its signals is rejected by the
// EvictionPolicy concept. With -DKVEVICT_COMPILE_FAIL_CONTROL it is complete and compiles.
#include <kvevict/cache.hpp>

struct SilentPolicy {
#ifdef KVEVICT_COMPILE_FAIL_CONTROL
  static constexpr kvevict::Signals signals = kvevict::Signals::none;
#endif
  static constexpr const char* name() { return "SilentPolicy"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const kvevict::CacheShape&) {}
  void choose_victims(const kvevict::HeadView<float>&, std::vector<std::uint32_t>&) {}
  void on_append(const kvevict::HeadView<float>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
};

int main() {
  kvevict::KVCache<SilentPolicy> cache({1, 1, 1, 4}, kvevict::Budget::uniform(4));
  return static_cast<int>(cache.size(0, 0));
}
