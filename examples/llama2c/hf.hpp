#pragma once
// Reads a Hugging Face Llama-family checkpoint directory into the engine's Model
// (llama2c.hpp): config.json (nlohmann::json, strict: every field the reader does not
// know or cannot honour is an error naming it) and one or several *.safetensors files,
// memory-mapped, weights kept in their stored type (F32, F16, BF16). Supported: Llama
// (1/2/3, incl. llama3 and linear rope_scaling, attention_bias), Qwen2 (q/k/v biases),
// Qwen3 (per-head q/k RMSNorm), tied or untied embeddings, GQA, an explicit head_dim.
// Hugging Face stores q/k projections for rotate_half RoPE, so the model runs with
// RopeStyle::half (scripts/llama2c_to_hf.py permutes llama2.c's rows into that layout).
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "../eval/safetensors.hpp"
#include "kvevict/errors.hpp"
#include "kvevict/file.hpp"
#include "llama2c.hpp"

namespace kvevict::llama2c::hf {

static_assert(std::endian::native == std::endian::little,
              "the safetensors views assume a little-endian host");

using eval::SafetensorsFile;
using eval::TensorInfo;
namespace json = eval::json;

/// A directory is a Hugging Face checkpoint when it holds config.json.
inline bool is_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec) &&
         std::filesystem::is_regular_file(std::filesystem::path(path) / "config.json", ec);
}

namespace detail {
using kvevict::detail::fail;
using kvevict::detail::require;

// config.json's fields, each read once; what is left at the end is unknown.
class ConfigReader {
 public:
  ConfigReader(const json::Value& root, std::string where) : where_(std::move(where)) {
    require(root.is_object(), where_, ": config.json is not a JSON object");
    for (const auto& [k, v] : root.items()) fields_.emplace(k, &v);
  }
  const json::Value* take(const std::string& key) {
    const auto it = fields_.find(key);
    if (it == fields_.end()) return nullptr;
    const json::Value* v = it->second;
    fields_.erase(it);
    return v;
  }
  int integer(const std::string& key, std::optional<int> fallback, std::int64_t lo,
              std::int64_t hi) {
    const json::Value* v = take(key);
    if (v == nullptr || v->is_null()) {
      require(fallback.has_value(), where_, ": config.json has no field '", key, "'");
      return *fallback;
    }
    require(v->is_number_integer(), where_, ": config.json field '", key, "' = ", v->dump(),
            ", expected an integer");
    const auto n = v->get<std::int64_t>();
    require(n >= lo && n <= hi, where_, ": config.json field '", key, "' = ", n,
            ", expected ", lo, "..", hi);
    return static_cast<int>(n);
  }
  double number(const std::string& key, double fallback, double lo, double hi) {
    const json::Value* v = take(key);
    if (v == nullptr || v->is_null()) return fallback;
    require(v->is_number(), where_, ": config.json field '", key, "' = ", v->dump(),
            ", expected a number");
    const auto x = v->get<double>();
    require(std::isfinite(x) && x >= lo && x <= hi, where_, ": config.json field '", key,
            "' = ", x, ", expected ", lo, "..", hi);
    return x;
  }
  bool boolean(const std::string& key, bool fallback) {
    const json::Value* v = take(key);
    if (v == nullptr || v->is_null()) return fallback;
    require(v->is_boolean(), where_, ": config.json field '", key, "' = ", v->dump(),
            ", expected true or false");
    return v->get<bool>();
  }
  std::string text(const std::string& key, const std::string& fallback) {
    const json::Value* v = take(key);
    if (v == nullptr || v->is_null()) return fallback;
    require(v->is_string(), where_, ": config.json field '", key, "' = ", v->dump(),
            ", expected a string");
    return v->get<std::string>();
  }
  /// A field that must have one value (or be absent / null) for the reader to be right.
  void must_be(const std::string& key, const json::Value& allowed, const char* why) {
    const json::Value* v = take(key);
    if (v == nullptr || v->is_null()) return;
    require(*v == allowed, where_, ": config.json field '", key, "' = ", v->dump(),
            " is not supported (", why, ")");
  }
  void ignore(std::initializer_list<const char*> keys) {
    for (const char* k : keys) take(k);
  }
  void finish() const {
    if (!fields_.empty())
      fail(where_, ": config.json field '", fields_.begin()->first,
           "' is not supported (unknown to kvevict's Llama-family reader; docs/real_models.md)");
  }

