#include "engine_config.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace switchyard::rt {
namespace {

using Json = nlohmann::json;

// One JSON object and the path that names it in errors ("build_config.plugin_config").
struct Node {
  const Json& json;
  std::string path;

  std::string name(const std::string& key) const { return path.empty() ? key : path + "." + key; }
  bool has(const std::string& key) const {
    return json.contains(key) && !json.at(key).is_null();
  }

  Node object(const std::string& key) const {
    if (!json.contains(key)) throw EngineConfigError(name(key), "missing");
    const Json& v = json.at(key);
    if (!v.is_object()) throw EngineConfigError(name(key), "expected an object");
    return Node{v, name(key)};
  }

  std::int32_t integer(const std::string& key, std::optional<std::int32_t> dflt = std::nullopt,
                       std::int32_t min = 1) const {
    if (!has(key)) {
      if (dflt) return *dflt;
      throw EngineConfigError(name(key), "missing");
    }
    const Json& v = json.at(key);
    if (!v.is_number_integer()) {
      throw EngineConfigError(name(key), "expected an integer, got " + v.dump());
    }
    const auto n = v.get<std::int64_t>();
    if (n < min || n > INT32_MAX) {
      throw EngineConfigError(name(key), "must be at least " + std::to_string(min) + ", got " +
                                             std::to_string(n));
    }
    return static_cast<std::int32_t>(n);
  }

  std::string string(const std::string& key, std::optional<std::string> dflt = std::nullopt) const {
    if (!has(key)) {
      if (dflt) return *dflt;
      throw EngineConfigError(name(key), "missing");
    }
    const Json& v = json.at(key);
    if (!v.is_string()) throw EngineConfigError(name(key), "expected a string, got " + v.dump());
    return v.get<std::string>();
  }

