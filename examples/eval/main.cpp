// kvevict-eval: policies x budgets x workload. Prints a table of attention quality
// against the full cache, optionally writes JSON, CSV and an SVG plot.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "kv_format.hpp"
#include "registry.hpp"
#include "runner.hpp"
#include "safetensors.hpp"
#include "svg_plot.hpp"
#include "workloads.hpp"

namespace {

using namespace kvevict::eval;

using ArgError = kvevict::cli::UsageError;

constexpr const char* kSummary = R"(Runs each policy at each budget over a workload, feeding it token by token through
KVCache<Policy> and kvevict::attend, and compares every decode step with the full cache:
  mass    attention-mass recall (share of the full cache's attention that was attended)
  error   attention-output relative error ||o_full - o|| / ||o_full||
  topk    top-k recall (share of the full cache's k most-attended rows that were kept)
  needle  needle retrieval rate (the late query's attention peaks on the planted key))";

constexpr const char* kEpilog = R"(--model PATH: a Hugging Face Llama/Qwen2/Qwen3 checkpoint directory (config.json and
*.safetensors, docs/real_models.md) or a llama2.c checkpoint (file, or directory holding one
.bin besides tok*.bin):
sample --steps tokens (default 512, at most the model's positions) with the full cache at
temperature 1, then feed them under each policy (the first --prompt tokens, default a
quarter, through forward_block in blocks of --prefill-block; the rest one at a time) and
report KL(full || policy), top-1 agreement and perplexity over every position (no SVG;
xkv, pyramidkv and uniform-w8 are skipped: they need prompt statistics). A tokenizer.json
next to a Hugging Face checkpoint shows the stream's first 64 tokens as text.
--streams N samples N streams (seeds --seed .. --seed + N - 1) and pools their positions.
--kv-format LIST (with --model or a synthetic/trace workload) runs each policy's KVCache in
each storage format (kvevict::attend reads the stored bytes; the reference stays the float
full cache) and adds the format, its bytes per cached token and the bytes per (layer, KV
head) to the outputs. Formats (docs/quantized.md):
{}{} run in every format; the other policies in fp32 only.
Exit status: 0 on success, 2 on bad arguments or input, 1 on other failures.
)";

struct Options {
  std::vector<std::string> policies;
  std::vector<std::string> budgets{"0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9"};
  std::vector<std::string> workloads{"mixed"};
  std::string trace, model, json, csv, svg, metric = "mass", dump_trace;
  std::optional<std::size_t> steps, prompt;
  int layers = 2;
  std::uint64_t seed = 1;
  std::size_t topk = 10;
  std::size_t prefill_chunk = 0;
  std::size_t hot_rows = 0;  ///< --hot-rows: the fp16 band of the mixed formats (f16+...)
  kvevict::policies::ChunkedPrefill chunked = kvevict::policies::ChunkedPrefill::reselect;
  std::size_t prefill_block = 64;
  std::size_t streams = 1;
  std::vector<std::string> kv_formats;  ///< --kv-format; empty: fp32, outputs without bytes
  bool quiet = false, force_progress = false;
};

using kvevict::cli::split_list;
std::vector<std::string> split(std::string_view s) { return split_list(s); }

template <class T>
T parse_int(const std::string& flag, const std::string& s, T min) {
  return kvevict::cli::parse_number<T>(flag, s, kvevict::cli::Range<T>{min});
}

// A budget: a fraction in (0, 1] when written with '.', else a token count.
struct BudgetSpec {
  std::string text;
  double fraction = 0.0;
  std::size_t tokens = 0;
  [[nodiscard]] std::size_t resolve(std::size_t context) const {
    if (tokens > 0) return tokens;
    return std::max<std::size_t>(
        1, static_cast<std::size_t>(std::llround(fraction * double(context))));
  }
};

BudgetSpec parse_budget(const std::string& s) {
  BudgetSpec b{s};
  if (s.find('.') != std::string::npos) {
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), b.fraction);
    if (ec != std::errc() || p != s.data() + s.size() || !(b.fraction > 0.0 && b.fraction <= 1.0))
      throw ArgError("--budgets: '" + s + "' is not a fraction in (0, 1] nor a token count");
  } else {
    b.tokens = parse_int<std::size_t>("--budgets", s, 1);
  }
  return b;
}

// Returns nullopt when the program should exit 0 (--help, --list).
std::optional<Options> parse(int argc, char** argv) {
  using kvevict::cli::Range;
  Options o;
  for (const auto& e : policy_registry()) o.policies.push_back(e.name);
  kvevict::cli::Parser p("kvevict-eval", kSummary);
  p.custom("--policies", "LIST",
           "comma-separated policy names, or 'all' (default: all; see --list)",
           [&](const std::string& v) {
             if (v != "all") o.policies = split(v);
             kvevict::registry::check_names(o.policies, "--policies");
           });
  p.custom("--budgets", "LIST",
           "fractions of the context in (0, 1] written with a '.', e.g. 0.1,0.5, or token "
           "counts (integers >= 1); default 0.1,0.2,...,0.9",
           [&](const std::string& v) {
             o.budgets = split(v);
             for (const auto& b : o.budgets) (void)parse_budget(b);
           });
  p.custom("--workload", "LIST", "synthetic workloads, comma-separated, or 'all' (default: mixed)",
           [&](const std::string& v) {
             o.workloads = v == "all" ? synthetic_workload_names() : split(v);
           });
  p.text("--trace", "FILE", "a safetensors trace instead (tensor names in docs/traces.md)",
         o.trace);
  p.custom("--model", "PATH", "a model instead: Hugging Face directory or llama2.c checkpoint (see below)",
           [&](const std::string& v) {
             if (!KVEVICT_EVAL_HAS_LLAMA2C) throw ArgError("--model: built without examples/llama2c");
             o.model = v;
           });
  p.text("--dump-trace", "FILE",
         "with --model: also write the sampled stream's post-RoPE q, k, v as a trace "
         "(docs/traces.md; prompt_tokens = --prompt, default 25%)", o.dump_trace);
  p.number("--steps", "N", "decode steps (synthetic default 768; a trace: all after the prompt)",
           o.steps, Range<std::size_t>{1});
  p.number("--prompt", "N", "prompt tokens prefilled first (synthetic default 256; trace: 25%)",
           o.prompt, Range<std::size_t>{0});
  p.number("--layers", "N", "layers of a synthetic workload", o.layers, Range<int>{1, 1024});
  p.number("--seed", "N", "seed of the generators and of the random policy", o.seed,
           Range<std::uint64_t>{0});
  p.number("--topk", "K", "k of top-k recall", o.topk, Range<std::size_t>{1});
  p.number("--prefill-chunk", "N",
           "> 0: prefill the prompt in chunks of N tokens (0: the whole prompt at once)",
           o.prefill_chunk, Range<std::size_t>{0});
  p.number("--hot-rows", "R",
           "mixed formats (f16+q8g8, f16+k8v4): the R most recent rows per (layer, KV head) in "
           "fp16, older rows in the cold format (R <= every budget)",
           o.hot_rows, Range<std::size_t>{0});
  p.custom("--chunked-rule", "RULE",
           "with --prefill-chunk: what SnapKV's selection (snapkv, xkv, pyramidkv, uniform-w8) "
           "does with each chunk after a layer's first: reselect (default: select again from "
           "the held rows plus the chunk) or first-chunk (the decode rule)",
           [&o](const std::string& v) {
             if (v == "reselect") o.chunked = kvevict::policies::ChunkedPrefill::reselect;
             else if (v == "first-chunk") o.chunked = kvevict::policies::ChunkedPrefill::first_chunk;
             else throw ArgError(fmt::format("--chunked-rule: '{}', expected reselect or first-chunk", v));
           });
  p.number("--prefill-block", "N",
           "with --model: the prompt (--prompt tokens) is prefilled through forward_block in "
           "blocks of N tokens (default 64; 0: token by token)",
           o.prefill_block, Range<std::size_t>{0, std::size_t{1} << 20});
  p.number("--streams", "N",
           "with --model: sample N streams (seeds --seed ..) and pool their positions (default 1)",
           o.streams, Range<std::size_t>{1, 4096});
  p.custom("--kv-format", "LIST",
           "the caches' storage formats, comma-separated, or 'all' (default fp32; see below)",
           [&](const std::string& v) {
             o.kv_formats = v == "all" ? split(kvevict::registry::kv_format_names()) : split(v);
             if (o.kv_formats.empty()) throw ArgError("--kv-format: empty list");
             for (const auto& f : o.kv_formats)
               if (!kvevict::registry::is_kv_format(f))
                 throw ArgError("--kv-format: unknown format '" + f + "', expected one of: " +
                                kvevict::registry::kv_format_names() + " or all");
           });
  p.text("--json", "FILE", "write the results as JSON", o.json);
  p.text("--csv", "FILE", "write the results as CSV", o.csv);
  p.text("--svg", "FILE",
         "write an SVG plot of a metric against budget: a panel per workload and policy family",
         o.svg);
  p.custom("--metric", "LIST",
           "metrics to plot: mass, error, topk, needle (default mass); with several, --svg "
           "FILE.svg writes FILE-<metric>.svg for each",
           [&](const std::string& v) {
             o.metric = v;
             for (const auto& m : split(o.metric))
               if (m != "mass" && m != "error" && m != "topk" && m != "needle")
                 throw ArgError("--metric: '" + m + "', expected mass, error, topk or needle");
           });
  p.flag("--quiet", "no progress bar (shown on stderr after 2 s on a terminal)", o.quiet);
  p.flag("--progress", "show the progress bar even when stderr is not a terminal",
         o.force_progress);
  p.info("--list", "list policies and workloads, then exit", [] {
    fmt::print("policies:\n{}synthetic workloads:", kvevict::registry::listing());
    for (const auto& n : synthetic_workload_names()) fmt::print(" {}", n);
    fmt::print("\n");
  });
#if KVEVICT_EVAL_HAS_LLAMA2C
  p.epilog(fmt::format(kEpilog, kvevict::registry::kv_format_listing(), all_kv_format_policies()));
#else
  p.epilog(fmt::format(kEpilog, kvevict::registry::kv_format_listing(), "no policy"));
#endif
  if (!p.parse(argc, argv)) return std::nullopt;
  if (o.trace.empty())
    for (const auto& w : o.workloads) {
      const auto& n = synthetic_workload_names();
      if (std::find(n.begin(), n.end(), w) == n.end()) {
        std::string known;
        for (const auto& x : n) known += (known.empty() ? "" : ", ") + x;
        throw ArgError("--workload: unknown workload '" + w + "', expected one of: " + known +
                       " or all");
      }
    }
  if (!o.dump_trace.empty() && o.model.empty())
    throw ArgError("--dump-trace needs --model");
  if (o.kv_formats.size() > 1 && !o.svg.empty())
    throw ArgError("--svg with several --kv-format formats: give one format (or plot the CSV, "
                   "as scripts/frontier.py does)");
  if (o.streams != 1 && o.model.empty()) throw ArgError("--streams needs --model");
#if KVEVICT_EVAL_HAS_LLAMA2C
  for (const auto& f : o.kv_formats)
    for (const auto& name : o.policies)
      if (f != "fp32" && !find_policy(name)->all_kv_formats && !find_policy(name)->needs_workload)
        throw ArgError("--kv-format " + f + ": policy '" + name +
                       "' runs in fp32 only; formats are built for: " + all_kv_format_policies());
#endif
  if (!o.model.empty() && !o.trace.empty())
    throw ArgError("--model and --trace: give one workload source");
  return o;
}

class Progress {
 public:
  Progress(std::size_t total, bool enabled) : total_(total), enabled_(enabled) {}
  void tick() {
    ++done_;
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - start_ < std::chrono::seconds(2) || now - last_ < std::chrono::milliseconds(100))
      return;
    last_ = now;
    draw(now);
  }
  void label(std::string l) { label_ = std::move(l); }
  void finish() {
    if (enabled_ && drawn_) fmt::print(stderr, "\r{:<100}\r", "");
  }