 private:
  std::string where_;
  std::map<std::string, const json::Value*> fields_;
};

// The RoPE fields of an object holding a rope type and its parameters: config.json's
// `rope_scaling` (transformers v4) or `rope_parameters` (v5, which also holds rope_theta;
// `field` names the object in errors). `allowed_extra` keys are accepted and left to the
// caller. Every other key must belong to the type: nothing is silently ignored.
inline RopeScaling parse_rope_object(const json::Value& v, const std::string& where,
                                     const char* field, bool type_required,
                                     std::initializer_list<const char*> allowed_extra) {
  RopeScaling s;
  require(v.is_object(), where, ": config.json field '", field, "' = ", v.dump(),
          ", expected an object or null");
  std::string type;
  for (const char* key : {"rope_type", "type"})
    if (v.contains(key)) {
      require(v[key].is_string(), where, ": config.json field '", field, ".", key, "' = ",
              v[key].dump(), ", expected a string");
      require(type.empty() || type == v[key].get<std::string>(), where, ": config.json ", field,
              " has type and rope_type that differ");
      type = v[key].get<std::string>();
    }
  if (type.empty()) {
    require(!type_required, where, ": config.json field '", field,
            "' has no 'rope_type' (or 'type')");
    type = "default";
  }
  if (type == "linear")
    s.kind = RopeScaling::Kind::linear;
  else if (type == "llama3")
    s.kind = RopeScaling::Kind::llama3;
  else if (type != "default")
    fail(where, ": config.json field '", field, "' has type '", type,
         "', which is not supported (supported: linear, llama3, default)");
  auto num = [&](const char* key, double& out, bool required) {
    if (!v.contains(key)) {
      require(!required, where, ": config.json field '", field, ".", key,
              "' is missing (needed by rope type ", type, ")");
      return;
    }
    const auto& x = v[key];
    require(x.is_number() && std::isfinite(x.get<double>()) && x.get<double>() > 0, where,
            ": config.json field '", field, ".", key, "' = ", x.dump(),
            ", expected a positive number");
    out = x.get<double>();
  };
  const bool scaled = s.kind != RopeScaling::Kind::none;
  const bool l3 = s.kind == RopeScaling::Kind::llama3;
  if (scaled) {
    num("factor", s.factor, true);
    require(s.factor >= 1.0, where, ": config.json field '", field, ".factor' = ", s.factor,
            ", expected >= 1");
  }
  if (l3) {
    num("low_freq_factor", s.low_freq_factor, true);
    num("high_freq_factor", s.high_freq_factor, true);
    num("original_max_position_embeddings", s.original_max_position_embeddings, true);
    require(s.high_freq_factor > s.low_freq_factor, where, ": config.json ", field,
            " high_freq_factor = ", s.high_freq_factor, ", expected > low_freq_factor = ",
            s.low_freq_factor);
  }
  for (const auto& [k, x] : v.items()) {
    bool known = k == "rope_type" || k == "type" || (scaled && k == "factor") ||
                 (l3 && (k == "low_freq_factor" || k == "high_freq_factor" ||
                         k == "original_max_position_embeddings"));
    for (const char* e : allowed_extra) known = known || k == e;
    require(known, where, ": config.json field '", field, ".", k,
            "' is not supported for rope type ", type);
  }
  return s;
}

/// transformers v4's `rope_scaling`: null, or an object with its type.
inline RopeScaling parse_rope_scaling(const json::Value& v, const std::string& where) {
  if (v.is_null()) return {};
  return parse_rope_object(v, where, "rope_scaling", true, {});
}

/// RoPE's theta and scaling from config.json: v4's `rope_theta` and `rope_scaling`, or
/// v5's `rope_parameters` object holding both (its `rope_type` defaults to "default",
/// its `rope_theta` to the top-level one, else 10000). Both forms may appear only when
/// they agree.
inline void parse_rope(ConfigReader& r, Config& c, const std::string& where) {
  const json::Value* theta = r.take("rope_theta");
  const json::Value* scaling = r.take("rope_scaling");
  const json::Value* params = r.take("rope_parameters");
  auto theta_of = [&](const json::Value& x, const char* field) {
    require(x.is_number() && std::isfinite(x.get<double>()) && x.get<double>() >= 1.0 &&
                x.get<double>() <= 1e12,
            where, ": config.json field '", field, "' = ", x.dump(), ", expected 1..1e12");
    return x.get<double>();
  };
  const bool has_theta = theta != nullptr && !theta->is_null();
  const bool has_scaling = scaling != nullptr && !scaling->is_null();
  c.rope_theta = has_theta ? theta_of(*theta, "rope_theta") : 10000.0;
  if (has_scaling) c.rope_scaling = parse_rope_scaling(*scaling, where);
  if (params == nullptr || params->is_null()) return;
  const RopeScaling s = parse_rope_object(*params, where, "rope_parameters", false, {"rope_theta"});
  const double t = params->contains("rope_theta")
                       ? theta_of((*params)["rope_theta"], "rope_parameters.rope_theta")
                       : c.rope_theta;  // absent: the top-level rope_theta, else 10000
  require(!has_theta || t == c.rope_theta, where, ": config.json field 'rope_theta' = ",
          c.rope_theta, " conflicts with 'rope_parameters.rope_theta' = ", t,
          " (give one, or the same value in both)");
  if (has_scaling && !(s == c.rope_scaling))  // (require() would evaluate scaling->dump())
    fail(where, ": config.json field 'rope_scaling' = ", scaling->dump(),
         " conflicts with 'rope_parameters' = ", params->dump(),
         " (give one, or the same scaling in both)");
  c.rope_theta = t;
  c.rope_scaling = s;
}

/// What config.json says beyond Config: which optional tensors the model has.
struct Variant {
  bool qkv_bias = false;  ///< q/k/v projections have biases (Qwen2; Llama attention_bias)
  bool o_bias = false;    ///< o_proj has a bias (Llama attention_bias)
  bool qk_norm = false;   ///< per-head q/k RMSNorm (Qwen3)
};

inline std::pair<Config, Variant> parse_config(const json::Value& root, const std::string& where) {
  ConfigReader r(root, where);
  const std::string type = r.text("model_type", "");
  require(type == "llama" || type == "qwen2" || type == "qwen3", where,
          ": config.json field 'model_type' = \"", type,
          "\" is not supported (supported: llama, qwen2, qwen3)");
  Config c;
  Variant var;
  constexpr std::int64_t kDim = 1 << 20;
  c.dim = r.integer("hidden_size", std::nullopt, 1, kDim);
  c.hidden_dim = r.integer("intermediate_size", std::nullopt, 1, kDim);
  c.n_layers = r.integer("num_hidden_layers", std::nullopt, 1, 4096);
  c.n_heads = r.integer("num_attention_heads", std::nullopt, 1, 4096);
  c.n_kv_heads = r.integer("num_key_value_heads", c.n_heads, 1, 4096);
  c.vocab_size = r.integer("vocab_size", std::nullopt, 1, 1 << 24);
  require(c.dim % c.n_heads == 0 || root.contains("head_dim"), where,
          ": config.json hidden_size = ", c.dim, " is not a multiple of num_attention_heads = ",
          c.n_heads, " and there is no head_dim");
  c.head_size = r.integer("head_dim", c.dim / c.n_heads, 2, 4096);
  require(c.head_size >= 2 && c.head_size % 2 == 0, where, ": config.json head_dim = ",
          c.head_size, ", expected even and >= 2 (RoPE rotates pairs)");
  require(c.n_heads % c.n_kv_heads == 0, where, ": config.json num_attention_heads = ", c.n_heads,
          " is not a multiple of num_key_value_heads = ", c.n_kv_heads);
  c.seq_len = r.integer("max_position_embeddings", 2048, 1, 1 << 24);
  c.norm_eps = static_cast<float>(r.number("rms_norm_eps", 1e-6, 0.0, 1.0));
  parse_rope(r, c, where);
  c.rope = RopeStyle::half;
  c.shared_classifier = r.boolean("tie_word_embeddings", false);
  if (const json::Value* b = r.take("bos_token_id"); b != nullptr && !b->is_null()) {
    require(b->is_number_integer() && b->get<std::int64_t>() >= 0 &&
                b->get<std::int64_t>() < c.vocab_size,
            where, ": config.json field 'bos_token_id' = ", b->dump(), ", expected 0..",
            c.vocab_size - 1);
    c.bos_token = static_cast<int>(b->get<std::int64_t>());
  } else {
    c.bos_token = 0;
  }
  const std::string act = r.text("hidden_act", "silu");
  require(act == "silu", where, ": config.json field 'hidden_act' = \"", act,
          "\" is not supported (the engine's MLP is SwiGLU: silu)");
  r.must_be("pretraining_tp", 1, "only 1: the weights are not split");
  r.must_be("mlp_bias", false, "the engine's MLP has no biases");
  r.must_be("use_sliding_window", false, "the engine attends to every cached token");
  r.must_be("use_mrope", false, "multimodal RoPE");
  if (const json::Value* lt = r.take("layer_types"); lt != nullptr && !lt->is_null()) {
    require(lt->is_array(), where, ": config.json field 'layer_types' is not an array");
    for (const auto& x : *lt)
      require(x == "full_attention", where, ": config.json field 'layer_types' holds ", x.dump(),
              ", which is not supported (only full_attention)");
  }
  const bool attention_bias = r.boolean("attention_bias", false);
  if (type == "llama") {
    var.qkv_bias = var.o_bias = attention_bias;
  } else if (type == "qwen2") {
    var.qkv_bias = true;
  } else {  // qwen3
    var.qkv_bias = var.o_bias = attention_bias;
    var.qk_norm = true;
  }
  // Fields that do not change the forward pass.
  r.ignore({"architectures", "torch_dtype", "dtype", "transformers_version", "eos_token_id",
            "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "_name_or_path",
            "sliding_window", "max_window_layers", "tokenizer_class", "bos_token", "eos_token",
            "output_attentions", "output_hidden_states", "return_dict"});
  r.finish();
  return {c, var};
}

/// Resolves tensors by name over every shard, each used once.
class TensorSet {
 public:
  TensorSet(const std::vector<SafetensorsFile>& shards, std::string where)
      : where_(std::move(where)) {
    for (const auto& f : shards)
      for (const auto& t : f.tensors()) {
        require(by_name_.emplace(t.name, Entry{&f, &t}).second, where_, ": tensor '", t.name,
                "' appears in more than one safetensors file (", f.path(), ")");
      }
  }