  bool boolean(const std::string& key, bool dflt) const {
    if (!has(key)) return dflt;
    const Json& v = json.at(key);
    if (!v.is_boolean()) throw EngineConfigError(name(key), "expected true or false, got " + v.dump());
    return v.get<bool>();
  }
};

void check_dtype(const std::string& field, const std::string& dtype) {
  static const char* kKnown[] = {"float16", "bfloat16", "float32"};
  if (std::find(std::begin(kKnown), std::end(kKnown), dtype) == std::end(kKnown)) {
    throw EngineConfigError(field, "'" + dtype + "' is not a dtype the runtime loads "
                                                 "(float16, bfloat16, float32)");
  }
}

// QuantMode bits of the older layout (tensorrt_llm.quantization.QuantMode, an IntFlag).
constexpr std::int64_t kInt4Weights = 1 << 0, kInt8Weights = 1 << 1, kActivations = 1 << 2,
                       kPerChannel = 1 << 3, kPerToken = 1 << 4, kPerGroup = 1 << 5,
                       kInt8KvCache = 1 << 6, kFp8KvCache = 1 << 7, kFp8Qdq = 1 << 8;

// The older layout's quant_mode as today's QuantAlgo names (weights, KV cache).
std::pair<std::string, std::string> from_quant_mode(std::int64_t mode) {
  std::string weights;
  if (mode & kFp8Qdq) {
    weights = "FP8";
  } else if ((mode & kInt8Weights) && (mode & kActivations)) {
    weights = std::string("W8A8_SQ_") + ((mode & kPerChannel) ? "PER_CHANNEL" : "PER_TENSOR") +
              ((mode & kPerToken) ? "_PER_TOKEN" : "");
  } else if ((mode & kInt4Weights) && (mode & kActivations)) {
    weights = "W4A8_AWQ";
  } else if (mode & kInt4Weights) {
    // Per-group int4 is AWQ or GPTQ; quant_mode does not say which.
    weights = (mode & kPerGroup) ? "W4A16_GROUPWISE" : "W4A16";
  } else if (mode & kInt8Weights) {
    weights = "W8A16";
  }
  std::string kv = (mode & kFp8KvCache) ? "FP8" : (mode & kInt8KvCache) ? "INT8" : "";
  return {weights, kv};
}

std::string quant_string(const Node& q, const std::string& key) {
  if (!q.has(key)) return "";
  std::string s = q.string(key);
  return s == "NO_QUANT" ? "" : s;
}

// plugin_config, in either layout; the paged KV cache became the default with trtllm-build.
void read_plugin_config(const Node& plugin, bool paged_by_default, EngineConfig* c) {
  c->paged_kv_cache = plugin.boolean("paged_kv_cache", paged_by_default);
  c->use_paged_context_fmha = plugin.boolean("use_paged_context_fmha", false);
  c->tokens_per_block = plugin.integer("tokens_per_block", c->paged_kv_cache ? std::nullopt
                                                                           : std::optional(0),
                                       c->paged_kv_cache ? 1 : 0);
}

void parse_new_layout(const Json& root, EngineConfig* c) {
  const Node top{root, ""};
  c->layout = "build_config";
  c->version = top.string("version");
  const Node pretrained = top.object("pretrained_config");
  c->architecture = pretrained.string("architecture");
  c->dtype = pretrained.string("dtype");
  check_dtype(pretrained.name("dtype"), c->dtype);
  c->vocab_size = pretrained.integer("vocab_size");
  const Node mapping = pretrained.object("mapping");
  c->tp_size = mapping.integer("tp_size", 1);
  c->pp_size = mapping.integer("pp_size", 1);
  const std::int32_t cp = mapping.integer("cp_size", 1);
  c->world_size = mapping.integer("world_size", c->tp_size * c->pp_size * cp);
  if (c->world_size != c->tp_size * c->pp_size * cp) {
    throw EngineConfigError(mapping.name("world_size"),
                            std::to_string(c->world_size) + " is not tp_size (" +
                                std::to_string(c->tp_size) + ") x pp_size (" +
                                std::to_string(c->pp_size) + ") x cp_size (" + std::to_string(cp) +
                                ")");
  }
  if (pretrained.has("quantization")) {
    const Node q = pretrained.object("quantization");
    c->quant_algo = quant_string(q, "quant_algo");
    c->kv_cache_quant_algo = quant_string(q, "kv_cache_quant_algo");
  }
  const Node build = top.object("build_config");
  c->max_input_len = build.integer("max_input_len");
  c->max_seq_len = build.integer("max_seq_len");
  c->max_batch_size = build.integer("max_batch_size");
  c->max_beam_width = build.integer("max_beam_width", 1);
  c->max_num_tokens = build.integer("max_num_tokens", 0, 0);
  const Node plugin = build.object("plugin_config");
  read_plugin_config(plugin, /*paged_by_default=*/true, c);
}

void parse_old_layout(const Json& root, EngineConfig* c) {
  const Node top{root, ""};
  c->layout = "builder_config";
  const Node builder = top.object("builder_config");
  c->architecture = builder.string("name");
  c->dtype = builder.string("precision");
  check_dtype(builder.name("precision"), c->dtype);
  c->vocab_size = builder.integer("vocab_size");
  c->tp_size = builder.integer("tensor_parallel", 1);
  c->pp_size = builder.integer("pipeline_parallel", 1);
  c->world_size = c->tp_size * c->pp_size;
  if (builder.has("quant_mode")) {
    const Json& v = builder.json.at("quant_mode");
    if (!v.is_number_integer()) {
      throw EngineConfigError(builder.name("quant_mode"), "expected an integer, got " + v.dump());
    }
    std::tie(c->quant_algo, c->kv_cache_quant_algo) = from_quant_mode(v.get<std::int64_t>());
  }
  c->max_input_len = builder.integer("max_input_len");
  if (builder.has("max_seq_len")) {
    c->max_seq_len = builder.integer("max_seq_len");
  } else {
    const std::int64_t out = builder.integer("max_output_len");
    if (out + c->max_input_len > INT32_MAX) {
      throw EngineConfigError(builder.name("max_output_len"), "too large");
    }
    c->max_seq_len = static_cast<std::int32_t>(out + c->max_input_len);
  }
  c->max_batch_size = builder.integer("max_batch_size");
  c->max_beam_width = builder.integer("max_beam_width", 1);
  c->max_num_tokens = builder.integer("max_num_tokens", 0, 0);
  const Node plugin = top.object("plugin_config");
  read_plugin_config(plugin, /*paged_by_default=*/false, c);
}

std::string read_file(const std::filesystem::path& path, const std::string& field) {
  std::ifstream in(path);
  if (!in) throw EngineConfigError(field, "cannot read " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// "1.0.0rc3" -> {1, 0}; nullopt when it does not start with major.minor.
std::optional<std::pair<int, int>> major_minor(const std::string& v) {
  int major = 0, minor = 0;
  char dot = 0;
  std::istringstream in(v);
  if (!(in >> major >> dot >> minor) || dot != '.') return std::nullopt;
  return std::make_pair(major, minor);
}

void check_version(const EngineConfig& c, const EngineChecks& checks, ResolvedEngine* r) {
  if (!checks.runtime_version) {
    r->notes.push_back("version check skipped: the runtime's TensorRT-LLM version is unknown "
                       "(built without TensorRT-LLM; pass --trtllm-version to check)");
    return;
  }
  const auto runtime = major_minor(*checks.runtime_version);
  if (!runtime) {
    throw EngineConfigError("--trtllm-version", "'" + *checks.runtime_version +
                                                    "' is not a major.minor version");
  }
  if (c.layout == "builder_config") {
    throw EngineConfigError(
        "version", "missing: the engine has the older builder_config layout (TensorRT-LLM 0.x "
                   "build scripts), which TensorRT-LLM " + *checks.runtime_version +
                       " cannot load; rebuild it with this release's trtllm-build");
  }
  const auto engine = major_minor(c.version);
  if (!engine) throw EngineConfigError("version", "'" + c.version + "' is not a version");
  if (*engine != *runtime) {
    throw EngineConfigError("version", "the engine was built by TensorRT-LLM " + c.version +
                                           ", this runtime is " + *checks.runtime_version +
                                           "; engines run only on the release (major.minor) "
                                           "that built them");
  }
}

}  // namespace

std::string EngineConfig::kv_cache_dtype() const {
  if (kv_cache_quant_algo.empty()) return dtype;
  std::string s = kv_cache_quant_algo;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

EngineConfig parse_engine_config(const std::string& json_text) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::parse_error& e) {
    throw EngineConfigError("config.json", std::string("not valid JSON: ") + e.what());
  }
  if (!root.is_object()) throw EngineConfigError("config.json", "expected a JSON object");
  EngineConfig c;
  try {
    if (root.contains("version") && !root.at("version").is_null()) {
      parse_new_layout(root, &c);
    } else if (root.contains("builder_config")) {
      parse_old_layout(root, &c);
    } else {
      throw EngineConfigError("version", "missing, and no builder_config either: not a "
                                         "TensorRT-LLM engine's config.json");
    }
  } catch (const Json::exception& e) {  // a type the accessors did not expect
    throw EngineConfigError("config.json", e.what());
  }
  if (c.max_input_len > c.max_seq_len) {
    throw EngineConfigError(c.layout + ".max_input_len",
                            std::to_string(c.max_input_len) + " exceeds max_seq_len " +
                                std::to_string(c.max_seq_len));
  }
  if (!c.paged_kv_cache) {
    throw EngineConfigError((c.layout == "build_config" ? "build_config." : "") +
                                std::string("plugin_config.paged_kv_cache"),
                            "false: the executor's in-flight batching needs a paged KV cache; "
                            "rebuild with --paged_kv_cache enable");
  }
  return c;
}

std::vector<TokenId> read_generation_config_eos(const std::filesystem::path& dir) {
  const auto path = dir / "generation_config.json";
  if (!std::filesystem::exists(path)) return {};
  Json root;
  try {
    root = Json::parse(read_file(path, "generation_config.json"));
  } catch (const Json::parse_error& e) {
    throw EngineConfigError(path.string(), std::string("not valid JSON: ") + e.what());
  }
  std::vector<TokenId> ids;
  if (!root.is_object() || !root.contains("eos_token_id") || root.at("eos_token_id").is_null()) {
    return ids;
  }
  const Json& v = root.at("eos_token_id");
  const std::string field = path.string() + ": eos_token_id";
  auto one = [&](const Json& x) {
    if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() > INT32_MAX) {
      throw EngineConfigError(field, "expected token ids, got " + v.dump());
    }
    ids.push_back(static_cast<TokenId>(x.get<std::int64_t>()));
  };
  if (v.is_array()) {
    for (const auto& x : v) one(x);
  } else {
    one(v);
  }
  return ids;
}

