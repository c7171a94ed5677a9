// The engine directory's config.json, read and checked without TensorRT-LLM.
#include "engine_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace switchyard::rt {
namespace {

// What trtllm-build writes (TensorRT-LLM 1.0), trimmed to what the worker reads plus noise.
std::string new_layout(const std::string& version = "1.0.0", int tp = 1, int pp = 1,
                       const std::string& quant = "null", const std::string& kv_quant = "null",
                       bool paged_context_fmha = true) {
  return R"({"version": ")" + version + R"(",
    "pretrained_config": {"architecture": "LlamaForCausalLM", "dtype": "bfloat16",
      "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
      "mapping": {"world_size": )" + std::to_string(tp * pp) + R"(, "tp_size": )" +
         std::to_string(tp) + R"(, "pp_size": )" + std::to_string(pp) + R"(, "cp_size": 1},
      "quantization": {"quant_algo": )" + quant + R"(, "kv_cache_quant_algo": )" + kv_quant + R"(}},
    "build_config": {"max_input_len": 2048, "max_seq_len": 8192, "max_batch_size": 64,
      "max_beam_width": 1, "max_num_tokens": 8192,
      "plugin_config": {"paged_kv_cache": true, "tokens_per_block": 32,
        "use_paged_context_fmha": )" + (paged_context_fmha ? "true" : "false") + R"(}}})";
}

// The older layout (TensorRT-LLM 0.x build scripts).
std::string old_layout(int quant_mode = 0, const std::string& extra = "") {
  return R"({"builder_config": {"name": "llama", "precision": "float16", "tensor_parallel": 2,
      "pipeline_parallel": 1, "vocab_size": 32000, "max_batch_size": 8, "max_input_len": 1024,
      "max_output_len": 512, "max_num_tokens": null, "quant_mode": )" +
         std::to_string(quant_mode) + extra + R"(},
    "plugin_config": {"paged_kv_cache": true, "tokens_per_block": 64,
      "use_paged_context_fmha": false}})";
}

std::string field_of(const std::string& json) {
  try {
    parse_engine_config(json);
  } catch (const EngineConfigError& e) {
    return e.field();
  }
  return "(accepted)";
}

EngineChecks known_machine() {
  EngineChecks c;
  c.runtime_version = "1.0.0";
  c.gpus_visible = 8;
  c.eos_ids = {128001};
  return c;
}

std::string resolve_field(const EngineConfig& config, const EngineChecks& checks) {
  try {
    resolve_engine(config, checks);
  } catch (const EngineConfigError& e) {
    return e.field();
  }
  return "(accepted)";
}

TEST(EngineConfig, ReadsTheTrtllmBuildLayout) {
  const EngineConfig c = parse_engine_config(new_layout("1.0.0", 4, 2, R"("FP8")", R"("FP8")"));
  EXPECT_EQ(c.layout, "build_config");
  EXPECT_EQ(c.version, "1.0.0");
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.world_size, 8);
  EXPECT_EQ(c.tp_size, 4);
  EXPECT_EQ(c.pp_size, 2);
  EXPECT_EQ(c.quant_algo, "FP8");
  EXPECT_EQ(c.kv_cache_dtype(), "fp8");
  EXPECT_EQ(c.max_input_len, 2048);
  EXPECT_EQ(c.max_seq_len, 8192);
  EXPECT_EQ(c.max_batch_size, 64);
  EXPECT_EQ(c.max_num_tokens, 8192);
  EXPECT_EQ(c.tokens_per_block, 32);
  EXPECT_TRUE(c.chunked_context_allowed());
}

TEST(EngineConfig, UnquantizedKvCacheTakesTheWeightsDtype) {
  const EngineConfig c = parse_engine_config(new_layout());
  EXPECT_EQ(c.quant_algo, "");
  EXPECT_EQ(c.kv_cache_dtype(), "bfloat16");
}

TEST(EngineConfig, ReadsTheOlderBuilderConfigLayout) {
  const EngineConfig c = parse_engine_config(old_layout());
  EXPECT_EQ(c.layout, "builder_config");
  EXPECT_EQ(c.version, "");
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.dtype, "float16");
  EXPECT_EQ(c.tp_size, 2);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.max_seq_len, 1024 + 512);  // max_input_len + max_output_len
  EXPECT_EQ(c.max_num_tokens, 0);        // null: not recorded
  EXPECT_EQ(c.tokens_per_block, 64);
  EXPECT_FALSE(c.chunked_context_allowed());
  EXPECT_EQ(parse_engine_config(old_layout(0, R"(, "max_seq_len": 4000)")).max_seq_len, 4000);
}