 private:
  void draw(std::chrono::steady_clock::time_point now) {
    const double f = total_ ? double(done_) / double(total_) : 1.0;
    const double el = std::chrono::duration<double>(now - start_).count();
    const int w = 30, fill = static_cast<int>(f * w);
    fmt::print(stderr, "\r[{}{}] {:5.1f}% {:6.0f}s left  {:<40.40}", std::string(fill, '#'),
                 std::string(w - fill, '.'), 100.0 * f, f > 0 ? el * (1 - f) / f : 0.0,
                 label_);
    std::fflush(stderr);
    drawn_ = true;
  }
  std::size_t total_, done_ = 0;
  bool enabled_, drawn_ = false;
  std::string label_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_{};
};

struct Row {
  std::string workload, policy;
  bool causal = true, reference = false;
  std::size_t budget = 0;  // 0: the full cache
  double fraction = 1.0;
  Quality q;
  double seconds = 0.0;
  std::string format = "fp32";  ///< --kv-format
  std::size_t row_bytes = 0;    ///< one token's key + value rows per (layer, KV head)
  std::size_t kv_bytes = 0;     ///< rows held at the end x row_bytes
};

/// A figure with `prec` decimals for tables and CSV; "-" when not finite.
std::string num(double v, int prec = 4) {
  if (!std::isfinite(v)) return "-";
  return fmt::format("{:.{}f}", v, prec);
}