EngineConfig read_engine_config(const std::filesystem::path& engine_dir) {
  if (!std::filesystem::is_directory(engine_dir)) {
    throw EngineConfigError("--model", engine_dir.string() + " is not a directory");
  }
  const auto config_path = engine_dir / "config.json";
  if (!std::filesystem::exists(config_path)) {
    throw EngineConfigError("config.json", "missing in " + engine_dir.string() +
                                               " (not a TensorRT-LLM engine directory)");
  }
  EngineConfig c = parse_engine_config(read_file(config_path, "config.json"));
  for (std::int32_t rank = 0; rank < c.world_size; ++rank) {
    std::string file;
    if (c.layout == "build_config") {
      file = "rank" + std::to_string(rank) + ".engine";
    } else {  // the older build scripts: {name}_{precision}_tp{N}[_pp{M}]_rank{i}.engine
      file = c.architecture + "_" + c.dtype + "_tp" + std::to_string(c.tp_size) +
             (c.pp_size > 1 ? "_pp" + std::to_string(c.pp_size) : "") + "_rank" +
             std::to_string(rank) + ".engine";
    }
    if (!std::filesystem::exists(engine_dir / file)) {
      throw EngineConfigError(file, "missing in " + engine_dir.string() + ": world_size is " +
                                        std::to_string(c.world_size) +
                                        ", so every rank needs its engine file");
    }
  }
  c.eos_token_ids = read_generation_config_eos(engine_dir);
  return c;
}