TEST(EngineConfig, OlderQuantModeBitsBecomeQuantAlgoNames) {
  EXPECT_EQ(parse_engine_config(old_layout(2)).quant_algo, "W8A16");      // int8 weights
  EXPECT_EQ(parse_engine_config(old_layout(1)).quant_algo, "W4A16");      // int4 weights
  EXPECT_EQ(parse_engine_config(old_layout(1 | 32)).quant_algo, "W4A16_GROUPWISE");
  EXPECT_EQ(parse_engine_config(old_layout(2 | 4 | 8 | 16)).quant_algo,
            "W8A8_SQ_PER_CHANNEL_PER_TOKEN");                              // SmoothQuant
  EXPECT_EQ(parse_engine_config(old_layout(256)).quant_algo, "FP8");
  EXPECT_EQ(parse_engine_config(old_layout(2 | 64)).kv_cache_dtype(), "int8");
  EXPECT_EQ(parse_engine_config(old_layout(128)).kv_cache_dtype(), "fp8");
}

TEST(EngineConfig, BrokenConfigsNameTheField) {
  EXPECT_EQ(field_of("{not json"), "config.json");
  EXPECT_EQ(field_of("[]"), "config.json");
  EXPECT_EQ(field_of("{}"), "version");
  std::string j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"max_seq_len\": 8192"), 19, "\"max_seq_len\": \"x\"")),
            "build_config.max_seq_len");
  j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"max_input_len\": 2048"), 21, "\"max_input_len\": 9000")),
            "build_config.max_input_len");
  j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("bfloat16"), 8, "int4")), "pretrained_config.dtype");
  j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"world_size\": 1"), 15, "\"world_size\": 3")),
            "pretrained_config.mapping.world_size");
  j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"paged_kv_cache\": true"), 22, "\"paged_kv_cache\": false")),
            "build_config.plugin_config.paged_kv_cache");
  j = new_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"vocab_size\": 128256"), 20, "\"vocab_size\": 0")),
            "pretrained_config.vocab_size");
  EXPECT_EQ(field_of(R"({"version": "1.0.0", "build_config": {}})"), "pretrained_config");
  j = old_layout();
  EXPECT_EQ(field_of(j.replace(j.find("\"max_output_len\": 512"), 21, "\"max_output_len\": null")),
            "builder_config.max_output_len");
}

TEST(EngineConfig, ResolvesWhatGetInfoReports) {
  const ResolvedEngine r = resolve_engine(parse_engine_config(new_layout()), known_machine());
  EXPECT_EQ(r.max_context, 8192);
  EXPECT_EQ(r.max_input_len, 2048);
  EXPECT_EQ(r.vocab_size, 128256);
  EXPECT_EQ(r.max_batch_size, 64);
  EXPECT_EQ(r.eos_token_ids, std::vector<TokenId>{128001});
  EXPECT_TRUE(r.enable_chunked_context);
  EngineInfo info;
  fill_engine_info(r, &info);
  EXPECT_EQ(info.tokens_per_block, 32);
  EXPECT_EQ(info.weight_dtype, "bfloat16");
  EXPECT_EQ(info.max_num_tokens, 8192);
}

TEST(EngineConfig, VersionMustMatchTheRuntime) {
  const EngineConfig c = parse_engine_config(new_layout("0.21.0"));
  EXPECT_EQ(resolve_field(c, known_machine()), "version");
  EngineChecks same = known_machine();
  same.runtime_version = "0.21.1";  // a patch release runs the same engines
  EXPECT_EQ(resolve_field(c, same), "(accepted)");
  EngineChecks unknown = known_machine();
  unknown.runtime_version.reset();
  const ResolvedEngine r = resolve_engine(c, unknown);
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes[0].find("version check skipped"), std::string::npos);
  EXPECT_EQ(resolve_field(parse_engine_config(old_layout()), known_machine()), "version");
}

TEST(EngineConfig, WorldSizeMustFitTheVisibleGpus) {
  const EngineConfig c = parse_engine_config(new_layout("1.0.0", 4, 2));
  EngineChecks four = known_machine();
  four.gpus_visible = 4;
  EXPECT_EQ(resolve_field(c, four), "pretrained_config.mapping.world_size");
  four.gpus_visible = 8;
  EXPECT_EQ(resolve_field(c, four), "(accepted)");
}

TEST(EngineConfig, FlagsMayLowerLimitsButNotContradictTheEngine) {
  const EngineConfig c = parse_engine_config(new_layout("1.0.0", 1, 1, "null", "null", false));
  EngineChecks f = known_machine();
  f.max_context = 10000;
  EXPECT_EQ(resolve_field(c, f), "--max-context");
  f.max_context = 1024;
  const ResolvedEngine lowered = resolve_engine(c, f);
  EXPECT_EQ(lowered.max_context, 1024);
  EXPECT_EQ(lowered.max_input_len, 1023);
  f = known_machine();
  f.max_batch_size = 65;
  EXPECT_EQ(resolve_field(c, f), "--max-batch-size");
  f = known_machine();
  f.tokens_per_block = 64;
  EXPECT_EQ(resolve_field(c, f), "--tokens-per-block");
  f = known_machine();
  f.enable_chunked_context = true;  // built without paged context FMHA
  EXPECT_EQ(resolve_field(c, f), "--enable-chunked-context");
  EXPECT_FALSE(resolve_engine(c, known_machine()).enable_chunked_context);
}