/// A figure for the JSON outputs; non-finite (no needle probes, say) becomes null.
nlohmann::ordered_json json_number(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json();
}

double metric_of(const Row& r, const std::string& m) {
  if (m == "error") return r.q.output_error;
  if (m == "topk") return r.q.topk_recall;
  if (m == "needle") return r.q.needle_rate();
  return r.q.mass_recall;
}

void print_summary(const std::vector<Row>& rows, const std::vector<std::string>& workloads) {
  for (const auto& w : workloads) {
    // The budget closest to half the context.
    double best_f = -1.0;
    for (const auto& r : rows)
      if (r.workload == w && !r.reference && std::abs(r.fraction - 0.5) < std::abs(best_f - 0.5))
        best_f = r.fraction;
    if (best_f < 0) continue;
    const Row *stream = nullptr, *oracle = nullptr, *best_mass = nullptr, *best_err = nullptr;
    for (const auto& r : rows) {
      if (r.workload != w || r.reference || r.fraction != best_f) continue;
      if (r.policy == "streaming") stream = &r;
      if (r.policy == "oracle") oracle = &r;
      if (!r.causal) continue;
      if (!best_mass || r.q.mass_recall > best_mass->q.mass_recall) best_mass = &r;
      if (!best_err || r.q.output_error < best_err->q.output_error) best_err = &r;
    }
    fmt::print("\n{} at budget {:.2f} of the context:\n", w, best_f);
    if (best_mass)
      fmt::print("  best causal policy by mass recall: {} ({}); by output error: {} ({})\n",
                  best_mass->policy, num(best_mass->q.mass_recall),
                  best_err->policy, num(best_err->q.output_error));
    if (stream && oracle) {
      const double gap = oracle->q.mass_recall - stream->q.mass_recall;
      fmt::print("  StreamingLLM -> Oracle mass-recall gap: {} -> {} ({})\n",
                  num(stream->q.mass_recall), num(oracle->q.mass_recall),
                  num(gap));
      if (std::abs(gap) > 1e-9)
        for (const auto& r : rows)
          if (r.workload == w && !r.reference && r.fraction == best_f && r.causal &&
              r.policy != "streaming")
            fmt::print("    {:<{}} closes {:6.1f}% of the gap\n", r.policy, kvevict::registry::name_width(),
                        100.0 * (r.q.mass_recall - stream->q.mass_recall) / gap);
    }
  }
}

