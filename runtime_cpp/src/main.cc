// switchyard-cpp-worker: serves switchyard.worker.v1.Worker from C++.
//
//   switchyard-cpp-worker --engine sim --port 7001 [--sim-* knobs]
//   switchyard-cpp-worker --engine trtllm --model /engines/llama --port 7001   (TensorRT-LLM builds)
//
// SIGTERM/SIGINT drain: health NOT_SERVING, stop accepting, in-flight streams get the grace
// period to finish (then they are cancelled), the executor shuts down, exit 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <memory>
#include <string>
#include <thread>

#include "dispatcher.h"
#include "engine_config.h"
#include "sim_executor.h"
#include "worker_log.h"
#include "worker_service.h"
#ifdef SWITCHYARD_WITH_TRTLLM
#include "trtllm_executor.h"
#endif

namespace {

using switchyard::rt::Executor;
using switchyard::rt::log;

struct Args {
  std::map<std::string, std::string> kv;
  std::string get(const std::string& k, const std::string& dflt) const {
    auto it = kv.find(k);
    return it == kv.end() ? dflt : it->second;
  }
  double num(const std::string& k, double dflt) const {
    auto it = kv.find(k);
    if (it == kv.end()) return dflt;
    char* end = nullptr;
    double v = std::strtod(it->second.c_str(), &end);
    if (end == it->second.c_str() || *end != '\0') {
      throw std::invalid_argument("--" + k + ": not a number: " + it->second);
    }
    return v;
  }
};

const char* kUsage =
    "usage: switchyard-cpp-worker --engine sim|trtllm --port N [--host 127.0.0.1]\n"
    "  [--model NAME_OR_ENGINE_DIR] [--grace-s 10] [--termination-log PATH]\n"
    "  [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n"
    "  sim (a simulator, not an engine): [--sim-vocab-size 32000] [--sim-max-context 4096]\n"
    "    [--sim-eos-id 2] [--sim-eos-every 0] [--sim-eos-convention vllm|trtllm]\n"
    "    [--sim-structured-output json_schema,regex,...] (declared, not followed: tests)\n"
    "    [--sim-tokens-per-block 32] [--sim-kv-blocks 4096] [--sim-max-batch 256]\n"
    "    [--sim-prefill-us-per-token 20] [--sim-decode-step-us 2000]\n"
    "    [--sim-decode-us-per-request 20] [--sim-time-scale 1]\n"
    "  trtllm (limits, vocabulary and block size come from the engine's config.json):\n"
    "    [--tokenizer DIR] [--eos-id ID[,ID...]] [--vocab-size TOKENIZER_VOCAB]\n"
    "    [--max-context N] [--max-batch-size N] [--tokens-per-block N]\n"
    "    [--enable-chunked-context 0|1] [--kv-cache-free-gpu-memory-fraction 0.9]\n"
    "    [--max-tokens-in-kv-cache N] [--enable-kv-cache-reuse 1]\n"
    "    [--scheduler-policy guaranteed_no_evict|max_utilization]\n"
    "    [--executor-worker PATH] [--gpus-visible N] [--trtllm-version MAJOR.MINOR]\n"
    "    [--structured-output 1] (with --tokenizer: guided decoding by xgrammar)\n"
    "  switchyard-cpp-worker --check-engine ENGINE_DIR [trtllm flags]: read and check the\n"
    "    engine directory, print what GetInfo would report as JSON, exit 0 (or 2: the field)\n";

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (k.rfind("--", 0) != 0 || i + 1 >= argc) {
      throw std::invalid_argument("unexpected argument: " + k);
    }
    a.kv[k.substr(2)] = argv[++i];
  }
  return a;
}

std::int32_t int_flag(const Args& a, const std::string& k) {
  const double v = a.num(k, 0);
  if (v != static_cast<double>(static_cast<std::int32_t>(v))) {
    throw std::invalid_argument("--" + k + ": not an integer: " + a.get(k, ""));
  }
  return static_cast<std::int32_t>(v);
}

