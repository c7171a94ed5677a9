// switchyard_runtime: the C++ executor interface and the simulator, for Python.
// Tests drive the C++ core in-process; the control plane's fleet simulation runs many
// virtual-clock simulators without processes.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "executor.h"
#include "front/utf8.h"
#include "sim_executor.h"

namespace py = pybind11;
using namespace switchyard::rt;

PYBIND11_MODULE(switchyard_runtime, m) {
  m.doc() = "Switchyard's C++ executor interface and its simulator (SimExecutor is a "
            "simulator for tests and scale runs, not an inference engine).";

  py::enum_<FinishReason>(m, "FinishReason")
      .value("NOT_FINISHED", FinishReason::kNotFinished)
      .value("END_ID", FinishReason::kEndId)
      .value("STOP_WORDS", FinishReason::kStopWords)
      .value("LENGTH", FinishReason::kLength)
      .value("TIMED_OUT", FinishReason::kTimedOut)
      .value("CANCELLED", FinishReason::kCancelled);

  py::class_<SamplingOptions>(m, "SamplingOptions")
      .def(py::init<>())
      .def_readwrite("temperature", &SamplingOptions::temperature)
      .def_readwrite("top_p", &SamplingOptions::top_p)
      .def_readwrite("top_k", &SamplingOptions::top_k)
      .def_readwrite("min_p", &SamplingOptions::min_p)
      .def_readwrite("repetition_penalty", &SamplingOptions::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingOptions::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingOptions::frequency_penalty)
      .def_readwrite("seed", &SamplingOptions::seed)
      .def_readwrite("min_tokens", &SamplingOptions::min_tokens);

  py::class_<GenRequest>(m, "GenRequest")
      .def(py::init([](Tokens prompt, std::int32_t max_tokens, std::optional<std::uint64_t> seed,
                       std::optional<TokenId> end_id, std::vector<Tokens> stop_words,
                       bool streaming, bool return_logprobs,
                       std::optional<std::chrono::milliseconds> allotted_time,
                       std::int32_t priority) {
             GenRequest r;
             r.prompt = std::move(prompt);
             r.max_tokens = max_tokens;
             r.sampling.seed = seed;
             r.end_id = end_id;
             r.stop_words = std::move(stop_words);
             r.streaming = streaming;
             r.return_logprobs = return_logprobs;
             r.allotted_time = allotted_time;
             r.priority = priority;
             return r;
           }),
           py::arg("prompt"), py::arg("max_tokens") = 16, py::kw_only(),
           py::arg("seed") = py::none(), py::arg("end_id") = py::none(),
           py::arg("stop_words") = std::vector<Tokens>{}, py::arg("streaming") = true,
           py::arg("return_logprobs") = false, py::arg("allotted_time") = py::none(),
           py::arg("priority") = 0)
      .def_readwrite("prompt", &GenRequest::prompt)
      .def_readwrite("max_tokens", &GenRequest::max_tokens)
      .def_readwrite("sampling", &GenRequest::sampling)
      .def_readwrite("stop_words", &GenRequest::stop_words)
      .def_readwrite("end_id", &GenRequest::end_id)
      .def_readwrite("streaming", &GenRequest::streaming)
      .def_readwrite("priority", &GenRequest::priority);

  py::class_<GenResponse>(m, "GenResponse")
      .def_readonly("id", &GenResponse::id)
      .def_readonly("tokens", &GenResponse::tokens)
      .def_readonly("logprobs", &GenResponse::logprobs)
      .def_readonly("is_final", &GenResponse::is_final)
      .def_readonly("finish", &GenResponse::finish)
      .def_readonly("error", &GenResponse::error)
      .def_readonly("prompt_tokens", &GenResponse::prompt_tokens)
      .def_readonly("cached_prompt_tokens", &GenResponse::cached_prompt_tokens)
      .def_readonly("queue_ms", &GenResponse::queue_ms);

  py::class_<IterationStats>(m, "IterationStats")
      .def_readonly("iteration", &IterationStats::iteration)
      .def_readonly("active_requests", &IterationStats::active_requests)
      .def_readonly("queued_requests", &IterationStats::queued_requests)
      .def_readonly("kv_blocks_used", &IterationStats::kv_blocks_used)
      .def_readonly("kv_blocks_free", &IterationStats::kv_blocks_free)
      .def_readonly("kv_blocks_max", &IterationStats::kv_blocks_max)
      .def_readonly("tokens_per_block", &IterationStats::tokens_per_block)
      .def_readonly("iteration_ms", &IterationStats::iteration_ms)
      .def_readonly("generated_tokens_total", &IterationStats::generated_tokens_total);

  py::class_<EngineInfo>(m, "EngineInfo")
      .def_readonly("engine", &EngineInfo::engine)
      .def_readonly("engine_version", &EngineInfo::engine_version)
      .def_readonly("model", &EngineInfo::model)
      .def_readonly("max_context", &EngineInfo::max_context)
      .def_readonly("vocab_size", &EngineInfo::vocab_size)
      .def_readonly("eos_token_ids", &EngineInfo::eos_token_ids)
      .def_readonly("tokens_per_block", &EngineInfo::tokens_per_block)
      .def_readonly("tensor_parallel_size", &EngineInfo::tensor_parallel_size)
      .def_readonly("pipeline_parallel_size", &EngineInfo::pipeline_parallel_size)
      .def_readonly("quantization", &EngineInfo::quantization)
      .def_readonly("weight_dtype", &EngineInfo::weight_dtype)
      .def_readonly("kv_cache_dtype", &EngineInfo::kv_cache_dtype)
      .def_readonly("kv_blocks_total", &EngineInfo::kv_blocks_total)
      .def_readonly("max_input_len", &EngineInfo::max_input_len)
      .def_readonly("max_batch_size", &EngineInfo::max_batch_size)
      .def_readonly("max_num_tokens", &EngineInfo::max_num_tokens);

  py::register_exception<InvalidRequest>(m, "InvalidRequest", PyExc_ValueError);

  // KV-cache events: what the engine's prefix cache stored and removed (the fleet
  // simulation feeds them to the routing index, as the worker's SubscribeKvEvents does).
  py::class_<KvCacheEvent>(m, "KvCacheEvent")
      .def_property_readonly("kind",
                             [](const KvCacheEvent& e) {
                               switch (e.kind) {
                                 case KvCacheEvent::Kind::kStored: return "stored";
                                 case KvCacheEvent::Kind::kRemoved: return "removed";
                                 case KvCacheEvent::Kind::kCleared: return "cleared";
                               }
                               return "unknown";
                             })
      .def_readonly("block_hashes", &KvCacheEvent::block_hashes)
      .def_readonly("parent_hash", &KvCacheEvent::parent_hash)
      .def_readonly("tokens", &KvCacheEvent::tokens)
      .def_readonly("block_size", &KvCacheEvent::block_size);

  py::class_<KvCacheEvents>(m, "KvCacheEvents")
      .def_readonly("events", &KvCacheEvents::events)
      .def_readonly("lost", &KvCacheEvents::lost);

  py::class_<Executor>(m, "Executor")
      .def("enqueue", &Executor::enqueue, py::arg("request"))
      .def("await_responses", &Executor::await_responses, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("cancel", &Executor::cancel, py::arg("id"))
      .def("latest_stats", &Executor::latest_stats)
      .def("can_enqueue", &Executor::can_enqueue)
      .def("info", &Executor::info)
      .def("kv_events", &Executor::kv_events)
      .def("take_kv_events", &Executor::take_kv_events, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Executor::shutdown, py::call_guard<py::gil_scoped_release>());

  py::class_<SimConfig>(m, "SimConfig")
      .def(py::init<>())
      .def_readwrite("model", &SimConfig::model)
      .def_readwrite("vocab_size", &SimConfig::vocab_size)
      .def_readwrite("max_context", &SimConfig::max_context)
      .def_readwrite("eos_id", &SimConfig::eos_id)
      .def_readwrite("tokens_per_block", &SimConfig::tokens_per_block)
      .def_readwrite("kv_blocks", &SimConfig::kv_blocks)
      .def_readwrite("max_batch", &SimConfig::max_batch)
      .def_readwrite("prefill_us_per_token", &SimConfig::prefill_us_per_token)
      .def_readwrite("decode_step_us", &SimConfig::decode_step_us)
      .def_readwrite("decode_us_per_request", &SimConfig::decode_us_per_request)
      .def_readwrite("eos_every", &SimConfig::eos_every)
      .def_readwrite("end_id_in_output", &SimConfig::end_id_in_output,
                     "False: TensorRT-LLM's convention, the end id left out of the output")
      .def_readwrite("time_scale", &SimConfig::time_scale)
      .def_readwrite("virtual_clock", &SimConfig::virtual_clock)
      .def_readwrite("prefix_cache_blocks", &SimConfig::prefix_cache_blocks);

  py::class_<SimExecutor, Executor>(m, "SimExecutor")
      .def(py::init<SimConfig>(), py::arg("config"))
      .def("step", &SimExecutor::step, py::call_guard<py::gil_scoped_release>(),
           "Run one iteration now; returns its modeled cost in microseconds.")
      .def("now_us", &SimExecutor::now_us)
      .def_property_readonly("config", &SimExecutor::config)
      .def_static("token_at", &SimExecutor::token_at, py::arg("prompt_hash"), py::arg("seed"),
                  py::arg("position"), py::arg("vocab_size"))
      .def_static("hash_tokens", &SimExecutor::hash_tokens, py::arg("tokens"));

  m.def(
      "utf8_append",
      [](py::bytes pending, py::bytes data) {
        std::string held = pending;
        std::string text;
        switchyard::front::utf8_append(held, std::string(data), text);
        return py::make_tuple(py::bytes(text), py::bytes(held));
      },
      py::arg("pending"), py::arg("data"),
      "The native front's UTF-8 reader (runtime_cpp/src/front/utf8.h): (the text's bytes, "
      "the bytes held back) for `pending` + `data`.");
}