  /// The tensor `name` with exactly `shape`, or nullptr when optional and absent.
  const std::pair<const SafetensorsFile*, const TensorInfo*>* get(
      const std::string& name, const std::vector<std::size_t>& shape, bool optional = false) {
    const auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      require(optional, where_, ": tensor '", name, "' is missing");
      return nullptr;
    }
    require(!it->second.used, where_, ": tensor '", name, "' used twice");
    it->second.used = true;
    const auto& t = *it->second.info;
    require(t.shape == shape, where_, ": tensor '", name, "' has shape ", shape_text(t.shape),
            ", expected ", shape_text(shape));
    got_ = {it->second.file, it->second.info};
    return &got_;
  }

  /// Every tensor must have been used (the rotary tables some exports carry are derived
  /// from config.json and skipped).
  void finish() const {
    for (const auto& [name, e] : by_name_)
      if (!e.used && !name.ends_with("rotary_emb.inv_freq"))
        fail(where_, ": tensor '", name,
             "' is not part of the supported model (an unsupported variant?)");
  }

  static std::string shape_text(const std::vector<std::size_t>& s) {
    std::string o = "[";
    for (std::size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
    return o + "]";
  }

 private:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
    bool used = false;
  };
  std::string where_;
  std::map<std::string, Entry> by_name_;
  std::pair<const SafetensorsFile*, const TensorInfo*> got_;
};

}  // namespace detail