GuideVocabulary read_guide_vocabulary(const std::filesystem::path& tokenizer_dir) {
  const auto path = tokenizer_dir / "tokenizer.json";
  const std::string where = path.string();
  if (!std::filesystem::exists(path)) {
    throw EngineConfigError("--tokenizer", "no tokenizer.json in " + tokenizer_dir.string() +
                                               " (structured output needs the fast tokenizer)");
  }
  GuideVocabulary out;
  out.tokenizer_json = read_file(path, "tokenizer.json");
  Json root;
  try {
    root = Json::parse(out.tokenizer_json);
  } catch (const Json::parse_error& e) {
    throw EngineConfigError(where, std::string("not valid JSON: ") + e.what());
  }
  std::vector<std::pair<std::int64_t, std::string>> tokens;
  auto add = [&](const Json& id, const std::string& token, const std::string& key) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
        id.get<std::int64_t>() > INT32_MAX) {
      throw EngineConfigError(where + ": " + key, "expected a token id, got " + id.dump());
    }
    tokens.emplace_back(id.get<std::int64_t>(), token);
  };
  if (!root.is_object() || !root.contains("model") || !root.at("model").contains("vocab") ||
      !root.at("model").at("vocab").is_object()) {
    throw EngineConfigError(where + ": model.vocab", "missing (expected token -> id)");
  }
  for (const auto& [token, id] : root.at("model").at("vocab").items()) {
    add(id, token, "model.vocab." + token);
  }
  if (root.contains("added_tokens") && root.at("added_tokens").is_array()) {
    for (const auto& t : root.at("added_tokens")) {
      if (!t.is_object() || !t.contains("content") || !t.at("content").is_string() ||
          !t.contains("id")) {
        throw EngineConfigError(where + ": added_tokens", "expected {content, id}, got " + t.dump());
      }
      add(t.at("id"), t.at("content").get<std::string>(), "added_tokens");
    }
  }
  std::int64_t size = 0;
  for (const auto& [id, _] : tokens) size = std::max(size, id + 1);
  out.encoded_vocab.assign(static_cast<std::size_t>(size), "");
  for (auto& [id, token] : tokens) out.encoded_vocab[static_cast<std::size_t>(id)] = std::move(token);
  return out;
}

