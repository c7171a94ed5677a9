// LoRA adapters in the C++ worker: the registry's bookkeeping over the simulator, the
// simulator's per-adapter token streams, and the reading of TensorRT-LLM's .npy adapters.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "adapters.h"
#include "npy.h"
#include "sim_executor.h"

namespace switchyard::rt {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() /
               ("switchyard-adapters-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

fs::path peft_dir(const std::string& name, int rank) {
  fs::path d = temp_dir(name);
  std::ofstream(d / "adapter_config.json") << "{\"r\": " << rank << ", \"lora_alpha\": 16}";
  return d;
}

SimConfig sim_config() {
  SimConfig c;
  c.virtual_clock = true;
  c.vocab_size = 1000;
  c.max_context = 512;
  c.max_lora_rank = 16;
  return c;
}

Tokens generate(SimExecutor& sim, std::optional<AdapterId> adapter) {
  GenRequest r;
  r.prompt = {5, 6, 7};
  r.max_tokens = 12;
  r.adapter = adapter;
  const RequestId id = sim.enqueue(r);
  Tokens out;
  for (int i = 0; i < 1000; ++i) {
    sim.step();
    for (auto& resp : sim.await_responses(std::chrono::milliseconds(0))) {
      if (resp.id != id) continue;
      out.insert(out.end(), resp.tokens.begin(), resp.tokens.end());
      if (resp.is_final) return out;
    }
  }
  ADD_FAILURE() << "no final";
  return out;
}

TEST(SimAdapters, EachAdapterHasItsOwnTokenStreamAndTheSameOneEveryTime) {
  SimExecutor sim(sim_config());
  EXPECT_TRUE(sim.info().lora);
  EXPECT_EQ(sim.info().max_lora_rank, 16);
  EXPECT_EQ(sim.load_adapter(1, peft_dir("a", 8).string()), 8);
  EXPECT_EQ(sim.load_adapter(2, peft_dir("b", 4).string()), 4);
  const Tokens base = generate(sim, std::nullopt);
  const Tokens a = generate(sim, 1);
  const Tokens b = generate(sim, 2);
  EXPECT_NE(a, base);
  EXPECT_NE(b, base);
  EXPECT_NE(a, b);
  EXPECT_EQ(generate(sim, 1), a);
  EXPECT_EQ(generate(sim, std::nullopt), base);
  sim.unload_adapter(1);
  GenRequest gone;
  gone.prompt = {1};
  gone.adapter = 1;
  try {
    sim.enqueue(gone);
    FAIL() << "an unloaded task id was taken";
  } catch (const InvalidRequest& e) {
    EXPECT_EQ(e.field(), "adapter");
  }
}

TEST(SimAdapters, RefusesWhatItCannotUseNamingThePath) {
  SimExecutor sim(sim_config());
  auto refused = [&](const std::string& path) {
    try {
      sim.load_adapter(7, path);
    } catch (const InvalidRequest& e) {
      EXPECT_EQ(e.field(), "path");
      return e.message();
    }
    return std::string("accepted");
  };
  EXPECT_NE(refused(peft_dir("wide", 32).string()).find("max_lora_rank 16"), std::string::npos);
  EXPECT_NE(refused("/nonexistent/adapter").find("not a directory"), std::string::npos);
  EXPECT_NE(refused(temp_dir("empty").string()).find("adapter_config.json"), std::string::npos);
  SimConfig off = sim_config();
  off.max_loras = 0;
  SimExecutor no_lora(off);
  EXPECT_FALSE(no_lora.info().lora);
  EXPECT_THROW(no_lora.load_adapter(1, peft_dir("c", 8).string()), NoLora);
}

// The registry over a real-time simulator: names, counts in use, and an unload that waits
// for the adapter's requests before the engine forgets it.
TEST(AdapterRegistry, UnloadWaitsForTheRequestsUsingTheAdapter) {
  SimConfig c = sim_config();
  c.virtual_clock = false;
  c.decode_step_us = 1000;
  SimExecutor sim(c);
  AdapterRegistry reg(sim);
  AdapterRefusal why;
  auto loaded = reg.load("tenant-a", peft_dir("reg", 8).string(), &why);
  ASSERT_TRUE(loaded) << why.message;
  EXPECT_EQ(loaded->rank, 8);
  EXPECT_TRUE(reg.load("tenant-a", loaded->path, &why));  // the same again: a no-op
  EXPECT_FALSE(reg.load("tenant-a", peft_dir("other", 8).string(), &why));
  EXPECT_EQ(adapter_code(why), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_FALSE(reg.load("no spaces", loaded->path, &why));
  EXPECT_EQ(why.field, "name");
  EXPECT_FALSE(reg.acquire("tenant-b", &why));
  EXPECT_EQ(adapter_code(why), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(why.field, "adapter");

  auto task = reg.acquire("tenant-a", &why);
  ASSERT_TRUE(task);
  GenRequest r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 60;  // about 60 ms of decode steps
  r.adapter = task;
  const RequestId id = sim.enqueue(r);
  reg.bind(id, "tenant-a");
  EXPECT_EQ(reg.list().at(0).in_flight, 1u);
  auto unloading = std::async(std::launch::async, [&] {
    return reg.unload("tenant-a", std::chrono::seconds(30));
  });
  // While it waits, the name takes no new request (list() leaves out what is unloading).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!reg.list().empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(reg.acquire("tenant-a", &why));
  EXPECT_EQ(adapter_code(why), grpc::StatusCode::NOT_FOUND);
  bool final_seen = false;
  while (!final_seen && std::chrono::steady_clock::now() < until) {
    for (auto& resp : sim.await_responses(std::chrono::milliseconds(20))) {
      final_seen = final_seen || (resp.id == id && resp.is_final);
    }
  }
  ASSERT_TRUE(final_seen);
  EXPECT_EQ(unloading.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "unload returned before the request was released";
  reg.release(id);
  auto done = unloading.get();
  ASSERT_TRUE(done);
  EXPECT_EQ(done->first, 1u);   // drained
  EXPECT_EQ(done->second, 0u);  // cancelled
  EXPECT_TRUE(reg.list().empty());
  EXPECT_FALSE(reg.unload("tenant-a", std::chrono::seconds(0)));
  sim.shutdown();
}

TEST(AdapterRegistry, UnloadCancelsWhatOutlivesTheGrace) {
  SimConfig c = sim_config();
  c.virtual_clock = false;
  c.decode_step_us = 5000;  // 500 tokens: 2.5 s, far beyond the grace
  SimExecutor sim(c);
  AdapterRegistry reg(sim);
  AdapterRefusal why;
  ASSERT_TRUE(reg.load("long", peft_dir("long", 8).string(), &why));
  auto task = reg.acquire("long", &why);
  GenRequest r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 500;
  r.adapter = task;
  const RequestId id = sim.enqueue(r);
  reg.bind(id, "long");
  // The dispatcher's part in the worker: release once the final (cancelled) comes.
  std::atomic<bool> stop{false};
  std::thread pump([&] {
    while (!stop.load()) {
      for (auto& resp : sim.await_responses(std::chrono::milliseconds(10))) {
        if (resp.is_final) reg.release(resp.id);
      }
    }
  });
  auto done = reg.unload("long", std::chrono::milliseconds(30));
  stop.store(true);
  pump.join();
  ASSERT_TRUE(done);
  EXPECT_EQ(done->first, 0u);
  EXPECT_EQ(done->second, 1u);
  sim.shutdown();
}

std::vector<unsigned char> npy_bytes(const std::string& descr, const std::string& shape,
                                     const void* data, std::size_t size) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + shape +
                       "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.push_back(static_cast<unsigned char>(header.size() & 0xff));
  out.push_back(static_cast<unsigned char>(header.size() >> 8));
  out.insert(out.end(), header.begin(), header.end());
  const auto* p = static_cast<const unsigned char*>(data);
  out.insert(out.end(), p, p + size);
  return out;
}

void write(const fs::path& path, const std::vector<unsigned char>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

TEST(Npy, ParsesShapeDtypeAndDataAndNamesWhatIsWrong) {
  const float values[6] = {1, 2, 3, 4, 5, 6};
  NpyArray a = parse_npy(npy_bytes("<f4", "2, 3", values, sizeof values));
  EXPECT_EQ(a.dtype, "<f4");
  EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3}));
  float back[6];
  std::memcpy(back, a.data.data(), sizeof back);
  EXPECT_EQ(back[5], 6.0f);
  EXPECT_THROW(parse_npy(npy_bytes("<f4", "2, 4", values, sizeof values)), std::runtime_error);
  EXPECT_THROW(parse_npy({'n', 'o', 'p', 'e', 0, 0, 0, 0, 0, 0, 0}), std::runtime_error);
  EXPECT_THROW(parse_npy(npy_bytes("|O", "1", values, 8)), std::runtime_error);
}

TEST(Npy, ReadsTensorRtLlmLoraDirectories) {
  fs::path d = temp_dir("trtllm");
  // Two rows (module, layer, rank), as TensorRT-LLM's converter writes them: [1, rows, 3].
  const std::int64_t config[6] = {1, 0, 8, 2, 0, 4};
  const std::uint16_t weights[2 * 5] = {};
  write(d / "model.lora_config.npy", npy_bytes("<i8", "1, 2, 3", config, sizeof config));
  write(d / "model.lora_weights.npy", npy_bytes("<f2", "1, 2, 5", weights, sizeof weights));
  LoraFiles files = read_lora_dir(d.string(), 16);
  EXPECT_EQ(files.rank, 8);
  EXPECT_EQ(files.config.dtype, "<i4");  // narrowed for the executor
  EXPECT_EQ(files.config.shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(files.weights.shape, (std::vector<std::int64_t>{2, 5}));
  try {
    read_lora_dir(d.string(), 4);
    FAIL() << "a rank above the limit was taken";
  } catch (const InvalidRequest& e) {
    EXPECT_EQ(e.field(), "path");
    EXPECT_NE(e.message().find("max_lora_rank 4"), std::string::npos);
  }
  EXPECT_THROW(read_lora_dir(temp_dir("none").string(), 16), InvalidRequest);
}

}  // namespace
}  // namespace switchyard::rt
