// No include guard, on purpose: included at the end of cache.hpp, attention.hpp and the
// headers of the policies listed below, it declares each instantiation once every header
// it needs has been seen (whatever the include order), and once only.
//
// Compiled-kernels mode (config.hpp, the kvevict::kernels target): the common cache types
// KVCache<P> (float storage) and attend() on them are instantiated once, in kvevict_kernels
// (src/kernels.cpp includes this file with KVEVICT_INSTANTIATE_COMMON, turning the
// declarations below into the definitions). A user translation unit sees
// `extern template` declarations and compiles none of the container and policy code behind
// KVCache<P>'s constructor, append, prefill and set_budget, nor attend's. KVCache's inline
// members (views, sizes) and other cache types are compiled where they are used, as in
// header-only mode, which is unchanged (nothing here applies there).
//
// The list: FullCache, StreamingLLM, H2O, DecayedAttention (TOVA and recommended() are
// configurations of it), SnapKV.
#include "config.hpp"

#if KVEVICT_KERNELS_DECLARE_ONLY || defined(KVEVICT_INSTANTIATE_COMMON)
#if defined(KVEVICT_INSTANTIATE_COMMON)
#define KVEVICT_EXTERN_TEMPLATE
#else
#define KVEVICT_EXTERN_TEMPLATE extern
#endif

#define KVEVICT_EXTERN_CACHE(P) \
  namespace kvevict {           \
  KVEVICT_EXTERN_TEMPLATE template class KVCache<P>; \
  }
#define KVEVICT_EXTERN_ATTEND(P)                                                              \
  namespace kvevict {                                                                         \
  KVEVICT_EXTERN_TEMPLATE template AttentionResult attend(KVCache<P>&, int,                   \
                                                          std::span<const float>,             \
                                                          AttendOptions);                     \
  KVEVICT_EXTERN_TEMPLATE template void attend(KVCache<P>&, int, std::span<const float>,      \
                                               std::span<float>, AttendWorkspace&,            \
                                               AttendOptions);                                \
  }

#if defined(KVEVICT_HAVE_CACHE_HPP) && defined(KVEVICT_HAVE_FULL_CACHE_HPP) && !defined(KVEVICT_EXTERN_CACHE_FULL)
#define KVEVICT_EXTERN_CACHE_FULL
KVEVICT_EXTERN_CACHE(policies::FullCache)
#endif
#if defined(KVEVICT_HAVE_ATTENTION_HPP) && defined(KVEVICT_EXTERN_CACHE_FULL) && !defined(KVEVICT_EXTERN_ATTEND_FULL)
#define KVEVICT_EXTERN_ATTEND_FULL
KVEVICT_EXTERN_ATTEND(policies::FullCache)
#endif

#if defined(KVEVICT_HAVE_CACHE_HPP) && defined(KVEVICT_HAVE_STREAMING_LLM_HPP) && !defined(KVEVICT_EXTERN_CACHE_STREAMING)
#define KVEVICT_EXTERN_CACHE_STREAMING
KVEVICT_EXTERN_CACHE(policies::StreamingLLM)
#endif
#if defined(KVEVICT_HAVE_ATTENTION_HPP) && defined(KVEVICT_EXTERN_CACHE_STREAMING) && !defined(KVEVICT_EXTERN_ATTEND_STREAMING)
#define KVEVICT_EXTERN_ATTEND_STREAMING
KVEVICT_EXTERN_ATTEND(policies::StreamingLLM)
#endif

#if defined(KVEVICT_HAVE_CACHE_HPP) && defined(KVEVICT_HAVE_H2O_HPP) && !defined(KVEVICT_EXTERN_CACHE_H2O)
#define KVEVICT_EXTERN_CACHE_H2O
KVEVICT_EXTERN_CACHE(policies::H2O)
#endif
#if defined(KVEVICT_HAVE_ATTENTION_HPP) && defined(KVEVICT_EXTERN_CACHE_H2O) && !defined(KVEVICT_EXTERN_ATTEND_H2O)
#define KVEVICT_EXTERN_ATTEND_H2O
KVEVICT_EXTERN_ATTEND(policies::H2O)
#endif

#if defined(KVEVICT_HAVE_CACHE_HPP) && defined(KVEVICT_HAVE_DECAYED_ATTENTION_HPP) && !defined(KVEVICT_EXTERN_CACHE_DECAYED)
#define KVEVICT_EXTERN_CACHE_DECAYED
KVEVICT_EXTERN_CACHE(policies::DecayedAttention)
#endif
#if defined(KVEVICT_HAVE_ATTENTION_HPP) && defined(KVEVICT_EXTERN_CACHE_DECAYED) && !defined(KVEVICT_EXTERN_ATTEND_DECAYED)
#define KVEVICT_EXTERN_ATTEND_DECAYED
KVEVICT_EXTERN_ATTEND(policies::DecayedAttention)
#endif

#if defined(KVEVICT_HAVE_CACHE_HPP) && defined(KVEVICT_HAVE_SNAPKV_HPP) && !defined(KVEVICT_EXTERN_CACHE_SNAPKV)
#define KVEVICT_EXTERN_CACHE_SNAPKV
KVEVICT_EXTERN_CACHE(policies::SnapKV)
#endif
#if defined(KVEVICT_HAVE_ATTENTION_HPP) && defined(KVEVICT_EXTERN_CACHE_SNAPKV) && !defined(KVEVICT_EXTERN_ATTEND_SNAPKV)
#define KVEVICT_EXTERN_ATTEND_SNAPKV
KVEVICT_EXTERN_ATTEND(policies::SnapKV)
#endif

#undef KVEVICT_EXTERN_CACHE
#undef KVEVICT_EXTERN_ATTEND
#undef KVEVICT_EXTERN_TEMPLATE
#endif