/// Builds a Model from config.json's text and the opened shards (the directory reader's
/// core, also what the fuzz target drives). `where` names the checkpoint in errors.
inline Model assemble(const std::string& config_text, std::vector<SafetensorsFile> shards,
                      const std::string& where) {
  using detail::require;
  const json::Value root = json::parse(config_text, where + ": config.json", "JSON");
  auto [c, var] = detail::parse_config(root, where);
  Model::Parts p;
  p.config = c;
  auto files = std::make_shared<const std::vector<SafetensorsFile>>(std::move(shards));
  p.keep.push_back(files);
  detail::TensorSet set(*files, where);
  const auto D = static_cast<std::size_t>(c.dim);
  const auto V = static_cast<std::size_t>(c.vocab_size);
  const auto Q = static_cast<std::size_t>(c.q_dim());
  const auto KV = static_cast<std::size_t>(c.kv_dim());
  const auto F = static_cast<std::size_t>(c.hidden_dim);
  const auto hd = static_cast<std::size_t>(c.head_dim());

  // A matrix view in its stored type; a tensor whose data is not aligned to its element
  // size is widened to an owned float copy (safetensors does not promise alignment).
  auto matrix = [&](const std::string& name, std::size_t rows, std::size_t cols) {
    const auto* got = set.get(name, {rows, cols});
    const SafetensorsFile& f = *got->first;
    const TensorInfo& t = *got->second;
    const char* data = f.data(t);
    const std::size_t size = tensor::dtype_size(t.dtype);
    Weight w{data, t.dtype, static_cast<int>(rows), static_cast<int>(cols)};
    if (reinterpret_cast<std::uintptr_t>(data) % size != 0) {
      p.owned.push_back(f.read(t));
      w = Weight{p.owned.back().data(), tensor::DType::f32, w.rows, w.cols};
    }
    return w;
  };
  // A vector (norm weight, bias), widened to float and checked finite.
  auto vector = [&](const std::string& name, std::size_t n, bool optional) -> const float* {
    const auto* got = set.get(name, {n}, optional);
    if (got == nullptr) return nullptr;
    std::vector<float> v = got->first->read(*got->second);
    for (std::size_t i = 0; i < v.size(); ++i)
      require(std::isfinite(v[i]), where, ": tensor '", name, "' element ", i, " = ", v[i],
              ", expected finite");
    p.owned.push_back(std::move(v));
    return p.owned.back().data();
  };
  p.emb = matrix("model.embed_tokens.weight", V, D);
  p.cls = c.shared_classifier ? p.emb : matrix("lm_head.weight", V, D);
  p.rms_final = vector("model.norm.weight", D, false);
  p.layers.resize(static_cast<std::size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    Model::Layer& y = p.layers[static_cast<std::size_t>(l)];
    y.rms_att = vector(pre + "input_layernorm.weight", D, false);
    y.wq = matrix(pre + "self_attn.q_proj.weight", Q, D);
    y.wk = matrix(pre + "self_attn.k_proj.weight", KV, D);
    y.wv = matrix(pre + "self_attn.v_proj.weight", KV, D);
    y.wo = matrix(pre + "self_attn.o_proj.weight", D, Q);
    if (var.qkv_bias) {
      y.bq = vector(pre + "self_attn.q_proj.bias", Q, false);
      y.bk = vector(pre + "self_attn.k_proj.bias", KV, false);
      y.bv = vector(pre + "self_attn.v_proj.bias", KV, false);
    }
    if (var.o_bias) y.bo = vector(pre + "self_attn.o_proj.bias", D, false);
    if (var.qk_norm) {
      y.q_norm = vector(pre + "self_attn.q_norm.weight", hd, false);
      y.k_norm = vector(pre + "self_attn.k_norm.weight", hd, false);
    }
    y.rms_ffn = vector(pre + "post_attention_layernorm.weight", D, false);
    y.w1 = matrix(pre + "mlp.gate_proj.weight", F, D);
    y.w3 = matrix(pre + "mlp.up_proj.weight", F, D);
    y.w2 = matrix(pre + "mlp.down_proj.weight", D, F);
  }
  set.finish();
  return Model::assemble(std::move(p));
}

