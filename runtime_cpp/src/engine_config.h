// A TensorRT-LLM engine directory read for what it is, before any executor exists.
//
// read_engine_config() parses the `config.json` that trtllm-build writes (TensorRT-LLM 0.9
// and later: `version`, `pretrained_config` with `mapping` and `quantization`, `build_config`
// with its limits and `plugin_config`) or the older layout of TensorRT-LLM 0.x engines built
// with the per-model build scripts (no `version`; a top-level `builder_config` and
// `plugin_config`). resolve_engine() then checks it against what this worker was told and
// what the machine has (the runtime's TensorRT-LLM version, the GPUs visible, the tokenizer's
// vocabulary and EOS ids, explicit flags) and yields the values GetInfo reports.
//
// Nothing here depends on TensorRT-LLM, so the simulator build and its tests exercise it.
// Every error names the field (a config.json path such as `build_config.max_seq_len`, or a
// flag such as `--max-context`) and the reason.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "executor.h"

namespace switchyard::rt {

// An engine directory, a flag or the machine contradicts what the worker needs.
class EngineConfigError : public std::runtime_error {
 public:
  EngineConfigError(std::string field, const std::string& reason)
      : std::runtime_error(field + ": " + reason), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

struct EngineConfig {
  std::string layout;        // "build_config" (trtllm-build) or "builder_config" (older 0.x)
  std::string version;       // TensorRT-LLM version that built it; "" in the older layout
  std::string architecture;  // e.g. LlamaForCausalLM (older layout: builder_config.name)
  std::string dtype;         // float16, bfloat16, float32
  std::int32_t vocab_size = 0;
  std::int32_t world_size = 1;
  std::int32_t tp_size = 1;
  std::int32_t pp_size = 1;
  std::string quant_algo;           // "" for none, else TensorRT-LLM's QuantAlgo name
  std::string kv_cache_quant_algo;  // "" for none (the KV cache in dtype)
  std::int32_t max_input_len = 0;
  std::int32_t max_seq_len = 0;     // prompt plus output
  std::int32_t max_batch_size = 0;
  std::int32_t max_beam_width = 1;
  std::int32_t max_num_tokens = 0;  // 0: not recorded
  std::int32_t tokens_per_block = 0;
  bool paged_kv_cache = false;
  bool use_paged_context_fmha = false;
  std::vector<TokenId> eos_token_ids;  // from the engine directory's generation_config.json

  // The KV cache's element type: the KV quantization's, else the weights' dtype.
  std::string kv_cache_dtype() const;
  // TensorRT-LLM chunks a prompt only into a paged KV cache through paged context FMHA.
  bool chunked_context_allowed() const { return paged_kv_cache && use_paged_context_fmha; }
};

// Parses config.json text (either layout); throws EngineConfigError naming the field.
EngineConfig parse_engine_config(const std::string& json_text);

// Reads DIR/config.json, checks that every rank's engine file is there, and reads the EOS
// ids of DIR/generation_config.json when it exists.
EngineConfig read_engine_config(const std::filesystem::path& engine_dir);

// EOS ids from a model or tokenizer directory's generation_config.json (`eos_token_id`, a
// number or a list); empty when the file is absent. Throws EngineConfigError when it is
// unreadable.
std::vector<TokenId> read_generation_config_eos(const std::filesystem::path& dir);

// What guided decoding (structured output) needs of the tokenizer: every token's string in
// id order, and tokenizer.json itself (from which xgrammar learns how tokens encode bytes).
struct GuideVocabulary {
  std::vector<std::string> encoded_vocab;  // index = token id; "" for an unused id
  std::string tokenizer_json;
};

// Reads DIR/tokenizer.json (a Hugging Face fast tokenizer): model.vocab and added_tokens.
// Throws EngineConfigError naming the file and the key when it is missing or malformed.
GuideVocabulary read_guide_vocabulary(const std::filesystem::path& tokenizer_dir);

// What the worker was told and what the machine has.
struct EngineChecks {
  std::optional<std::string> runtime_version;  // TensorRT-LLM's own, or --trtllm-version
  std::optional<std::int32_t> gpus_visible;    // unknown: the world-size check is skipped
  // From the model's tokenizer (the control plane passes them).
  std::optional<std::int32_t> tokenizer_vocab_size;  // --vocab-size
  std::vector<TokenId> eos_ids;                      // --eos-id (wins over the tokenizer dir)
  std::optional<std::filesystem::path> tokenizer_dir;  // --tokenizer: generation_config.json
  // Explicit flags: a limit may be lowered, never raised past the engine's.
  std::optional<std::int32_t> max_context;       // --max-context
  std::optional<std::int32_t> max_batch_size;    // --max-batch-size
  std::optional<std::int32_t> tokens_per_block;  // --tokens-per-block (must match)
  std::optional<bool> enable_chunked_context;    // --enable-chunked-context
};

// The engine as this worker serves it.
struct ResolvedEngine {
  EngineConfig config;
  std::int32_t max_context = 0;     // prompt plus output
  std::int32_t max_input_len = 0;   // longest prompt
  std::int32_t vocab_size = 0;      // the engine's (logits) vocabulary
  std::int32_t max_batch_size = 0;  // what the executor is configured with
  std::vector<TokenId> eos_token_ids;
  std::string eos_source;           // "--eos-id", "tokenizer", "engine"
  bool enable_chunked_context = false;
  std::vector<std::string> notes;   // checks skipped or limits lowered, with the reason
};

// Throws EngineConfigError naming the field that contradicts.
ResolvedEngine resolve_engine(const EngineConfig& config, const EngineChecks& checks);

// GPUs that CUDA_VISIBLE_DEVICES leaves visible; nullopt when it is unset (then only the
// CUDA runtime knows). "" and "-1" hide every GPU.
std::optional<std::int32_t> gpus_from_cuda_visible_devices(const char* value);

// The GetInfo-facing values as one JSON object (for --check-engine).
std::string to_json(const ResolvedEngine& engine);

// The engine-facing part of GetInfo.
void fill_engine_info(const ResolvedEngine& engine, EngineInfo* info);

}  // namespace switchyard::rt