std::optional<std::int32_t> gpus_from_cuda_visible_devices(const char* value) {
  if (value == nullptr) return std::nullopt;
  std::string s(value);
  // CUDA stops at the first invalid entry; "-1" (or "" or "NoDevFiles") hides everything.
  std::int32_t n = 0;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty() || item[0] == '-' || item == "NoDevFiles") break;
    ++n;
  }
  return n;
}

ResolvedEngine resolve_engine(const EngineConfig& c, const EngineChecks& checks) {
  ResolvedEngine r;
  r.config = c;
  const std::string build = c.layout == "build_config" ? "build_config." : "builder_config.";
  const std::string plugin = c.layout == "build_config" ? "build_config.plugin_config."
                                                         : "plugin_config.";
  const std::string world_field = c.layout == "build_config"
                                      ? "pretrained_config.mapping.world_size"
                                      : "builder_config.tensor_parallel";
  check_version(c, checks, &r);

  if (!checks.gpus_visible) {
    r.notes.push_back("world-size check skipped: the number of visible GPUs is unknown "
                      "(no CUDA runtime in this build and CUDA_VISIBLE_DEVICES unset)");
  } else if (c.world_size > *checks.gpus_visible) {
    throw EngineConfigError(world_field,
                            "the engine needs " + std::to_string(c.world_size) + " GPUs (tp " +
                                std::to_string(c.tp_size) + " x pp " + std::to_string(c.pp_size) +
                                "); " + std::to_string(*checks.gpus_visible) + " are visible");
  }

  r.max_context = c.max_seq_len;
  if (checks.max_context) {
    if (*checks.max_context > c.max_seq_len) {
      throw EngineConfigError("--max-context", std::to_string(*checks.max_context) +
                                                   " exceeds the engine's " + build +
                                                   "max_seq_len " + std::to_string(c.max_seq_len));
    }
    if (*checks.max_context < 2) throw EngineConfigError("--max-context", "must be at least 2");
    if (*checks.max_context < c.max_seq_len) {
      r.notes.push_back("max_context lowered by --max-context to " +
                        std::to_string(*checks.max_context) + " (engine: " +
                        std::to_string(c.max_seq_len) + ")");
    }
    r.max_context = *checks.max_context;
  }
  r.max_input_len = std::min(c.max_input_len, r.max_context - 1);

  r.max_batch_size = c.max_batch_size;
  if (checks.max_batch_size) {
    if (*checks.max_batch_size > c.max_batch_size || *checks.max_batch_size < 1) {
      throw EngineConfigError("--max-batch-size",
                              std::to_string(*checks.max_batch_size) + " is outside 1.." +
                                  std::to_string(c.max_batch_size) + ", the engine's " + build +
                                  "max_batch_size");
    }
    r.max_batch_size = *checks.max_batch_size;
  }

  if (checks.tokens_per_block && *checks.tokens_per_block != c.tokens_per_block) {
    throw EngineConfigError("--tokens-per-block",
                            std::to_string(*checks.tokens_per_block) + " differs from the engine's " +
                                plugin + "tokens_per_block " + std::to_string(c.tokens_per_block) +
                                " (fixed when the engine was built)");
  }

  r.enable_chunked_context = c.chunked_context_allowed();
  if (checks.enable_chunked_context) {
    if (*checks.enable_chunked_context && !c.chunked_context_allowed()) {
      throw EngineConfigError("--enable-chunked-context",
                              "the engine was built without " + plugin +
                                  "use_paged_context_fmha, which chunked context needs");
    }
    r.enable_chunked_context = *checks.enable_chunked_context;
  }

  r.vocab_size = c.vocab_size;
  if (checks.tokenizer_vocab_size && *checks.tokenizer_vocab_size > c.vocab_size) {
    throw EngineConfigError("--vocab-size",
                            "the tokenizer has " + std::to_string(*checks.tokenizer_vocab_size) +
                                " tokens; the engine's " +
                                (c.layout == "build_config" ? "pretrained_config"
                                                            : "builder_config") +
                                ".vocab_size is " + std::to_string(c.vocab_size) +
                                " (engine and tokenizer are from different models?)");
  }

  std::string eos_field;
  if (!checks.eos_ids.empty()) {
    r.eos_token_ids = checks.eos_ids;
    r.eos_source = "--eos-id";
    eos_field = "--eos-id";
  } else if (checks.tokenizer_dir &&
             !(r.eos_token_ids = read_generation_config_eos(*checks.tokenizer_dir)).empty()) {
    r.eos_source = "tokenizer";
    eos_field = (*checks.tokenizer_dir / "generation_config.json").string() + ": eos_token_id";
  } else if (!c.eos_token_ids.empty()) {
    r.eos_token_ids = c.eos_token_ids;
    r.eos_source = "engine";
    eos_field = "generation_config.json: eos_token_id";
  } else {
    throw EngineConfigError("--eos-id", "no EOS id known: pass --eos-id, or --tokenizer with a "
                                        "generation_config.json, or put one in the engine "
                                        "directory");
  }
  for (TokenId id : r.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      throw EngineConfigError(eos_field, "EOS id " + std::to_string(id) +
                                             " is outside the engine's vocabulary (" +
                                             std::to_string(c.vocab_size) + ")");
    }
  }
  return r;
}