/// Reads the checkpoint directory `dir`: config.json, then model.safetensors.index.json's
/// shards (plain file names inside `dir`) or else the one model.safetensors, each mapped.
inline Model load(const std::string& dir) {
  namespace fs = std::filesystem;
  using detail::require;
  const std::string where = "checkpoint '" + dir + "'";
  const fs::path root(dir);
  const auto cfg = kvevict::detail::read_file((root / "config.json").string(), "config.json");
  std::vector<SafetensorsFile> shards;
  std::error_code ec;
  const fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    const auto bytes = kvevict::detail::read_file(index.string(), "safetensors index");
    const json::Value idx = json::parse(std::string_view(bytes.data(), bytes.size()),
                                        where + ": model.safetensors.index.json", "JSON");
    require(idx.is_object() && idx.contains("weight_map") && idx["weight_map"].is_object(), where,
            ": model.safetensors.index.json has no object 'weight_map'");
    std::map<std::string, std::size_t> shard_of_file;
    std::vector<std::pair<std::string, std::string>> entries;  // tensor, file
    for (const auto& [tensor_name, file] : idx["weight_map"].items()) {
      require(file.is_string(), where, ": model.safetensors.index.json weight_map['", tensor_name,
              "'] is not a string");
      const std::string f = file.get<std::string>();
      require(!f.empty() && f.find('/') == std::string::npos && f.find('\\') == std::string::npos &&
                  f != "." && f != "..",
              where, ": model.safetensors.index.json names file '", f,
              "', expected a plain file name in the directory");
      if (!shard_of_file.count(f)) {
        shard_of_file.emplace(f, shards.size());
        shards.push_back(SafetensorsFile::open_mapped((root / f).string()));
      }
      entries.emplace_back(tensor_name, f);
    }
    require(!shards.empty(), where, ": model.safetensors.index.json has an empty weight_map");
    for (const auto& [tensor_name, f] : entries)
      require(shards[shard_of_file.at(f)].find(tensor_name) != nullptr, where,
              ": model.safetensors.index.json puts tensor '", tensor_name, "' in ", f,
              ", which does not hold it");
  } else {
    shards.push_back(SafetensorsFile::open_mapped((root / "model.safetensors").string()));
  }
  return assemble(std::string(cfg.begin(), cfg.end()), std::move(shards), where);
}

}  // namespace kvevict::llama2c::hf

namespace kvevict::llama2c {

/// Either format: a directory holding config.json is a Hugging Face checkpoint; anything
/// else is a llama2.c version-0 checkpoint file.
inline Model load_any(const std::string& path) {
  return hf::is_checkpoint_dir(path) ? hf::load(path) : Model::load(path);
}

/// A model directory: a Hugging Face checkpoint (config.json inside), else the llama2.c
/// checkpoint `llama2c_file` inside it.
inline Model load_model_dir(const std::string& dir, const std::string& llama2c_file) {
  return hf::is_checkpoint_dir(dir) ? hf::load(dir) : Model::load(dir + "/" + llama2c_file);
}

}  // namespace kvevict::llama2c