void write_outputs(const Options& o, const std::vector<Row>& rows,
                   const std::vector<Workload>& loaded, const std::string& command) {
  if (!o.csv.empty()) {
    std::ofstream f(o.csv);
    if (!f) throw kvevict::Error("kvevict-eval: cannot write --csv file '" + o.csv + "'");
    const bool with_bytes = !o.kv_formats.empty();
    f << "workload,policy," << (with_bytes ? "format,row_bytes,kv_bytes," : "")
      << "budget_tokens,budget_fraction,mass_recall,output_error,topk_recall,"
         "needle_rate,needle_probes,samples,seconds\n";
    for (const auto& r : rows)
      f << fmt::format("{},{},{}{},{},{},{},{},{},{},{},{}\n", r.workload, r.policy,
                       with_bytes ? fmt::format("{},{},{},", r.format, r.row_bytes, r.kv_bytes)
                                  : std::string(),
                       r.budget,
                       num(r.fraction, 6), num(r.q.mass_recall, 6), num(r.q.output_error, 6),
                       num(r.q.topk_recall, 6),
                       std::isfinite(r.q.needle_rate()) ? num(r.q.needle_rate(), 6) : "",
                       r.q.needle_probes, r.q.samples, num(r.seconds, 3));
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    if (!f) throw kvevict::Error("kvevict-eval: cannot write --json file '" + o.json + "'");
    nlohmann::ordered_json doc = {{"command", command}, {"topk", o.topk}};
    auto& ws = doc["workloads"] = nlohmann::ordered_json::array();
    for (const auto& w : loaded)
      ws.push_back({{"name", w.name},
                    {"description", w.description},
                    {"tokens", w.tokens},
                    {"prompt", w.prompt},
                    {"layers", w.geometry.n_layers},
                    {"heads", w.geometry.n_heads},
                    {"kv_heads", w.geometry.n_kv_heads},
                    {"head_dim", w.geometry.head_dim},
                    {"needles", w.needles.size()}});
    auto& rs = doc["results"] = nlohmann::ordered_json::array();
    for (const auto& r : rows) {
      nlohmann::ordered_json j = {{"workload", r.workload}, {"policy", r.policy}, {"causal", r.causal}};
      if (!o.kv_formats.empty()) {
        j["format"] = r.format;
        j["row_bytes"] = r.row_bytes;
        j["kv_bytes"] = r.kv_bytes;
      }
      nlohmann::ordered_json rest = {
                    {"budget_tokens", r.budget},
                    {"budget_fraction", json_number(r.fraction)},
                    {"mass_recall", json_number(r.q.mass_recall)},
                    {"output_error", json_number(r.q.output_error)},
                    {"topk_recall", json_number(r.q.topk_recall)},
                    {"needle_rate", json_number(r.q.needle_rate())},
                    {"needle_probes", r.q.needle_probes},
                    {"samples", r.q.samples},
                    {"seconds", json_number(r.seconds)}};
      for (auto it = rest.begin(); it != rest.end(); ++it) j[it.key()] = it.value();
      rs.push_back(std::move(j));
    }
    f << doc.dump(2) << '\n';
  }
  const auto metrics = split(o.metric);
  for (const auto& metric : metrics) {
    if (o.svg.empty()) break;
    // Several metrics: one file each, FILE with "-<metric>" before its extension.
    std::string file = o.svg;
    if (metrics.size() > 1) {
      const auto dot = file.rfind('.');
      file = dot == std::string::npos || dot < file.find_last_of('/') + 1
                 ? file + "-" + metric
                 : file.substr(0, dot) + "-" + metric + file.substr(dot);
    }
    std::vector<Panel> panels;
    for (const auto& w : loaded) {
      Panel p{w.name, {}};
      for (const auto& name : o.policies) {
        const PolicyEntry& e = *find_policy(name);
        Series s{name, {}, kvevict::registry::family_name(e.family)};
        const Row* full = nullptr;
        for (const auto& r : rows) {
          if (r.workload != w.name || r.policy != name) continue;
          if (r.reference)
            full = &r;
          else
            s.points.push_back({r.fraction, metric_of(r, metric)});
        }
        if (full)  // the reference is one run: a flat line across the plotted budgets
          for (const auto& r : rows)
            if (r.workload == w.name && !r.reference && r.policy != name &&
                std::none_of(s.points.begin(), s.points.end(),
                             [&](const auto& pt) { return pt.first == r.fraction; }))
              s.points.push_back({r.fraction, metric_of(*full, metric)});
        if (full && s.points.empty())
          s.points = {{0.0, metric_of(*full, metric)}, {1.0, metric_of(*full, metric)}};
        if (!s.points.empty()) p.series.push_back(std::move(s));
      }
      panels.push_back(std::move(p));
    }
    PlotSpec spec;
    static const std::map<std::string, std::string> labels{
        {"mass", "attention-mass recall"},
        {"error", "attention-output relative error"},
        {"topk", "top-" + std::to_string(o.topk) + " recall"},
        {"needle", "needle retrieval rate"}};
    spec.y_label = labels.at(metric);
    spec.title = "kvevict-eval: " + spec.y_label + " against budget";
    using kvevict::registry::Family;
    for (Family f : {Family::baseline, Family::seed, Family::kvevict, Family::ceiling})
      spec.groups.push_back(kvevict::registry::family_name(f));
    spec.context = {"streaming", "oracle"};
    if (metric == "mass" || metric == "topk") spec.auto_y_min = true;
    if (metric == "error") {
      double mx = 0.0;
      for (const auto& r : rows)
        mx = std::max(mx, std::isfinite(r.q.output_error) ? r.q.output_error : 0.0);
      spec.y_max = mx > 0.0 ? std::ceil(mx * 10.0) / 10.0 : 1.0;
    }
    std::ofstream f(file);
    if (!f) throw kvevict::Error("kvevict-eval: cannot write --svg file '" + file + "'");
    f << render_svg(panels, spec);
  }
}

