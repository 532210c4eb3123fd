#pragma once
// kvevict: KV-cache eviction policies for LLM inference on the CPU. Includes everything.
#include "attention.hpp"
#include "cache.hpp"
#include "errors.hpp"
#include "geometry.hpp"
#include "metrics.hpp"
#include "policies/full_cache.hpp"
#include "policies/h2o.hpp"
#include "policies/knorm.hpp"
#include "policies/oracle.hpp"
#include "policies/random.hpp"
#include "policies/streaming_llm.hpp"
#include "policy.hpp"