std::optional<std::int32_t> opt_int(const Args& a, const std::string& k) {
  if (!a.kv.count(k)) return std::nullopt;
  return int_flag(a, k);
}

// What the trtllm flags and the machine say, for resolve_engine().
switchyard::rt::EngineChecks engine_checks(const Args& a) {
  switchyard::rt::EngineChecks c;
#ifdef SWITCHYARD_WITH_TRTLLM
  c.runtime_version = switchyard::rt::trtllm_runtime_version();
  c.gpus_visible = switchyard::rt::cuda_device_count();
#else
  if (a.kv.count("trtllm-version")) c.runtime_version = a.get("trtllm-version", "");
  c.gpus_visible = switchyard::rt::gpus_from_cuda_visible_devices(std::getenv("CUDA_VISIBLE_DEVICES"));
#endif
  if (a.kv.count("gpus-visible")) c.gpus_visible = int_flag(a, "gpus-visible");
  c.tokenizer_vocab_size = opt_int(a, "vocab-size");
  if (a.kv.count("eos-id")) {
    std::stringstream in(a.get("eos-id", ""));
    std::string item;
    while (std::getline(in, item, ',')) {
      char* end = nullptr;
      const long id = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || id < 0) {
        throw std::invalid_argument("--eos-id: not a token id: " + item);
      }
      c.eos_ids.push_back(static_cast<switchyard::rt::TokenId>(id));
    }
  }
  if (a.kv.count("tokenizer")) c.tokenizer_dir = a.get("tokenizer", "");
  c.max_context = opt_int(a, "max-context");
  c.max_batch_size = opt_int(a, "max-batch-size");
  c.tokens_per_block = opt_int(a, "tokens-per-block");
  if (a.kv.count("enable-chunked-context")) {
    c.enable_chunked_context = a.num("enable-chunked-context", 0) != 0;
  }
  return c;
}

switchyard::rt::ResolvedEngine resolve(const Args& a, const std::string& engine_dir) {
  if (engine_dir.empty()) {
    throw switchyard::rt::EngineConfigError("--model", "the TensorRT-LLM engine directory is required");
  }
  return switchyard::rt::resolve_engine(switchyard::rt::read_engine_config(engine_dir),
                                        engine_checks(a));
}