void fill_engine_info(const ResolvedEngine& r, EngineInfo* i) {
  i->max_context = r.max_context;
  i->max_input_len = r.max_input_len;
  i->vocab_size = r.vocab_size;
  i->eos_token_ids = r.eos_token_ids;
  i->tokens_per_block = r.config.tokens_per_block;
  i->tensor_parallel_size = r.config.tp_size;
  i->pipeline_parallel_size = r.config.pp_size;
  i->quantization = r.config.quant_algo;
  i->weight_dtype = r.config.dtype;
  i->kv_cache_dtype = r.config.kv_cache_dtype();
  i->max_batch_size = r.max_batch_size;
  i->max_num_tokens = r.config.max_num_tokens;
}

std::string to_json(const ResolvedEngine& r) {
  const EngineConfig& c = r.config;
  Json j = {
      {"layout", c.layout},
      {"version", c.version},
      {"architecture", c.architecture},
      {"max_context", r.max_context},
      {"max_input_len", r.max_input_len},
      {"vocab_size", r.vocab_size},
      {"eos_token_ids", r.eos_token_ids},
      {"eos_source", r.eos_source},
      {"kv_block_size", c.tokens_per_block},
      {"tensor_parallel_size", c.tp_size},
      {"pipeline_parallel_size", c.pp_size},
      {"world_size", c.world_size},
      {"orchestrator", c.world_size > 1},
      {"quantization", c.quant_algo},
      {"weight_dtype", c.dtype},
      {"kv_cache_dtype", c.kv_cache_dtype()},
      {"max_batch_size", r.max_batch_size},
      {"max_beam_width", c.max_beam_width},
      {"max_num_tokens", c.max_num_tokens},
      {"enable_chunked_context", r.enable_chunked_context},
      {"notes", r.notes},
  };
  return j.dump();
}

}  // namespace switchyard::rt
