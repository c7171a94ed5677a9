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

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "dispatcher.h"
#include "sim_executor.h"
#include "worker_service.h"
#ifdef SWITCHYARD_WITH_TRTLLM
#include "trtllm_executor.h"
#endif

namespace {

using switchyard::rt::Executor;

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
    "  [--model NAME_OR_ENGINE_DIR] [--grace-s 10]\n"
    "  sim (a simulator, not an engine): [--sim-vocab-size 32000] [--sim-max-context 4096]\n"
    "    [--sim-eos-id 2] [--sim-eos-every 0] [--sim-tokens-per-block 32] [--sim-kv-blocks 4096]\n"
    "    [--sim-max-batch 256] [--sim-prefill-us-per-token 20] [--sim-decode-step-us 2000]\n"
    "    [--sim-decode-us-per-request 20] [--sim-time-scale 1]\n"
    "  trtllm: [--max-batch-size 64] [--kv-cache-free-gpu-memory-fraction 0.9]\n"
    "    [--max-tokens-in-kv-cache N] [--enable-kv-cache-reuse 1]\n"
    "    [--scheduler-policy guaranteed_no_evict|max_utilization]\n"
    "    [--max-context 4096] [--vocab-size 32000] [--eos-id 2]\n";

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

std::unique_ptr<Executor> make_executor(const Args& a) {
  const std::string engine = a.get("engine", "sim");
  if (engine == "sim") {
    switchyard::rt::SimConfig c;
    c.model = a.get("model", "sim");
    c.vocab_size = static_cast<int>(a.num("sim-vocab-size", c.vocab_size));
    c.max_context = static_cast<int>(a.num("sim-max-context", c.max_context));
    c.eos_id = static_cast<int>(a.num("sim-eos-id", c.eos_id));
    c.eos_every = static_cast<int>(a.num("sim-eos-every", c.eos_every));
    c.tokens_per_block = static_cast<int>(a.num("sim-tokens-per-block", c.tokens_per_block));
    c.kv_blocks = static_cast<int>(a.num("sim-kv-blocks", c.kv_blocks));
    c.max_batch = static_cast<int>(a.num("sim-max-batch", c.max_batch));
    c.prefill_us_per_token = a.num("sim-prefill-us-per-token", c.prefill_us_per_token);
    c.decode_step_us = a.num("sim-decode-step-us", c.decode_step_us);
    c.decode_us_per_request = a.num("sim-decode-us-per-request", c.decode_us_per_request);
    c.time_scale = a.num("sim-time-scale", c.time_scale);
    return std::make_unique<switchyard::rt::SimExecutor>(c);
  }
  if (engine == "trtllm") {
#ifdef SWITCHYARD_WITH_TRTLLM
    switchyard::rt::TrtllmOptions o;
    o.engine_dir = a.get("model", "");
    o.max_batch_size = static_cast<int>(a.num("max-batch-size", o.max_batch_size));
    o.free_gpu_memory_fraction =
        static_cast<float>(a.num("kv-cache-free-gpu-memory-fraction", o.free_gpu_memory_fraction));
    if (a.kv.count("max-tokens-in-kv-cache")) {
      o.max_tokens_in_kv_cache = static_cast<int>(a.num("max-tokens-in-kv-cache", 0));
    }
    o.enable_block_reuse = a.num("enable-kv-cache-reuse", 1) != 0;
    o.scheduler_policy = a.get("scheduler-policy", o.scheduler_policy);
    o.max_context = static_cast<int>(a.num("max-context", o.max_context));
    o.vocab_size = static_cast<int>(a.num("vocab-size", o.vocab_size));
    if (a.kv.count("eos-id")) o.eos_token_ids = {static_cast<int>(a.num("eos-id", 2))};
    return std::make_unique<switchyard::rt::TrtllmExecutor>(o);
#else
    throw std::invalid_argument(
        "--engine trtllm: this binary was built without TensorRT-LLM "
        "(configure CMake with -DTRTLLM_ROOT=...)");
#endif
  }
  throw std::invalid_argument("--engine: expected sim or trtllm, got " + engine);
}

void log(const std::string& event, const std::string& fields = "") {
  // One line per event, key=value, on stderr (the Python side's console format).
  std::cerr << "[cpp-worker] " << event << (fields.empty() ? "" : " ") << fields << std::endl;
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
    if (!args.kv.count("port")) throw std::invalid_argument("--port is required");
    grace_s = args.num("grace-s", grace_s);
    log("loading engine", "engine=" + args.get("engine", "sim"));
    executor = make_executor(args);
  } catch (const std::exception& e) {
    std::cerr << "switchyard-cpp-worker: " << e.what() << "\n" << kUsage;
    return 2;
  }
  const std::string address = args.get("host", "127.0.0.1") + ":" + args.get("port", "");

  {
    switchyard::rt::Dispatcher dispatcher(*executor);
    switchyard::rt::WorkerService service(*executor, dispatcher);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int bound_port = 0;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &bound_port);
    // gRPC sets SO_REUSEPORT by default: a second worker on the same port would then listen
    // too, and the kernel would split the connections between them. One port, one worker.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.RegisterService(&service);
    builder.SetMaxReceiveMessageSize(64 * 1024 * 1024);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server || bound_port == 0) {
      std::cerr << "switchyard-cpp-worker: cannot listen on " << address
                << ": port in use (or not permitted)" << std::endl;
      return 1;
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