#if KVEVICT_EVAL_HAS_LLAMA2C
/// `text` in double quotes on one line: quotes, backslashes and control bytes escaped.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

// --model: the streaming KL protocol of examples/llama2c/e2e.hpp on one sampled stream.
int run_model(const Options& o, const std::vector<BudgetSpec>& budgets) {
  namespace fs = std::filesystem;
  std::string path = o.model;
  const bool hf_dir = kvevict::llama2c::hf::is_checkpoint_dir(path);
  if (!hf_dir && fs::is_directory(path)) {
    std::vector<std::string> found;
    for (const auto& f : fs::directory_iterator(path))
      if (f.path().extension() == ".bin" && f.path().filename().string().rfind("tok", 0) != 0)
        found.push_back(f.path().string());
    if (found.size() != 1)
      throw ArgError("--model: directory '" + path + "' holds " + std::to_string(found.size()) +
                     " checkpoint .bin files (besides tok*.bin), expected exactly one");
    path = found[0];
  }
  auto model = std::make_shared<const kvevict::llama2c::Model>(kvevict::llama2c::load_any(path));
  kvevict::llama2c::SampleOptions so;
  so.tokens = static_cast<int>(std::min<std::size_t>(
      o.steps.value_or(512), static_cast<std::size_t>(model->config().seq_len)));
  // Long streams of large-vocabulary models keep hidden states, not logits (Stream).
  so.keep_logits = kvevict::llama2c::logits_fit(model->config(),
                                                static_cast<std::size_t>(so.tokens), o.streams);
  std::vector<kvevict::llama2c::Stream> streams;
  for (std::size_t i = 0; i < o.streams; ++i) {
    so.seed = o.seed + i;
    streams.push_back(kvevict::llama2c::sample_stream(model, so));
  }
  if (!o.dump_trace.empty()) {
    const std::size_t n = streams[0].tokens.size();
    kvevict::llama2c::dump_trace(model, streams[0].tokens, std::min(o.prompt.value_or(n / 4), n - 1),
                                 o.dump_trace);
    fmt::print(stderr, "kvevict-eval: wrote trace {} ({} tokens)\n", o.dump_trace, n);
  }
  const auto T = static_cast<std::size_t>(so.tokens);
  // The prompt: the stream's first --prompt tokens (default a quarter, as a trace's),
  // prefilled under each policy in blocks of --prefill-block.
  const std::size_t prompt = std::min(o.prompt.value_or(T / 4), T);
  kvevict::llama2c::ProtocolOptions protocol;
  protocol.prefill = o.prefill_block > 0 ? prompt : 0;
  protocol.prefill_block = std::max<std::size_t>(o.prefill_block, 1);
  protocol.hot_rows = o.hot_rows;
  // --kv-format: the formats and their bytes per cached token and (layer, KV head).
  const bool with_bytes = !o.kv_formats.empty();
  const std::vector<std::string> formats =
      with_bytes ? o.kv_formats : std::vector<std::string>{"fp32"};
  const int head_dim = model->config().head_dim();
  struct ModelRow {
    std::string policy;
    std::size_t budget;
    double fraction;
    kvevict::llama2c::Summary s;
    std::string format = "fp32";
    std::size_t row_bytes = 0;  ///< one token's key + value rows in `format`
    std::size_t kv_bytes = 0;   ///< rows held at the end x row_bytes, per (layer, KV head)
  };
  std::vector<ModelRow> rows;
  for (const auto& pname : o.policies) {
    const PolicyEntry& e = *find_policy(pname);
    if (e.needs_workload || !e.run_model) {
      fmt::print(stderr, "kvevict-eval: {} skipped with --model (needs prompt statistics)\n",
                   e.name);
      continue;
    }
    for (const auto& format : formats) {
      const std::size_t row_bytes = kvevict::registry::kv_row_bytes(format, head_dim);
      const std::size_t n = e.sizing == Sizing::reference ? 1 : budgets.size();
      for (std::size_t bi = 0; bi < n; ++bi) {
        const std::size_t b = e.sizing == Sizing::reference ? 0 : budgets[bi].resolve(T);
        PolicyArgs args{b, o.seed, nullptr, protocol};
        args.kv_format = format;
        try {
          // The Oracle stores every row (it limits attention instead): all T are held.
          const std::size_t held = b == 0 || e.sizing != Sizing::budget ? T : std::min(b, T);
          rows.push_back({e.name, b, b ? double(b) / double(T) : 1.0,
                          e.run_model(model, streams, args), format, row_bytes,
                          kvevict::registry::kv_head_bytes(format, head_dim, held, o.hot_rows)});
        } catch (const kvevict::Error& err) {
          throw kvevict::Error(std::string(err.what()) + " (policy " + e.name + ", budget " +
                               std::to_string(b) + " tokens, format " + format + ")");
        }
      }
    }
  }
  fmt::print("model {}, {} of {} tokens sampled at temperature 1, seed {}; the first "
             "{} prefilled {}\n",
             path, o.streams == 1 ? std::string("one stream") : fmt::format("{} streams", o.streams),
             T,
             o.streams == 1 ? fmt::format("{}", o.seed)
                            : fmt::format("{}..{}", o.seed, o.seed + o.streams - 1),
             prompt,
             protocol.prefill > 0 ? fmt::format("in blocks of {}", protocol.prefill_block)
                                  : std::string("token by token"));
  if (hf_dir) {  // the stream's beginning as text, when the checkpoint has a tokenizer.json
    if (const auto tok = kvevict::llama2c::hf::TokenizerJson::load_if_present(path)) {
      if (!tok->unsupported().empty())
        fmt::print(stderr, "kvevict-eval: warning: tokenizer.json {} is not supported: no text shown\n",
                   tok->unsupported());
      else
        fmt::print("stream text (first {} tokens): {}\n", std::min<std::size_t>(T, 64),
                   quoted(tok->decode(std::span<const int>(streams[0].tokens)
                                          .first(std::min<std::size_t>(T, 64)))));
    }
  }
  if (with_bytes)
    fmt::print("bytes: one token's key + value rows per (layer, KV head) in the format (row_B), "
               "and the rows held x row_B (kv_bytes; positions not counted)\n");
  const std::string bytes_head =
      with_bytes ? fmt::format(" {:>6} {:>6} {:>8}", "format", "row_B", "kv_bytes") : "";
  fmt::print("{:<{}}{} {:>8} {:>6} {:>10} {:>8} {:>10} {:>10}\n", "policy",
             kvevict::registry::name_width(), bytes_head, "budget", "frac", "mean_kl", "top1",
             "ppl", "ppl_full");
  for (const auto& r : rows)
    fmt::print("{:<{}}{} {:>8} {:>6} {:>10} {:>8} {:>10} {:>10}\n", r.policy,
               kvevict::registry::name_width(),
               with_bytes ? fmt::format(" {:>6} {:>6} {:>8}", r.format, r.row_bytes, r.kv_bytes)
                          : std::string(),
               r.budget ? std::to_string(r.budget) : "all", num(r.fraction, 2),
               num(r.s.mean_kl, 5), num(r.s.top1, 4), num(r.s.perplexity, 3),
               num(r.s.perplexity_full, 3));
  if (!o.csv.empty()) {
    std::ofstream c(o.csv);
    if (!c) throw kvevict::Error("kvevict-eval: cannot write --csv file '" + o.csv + "'");
    c << "policy," << (with_bytes ? "format,row_bytes,kv_bytes," : "")
      << "budget_tokens,budget_fraction,mean_kl,top1,perplexity,perplexity_full\n";
    for (const auto& r : rows)
      c << fmt::format("{},{}{},{},{},{},{},{}\n", r.policy,
                       with_bytes ? fmt::format("{},{},{},", r.format, r.row_bytes, r.kv_bytes)
                                  : std::string(),
                       r.budget, num(r.fraction, 6), num(r.s.mean_kl, 6), num(r.s.top1, 6),
                       num(r.s.perplexity, 6), num(r.s.perplexity_full, 6));
  }
  if (!o.json.empty()) {
    std::ofstream j(o.json);
    if (!j) throw kvevict::Error("kvevict-eval: cannot write --json file '" + o.json + "'");
    nlohmann::ordered_json doc = {{"model", path}, {"tokens", T}};
    if (o.streams != 1) doc["streams"] = o.streams;
    auto& rs = doc["results"] = nlohmann::ordered_json::array();
    for (const auto& r : rows) {
      nlohmann::ordered_json j = {{"policy", r.policy}};
      if (with_bytes) {
        j["format"] = r.format;
        j["row_bytes"] = r.row_bytes;
        j["kv_bytes"] = r.kv_bytes;
      }
      j["budget_tokens"] = r.budget;
      j["budget_fraction"] = json_number(r.fraction);
      j["mean_kl"] = json_number(r.s.mean_kl);
      j["top1"] = json_number(r.s.top1);
      j["perplexity"] = json_number(r.s.perplexity);
      j["perplexity_full"] = json_number(r.s.perplexity_full);
      rs.push_back(std::move(j));
    }
    j << doc.dump(2) << '\n';
  }
  return 0;
}
#endif