TEST(EngineConfig, TokenizerMustFitTheEngine) {
  const EngineConfig c = parse_engine_config(new_layout());
  EngineChecks f = known_machine();
  f.tokenizer_vocab_size = 128257;
  EXPECT_EQ(resolve_field(c, f), "--vocab-size");
  f.tokenizer_vocab_size = 128000;  // an engine's vocabulary may be padded
  EXPECT_EQ(resolve_field(c, f), "(accepted)");
  f.eos_ids = {200000};
  EXPECT_EQ(resolve_field(c, f), "--eos-id");
}

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/engine_config_test_XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  std::filesystem::path dir_;
};

using EngineDir = TempDir;

TEST_F(EngineDir, EveryRankNeedsItsEngineFile) {
  write("config.json", new_layout("1.0.0", 2, 1));
  write("rank0.engine", "");
  try {
    read_engine_config(dir_);
    FAIL() << "accepted a directory without rank1.engine";
  } catch (const EngineConfigError& e) {
    EXPECT_EQ(e.field(), "rank1.engine");
  }
  write("rank1.engine", "");
  EXPECT_EQ(read_engine_config(dir_).world_size, 2);
}

TEST_F(EngineDir, EosComesFromFlagThenTokenizerThenEngine) {
  write("config.json", new_layout());
  write("rank0.engine", "");
  write("generation_config.json", R"({"eos_token_id": 128009})");
  std::filesystem::create_directory(dir_ / "tok");
  std::ofstream(dir_ / "tok" / "generation_config.json") << R"({"eos_token_id": [128001, 128008]})";
  const EngineConfig c = read_engine_config(dir_);
  EngineChecks f = known_machine();
  f.eos_ids.clear();
  EXPECT_EQ(resolve_engine(c, f).eos_token_ids, std::vector<TokenId>{128009});
  EXPECT_EQ(resolve_engine(c, f).eos_source, "engine");
  f.tokenizer_dir = dir_ / "tok";
  EXPECT_EQ(resolve_engine(c, f).eos_token_ids, (std::vector<TokenId>{128001, 128008}));
  f.eos_ids = {2};
  EXPECT_EQ(resolve_engine(c, f).eos_token_ids, std::vector<TokenId>{2});
  EngineConfig none = c;
  none.eos_token_ids.clear();
  f = known_machine();
  f.eos_ids.clear();
  EXPECT_EQ(resolve_field(none, f), "--eos-id");
}

TEST(EngineConfig, CudaVisibleDevices) {
  EXPECT_EQ(gpus_from_cuda_visible_devices(nullptr), std::nullopt);
  EXPECT_EQ(gpus_from_cuda_visible_devices(""), 0);
  EXPECT_EQ(gpus_from_cuda_visible_devices("-1"), 0);
  EXPECT_EQ(gpus_from_cuda_visible_devices("0"), 1);
  EXPECT_EQ(gpus_from_cuda_visible_devices("0,1,3"), 3);
  EXPECT_EQ(gpus_from_cuda_visible_devices("GPU-4f2a,GPU-77c1"), 2);
  EXPECT_EQ(gpus_from_cuda_visible_devices("0,1,-1,2"), 2);  // CUDA stops at an invalid entry
}

using TokenizerDir = TempDir;

TEST_F(TokenizerDir, GuideVocabularyIsEveryTokenInIdOrder) {
  const std::string json = R"({"model": {"type": "BPE", "vocab": {"a": 0, "\u0120b": 2, "c": 1}},
    "added_tokens": [{"id": 4, "content": "<|end|>", "special": true}]})";
  write("tokenizer.json", json);
  const GuideVocabulary v = read_guide_vocabulary(dir_);
  EXPECT_EQ(v.encoded_vocab, (std::vector<std::string>{"a", "c", "\xC4\xA0" "b", "", "<|end|>"}));
  EXPECT_EQ(v.tokenizer_json, json);  // xgrammar reads the byte encoding from it
}

TEST_F(TokenizerDir, GuideVocabularyProblemsNameTheFileAndKey) {
  try {
    read_guide_vocabulary(dir_);
    FAIL() << "accepted a directory without tokenizer.json";
  } catch (const EngineConfigError& e) {
    EXPECT_EQ(e.field(), "--tokenizer");
  }
  write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": -1}}})");
  try {
    read_guide_vocabulary(dir_);
    FAIL() << "accepted a negative token id";
  } catch (const EngineConfigError& e) {
    EXPECT_EQ(e.field(), (dir_ / "tokenizer.json").string() + ": model.vocab.a");
  }
  write("tokenizer.json", R"({"model": {"type": "WordPiece"}})");
  try {
    read_guide_vocabulary(dir_);
    FAIL() << "accepted a tokenizer without a vocabulary";
  } catch (const EngineConfigError& e) {
    EXPECT_EQ(e.field(), (dir_ / "tokenizer.json").string() + ": model.vocab");
  }
}

}  // namespace
}  // namespace switchyard::rt