std::unique_ptr<Executor> make_executor(const Args& a) {
  const std::string engine = a.get("engine", "sim");
  if (engine == "sim") {
    switchyard::rt::SimConfig c;
    c.model = a.get("model", "sim");
    c.vocab_size = static_cast<int>(a.num("sim-vocab-size", c.vocab_size));
    c.max_context = static_cast<int>(a.num("sim-max-context", c.max_context));
    c.eos_id = static_cast<int>(a.num("sim-eos-id", c.eos_id));
    c.eos_every = static_cast<int>(a.num("sim-eos-every", c.eos_every));
    const std::string convention = a.get("sim-eos-convention", "vllm");
    if (convention != "vllm" && convention != "trtllm") {
      throw std::invalid_argument("--sim-eos-convention: expected vllm or trtllm, got " +
                                  convention);
    }
    c.end_id_in_output = convention == "vllm";
    c.tokens_per_block = static_cast<int>(a.num("sim-tokens-per-block", c.tokens_per_block));
    c.kv_blocks = static_cast<int>(a.num("sim-kv-blocks", c.kv_blocks));
    c.max_batch = static_cast<int>(a.num("sim-max-batch", c.max_batch));
    c.prefill_us_per_token = a.num("sim-prefill-us-per-token", c.prefill_us_per_token);
    c.decode_step_us = a.num("sim-decode-step-us", c.decode_step_us);
    c.decode_us_per_request = a.num("sim-decode-us-per-request", c.decode_us_per_request);
    c.time_scale = a.num("sim-time-scale", c.time_scale);
    c.max_loras = static_cast<int>(a.num("sim-max-loras", c.max_loras));
    c.max_lora_rank = static_cast<int>(a.num("sim-max-lora-rank", c.max_lora_rank));
    // Declared, not followed: the simulator's tokens ignore a constraint (tests only).
    std::string kinds = a.get("sim-structured-output", "");
    for (std::size_t at = 0; !kinds.empty() && at <= kinds.size();) {
      const auto comma = std::min(kinds.find(',', at), kinds.size());
      if (comma > at) c.structured_output.push_back(kinds.substr(at, comma - at));
      at = comma + 1;
    }
    return std::make_unique<switchyard::rt::SimExecutor>(c);
  }
  if (engine == "trtllm") {
#ifdef SWITCHYARD_WITH_TRTLLM
    switchyard::rt::TrtllmOptions o;
    o.engine_dir = a.get("model", "");
    o.engine = resolve(a, o.engine_dir);  // before the executor exists
    for (const auto& note : o.engine.notes) log("engine check", note);
    o.free_gpu_memory_fraction =
        static_cast<float>(a.num("kv-cache-free-gpu-memory-fraction", o.free_gpu_memory_fraction));
    o.max_tokens_in_kv_cache = opt_int(a, "max-tokens-in-kv-cache");
    o.enable_block_reuse = a.num("enable-kv-cache-reuse", 1) != 0;
    o.scheduler_policy = a.get("scheduler-policy", o.scheduler_policy);
    o.worker_executable = a.get("executor-worker", SWITCHYARD_TRTLLM_EXECUTOR_WORKER);
    o.max_loras = static_cast<int>(a.num("max-loras", 0));  // LoRA off unless asked for
    o.max_lora_rank = static_cast<int>(a.num("max-lora-rank", o.max_lora_rank));
    o.max_beam_width = static_cast<int>(a.num("max-beam-width", 1));  // off unless asked for
    o.kv_event_buffer = static_cast<std::size_t>(
        std::max<double>(0, a.num("kv-event-buffer", static_cast<double>(o.kv_event_buffer))));
    if (a.kv.count("tokenizer") && a.num("structured-output", 1) != 0) {
      const std::filesystem::path dir = a.get("tokenizer", "");
      if (std::filesystem::exists(dir / "tokenizer.json")) {
        o.guide_vocabulary = switchyard::rt::read_guide_vocabulary(dir);
      } else {
        log("engine check", "structured output off: no tokenizer.json in " + dir.string());
      }
    }
    log("engine", switchyard::rt::to_json(o.engine));
    return std::make_unique<switchyard::rt::TrtllmExecutor>(o);
#else
    throw std::invalid_argument(
        "--engine trtllm: this binary was built without TensorRT-LLM "
        "(configure CMake with -DTRTLLM_ROOT=...); --check-engine DIR checks an engine "
        "directory without it");
#endif
  }
  throw std::invalid_argument("--engine: expected sim or trtllm, got " + engine);
}