int run(int argc, char** argv) {
  const auto parsed = parse(argc, argv);
  if (!parsed) return 0;
  const Options& o = *parsed;
  std::vector<BudgetSpec> budgets;
  for (const auto& b : o.budgets) budgets.push_back(parse_budget(b));
  if (budgets.empty()) throw ArgError("--budgets: empty list");
#if KVEVICT_EVAL_HAS_LLAMA2C
  if (!o.model.empty()) {
    return run_model(o, budgets);
  }
#endif

  std::vector<Workload> loaded;
  if (!o.trace.empty()) {
    TraceOptions t;
    t.prompt = o.prompt;
    t.steps = o.steps;
    loaded.push_back(load_trace(o.trace, t));
  } else {
    for (const auto& name : o.workloads) {
      SyntheticConfig c;
      c.layers = o.layers;
      c.seed = o.seed;
      if (o.steps) c.steps = *o.steps;
      if (o.prompt) c.prompt = *o.prompt;
      loaded.push_back(make_synthetic(name, c));
    }
  }
  std::vector<std::string> workload_names;
  const std::vector<std::string> formats =
      o.kv_formats.empty() ? std::vector<std::string>{"fp32"} : o.kv_formats;
  std::size_t total = 0;
  for (const auto& w : loaded) {
    workload_names.push_back(w.name);
    std::size_t runs = 0;
    for (const auto& p : o.policies)
      runs += find_policy(p)->sizing == Sizing::reference ? 1 : budgets.size();
    total += (1 + runs * formats.size()) * (w.tokens - w.prompt);  // 1: the reference
  }
  Progress progress(total, !o.quiet && (o.force_progress || isatty(2)));
  const Tick tick = [&] { progress.tick(); };
  RunOptions ro;
  ro.topk = o.topk;
  ro.prefill_chunk = o.prefill_chunk;
  ro.chunked = o.chunked;
  ro.hot_rows = o.hot_rows;

  std::vector<Row> rows;
  for (const auto& w : loaded) {
    progress.label(w.name + ": full-cache reference");
    const Reference ref = Reference::compute(w, tick);
    for (const auto& pname : o.policies) {
      const PolicyEntry& e = *find_policy(pname);
      const std::size_t n = e.sizing == Sizing::reference ? 1 : budgets.size();
      for (const auto& format : formats) {
        const std::size_t row_bytes = kvevict::registry::kv_row_bytes(format, w.geometry.head_dim);
        for (std::size_t bi = 0; bi < n; ++bi) {
          Row r;
          r.workload = w.name;
          r.policy = e.name;
          r.causal = e.causal();
          r.reference = e.sizing == Sizing::reference;
          r.format = format;
          r.row_bytes = row_bytes;
          if (!r.reference) {
            r.budget = budgets[bi].resolve(w.tokens);
            r.fraction = double(r.budget) / double(w.tokens);
          }
          // Rows held at the end: the budget, or every token (full cache, Oracle).
          r.kv_bytes = kvevict::registry::kv_head_bytes(
              format, w.geometry.head_dim,
              e.sizing == Sizing::budget ? std::min(r.budget, w.tokens) : w.tokens, o.hot_rows);
          progress.label(w.name + ": " + e.name + " " + (r.reference ? "" : budgets[bi].text) +
                         (formats.size() > 1 ? " " + format : ""));
          const auto t0 = std::chrono::steady_clock::now();
          PolicyArgs args{r.budget, o.seed, &w};
          args.kv_format = format;
          try {
            r.q = e.run(w, ref, args, ro, tick);
          } catch (const kvevict::Error& err) {
            throw kvevict::Error(std::string(err.what()) + " (policy " + e.name + ", budget " +
                                 std::to_string(r.budget) + " tokens, workload " + w.name +
                                 ", format " + format + ")");
          }
          r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          rows.push_back(r);
        }
      }
    }
  }
  progress.finish();

  const bool with_bytes = !o.kv_formats.empty();
  fmt::print("{:<10} {:<{}}{} {:>8} {:>7} {:>10} {:>10} {:>9} {:>8}\n", "workload", "policy",
             kvevict::registry::name_width(),
             with_bytes ? fmt::format(" {:>6} {:>6} {:>8}", "format", "row_B", "kv_bytes") : "",
             "budget", "frac", "mass_rec", "out_err", "topk", "needle");
  for (const auto& r : rows)
    fmt::print("{:<10} {:<{}}{} {:>8} {:>7} {:>10} {:>10} {:>9} {:>8}\n", r.workload, r.policy,
               kvevict::registry::name_width(),
               with_bytes ? fmt::format(" {:>6} {:>6} {:>8}", r.format, r.row_bytes, r.kv_bytes)
                          : std::string(),
                r.reference ? "all" : std::to_string(r.budget),
                r.reference ? "1.00" : num(r.fraction, 2), num(r.q.mass_recall),
                num(r.q.output_error), num(r.q.topk_recall),
                num(r.q.needle_rate(), 3));
  fmt::print("(means over decode steps x layers x query heads; top = top-{} recall)\n", o.topk);
  print_summary(rows, workload_names);

  std::string command = "kvevict-eval";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  write_outputs(o, rows, loaded, command);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return kvevict::cli::main_guard("kvevict-eval", [&] { return run(argc, argv); });
}
