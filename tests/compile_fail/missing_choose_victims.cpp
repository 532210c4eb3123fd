// expect-diagnostic: p.choose_victims
// Must NOT compile: a policy without choose_victims is rejected by the EvictionPolicy
// concept at KVCache's declaration, with a diagnostic naming the concept and the member.
// Built with -DKVEVICT_COMPILE_FAIL_CONTROL it is complete and must compile: that proves the
// failure comes from the missing member, not from include paths or flags.
#include <kvevict/cache.hpp>

struct IncompletePolicy {
  static constexpr kvevict::Signals signals = kvevict::Signals::none;
  static constexpr const char* name() { return "IncompletePolicy"; }
  std::size_t min_capacity() const { return 1; }
  void bind(const kvevict::CacheShape&) {}
#ifdef KVEVICT_COMPILE_FAIL_CONTROL
  void choose_victims(const kvevict::HeadView<float>&, std::vector<std::uint32_t>&) {}
#endif
  void on_append(const kvevict::HeadView<float>&, std::size_t) {}
  void on_move(int, int, std::size_t, std::size_t) {}
};

int main() {
  kvevict::KVCache<IncompletePolicy> cache({1, 1, 1, 4}, kvevict::Budget::uniform(4));
  return static_cast<int>(cache.size(0, 0));
}
