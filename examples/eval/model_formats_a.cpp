// kvevict-eval --model --kv-format: the engine in every storage format for DecayedAttention,
// StreamingLLM and FullCache (model_formats.hpp; model_formats_b.cpp holds the others, so
// the two build in parallel).
#include "model_formats.hpp"

namespace kvevict::eval {
template struct FormatRunner<policies::DecayedAttention>;
template struct FormatRunner<policies::StreamingLLM>;
template struct FormatRunner<policies::FullCache>;
}  // namespace kvevict::eval