std::string read_file(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--" + flag + ": cannot read " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Plaintext unless --tls-cert and --tls-key name PEM files; with --tls-client-ca too, only
// clients (the control plane) with a certificate that CA signed get in (mutual TLS).
std::shared_ptr<grpc::ServerCredentials> server_credentials(const Args& args) {
  const std::string cert = args.get("tls-cert", ""), key = args.get("tls-key", "");
  const std::string ca = args.get("tls-client-ca", "");
  if (cert.empty() && key.empty() && ca.empty()) return grpc::InsecureServerCredentials();
  if (cert.empty() || key.empty()) {
    throw std::invalid_argument("--tls-cert and --tls-key go together");
  }
  grpc::SslServerCredentialsOptions options(
      ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back({read_file("tls-key", key), read_file("tls-cert", cert)});
  if (!ca.empty()) options.pem_root_certs = read_file("tls-client-ca", ca);
  return grpc::SslServerCredentials(options);
}

// Why the worker cannot start: on stderr, and in --termination-log for its supervisor
// (the control plane reads it and names the reason in its own "startup failed").
int startup_failed(const Args& args, const std::string& message, int code) {
  std::cerr << "switchyard-cpp-worker: " << message << std::endl;
  if (args.kv.count("termination-log")) {
    std::ofstream out(args.get("termination-log", ""), std::ios::trunc);
    out << message << "\n";
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // Signals are taken by one thread with sigwait; block them everywhere else.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  Args args;
  std::unique_ptr<Executor> executor;
  double grace_s = 10;
  try {
    args = parse(argc, argv);
    if (args.kv.count("check-engine")) {
      // Read and check an engine directory, as --engine trtllm would before its executor.
      try {
        std::cout << switchyard::rt::to_json(resolve(args, args.get("check-engine", ""))) << "\n";
        return 0;
      } catch (const switchyard::rt::EngineConfigError& e) {
        std::cerr << "switchyard-cpp-worker: engine " << args.get("check-engine", "") << ": "
                  << e.what() << std::endl;
        return 2;
      }
    }
    if (!args.kv.count("port")) throw std::invalid_argument("--port is required");
    grace_s = args.num("grace-s", grace_s);
    log("loading engine", "engine=" + args.get("engine", "sim"));
    executor = make_executor(args);
  } catch (const switchyard::rt::EngineConfigError& e) {
    // One line naming the field: the engine directory, a flag or the machine disagree.
    return startup_failed(args, "engine " + args.get("model", "") + ": " + e.what(), 2);
  } catch (const std::exception& e) {
    std::cerr << kUsage;
    return startup_failed(args, e.what(), 2);
  }
  const std::string address = args.get("host", "127.0.0.1") + ":" + args.get("port", "");

  {
    switchyard::rt::Dispatcher dispatcher(*executor);
    switchyard::rt::WorkerService service(*executor, dispatcher);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int bound_port = 0;
    std::shared_ptr<grpc::ServerCredentials> credentials;
    try {
      credentials = server_credentials(args);
    } catch (const std::exception& e) {
      return startup_failed(args, e.what(), 2);
    }
    builder.AddListeningPort(address, credentials, &bound_port);
    // gRPC sets SO_REUSEPORT by default: a second worker on the same port would then listen
    // too, and the kernel would split the connections between them. One port, one worker.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.RegisterService(&service);
    builder.SetMaxReceiveMessageSize(64 * 1024 * 1024);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server || bound_port == 0) {
      return startup_failed(
          args, "cannot listen on " + address + ": port in use (or not permitted)", 1);
    }
    auto* health = server->GetHealthCheckService();
    const std::string svc = switchyard::worker::v1::Worker::service_full_name();
    const bool ready = executor->can_enqueue();
    health->SetServingStatus(ready);
    health->SetServingStatus(svc, ready);
    auto info = executor->info();
    log("serving", "address=" + address + " engine=" + info.engine + " version='" +
                       info.engine_version + "' model=" + info.model);

    int sig = 0;
    sigwait(&signals, &sig);
    log("draining", "signal=" + std::to_string(sig) + " grace_s=" + std::to_string(grace_s));
    health->SetServingStatus(false);
    health->SetServingStatus(svc, false);
    // Refuse new streams; in-flight ones get the grace period to finish.
    service.start_drain();
    const auto drain_until = std::chrono::steady_clock::now() +
                             std::chrono::milliseconds(static_cast<long>(grace_s * 1000));
    while (service.live_streams() > 0 && std::chrono::steady_clock::now() < drain_until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    log("drained", "streams_left=" + std::to_string(service.live_streams()));
    // Whatever is left (streams past the grace, health watches, load streams) is
    // cancelled now; a cancelled Generate cancels its executor request in OnCancel.
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    dispatcher.stop();
    executor->shutdown();
    server->Wait();
  }
  log("stopped");
  return 0;
}
