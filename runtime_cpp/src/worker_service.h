// switchyard.worker.v1.Worker over the grpc++ callback API.
//
// Generate: one ServerWriteReactor per stream, exactly one write in flight; tokens that
// arrive while a write is pending are coalesced into the next message, so a slow client
// never blocks the engine or other streams; before that, tokens are held back to the
// request's stream_interval (ChunkCadence). OnCancel cancels the executor request at once;
// a stream that ends any other way before its request did cancels it too, once.
//
// Every method is raw (grpc::ByteBuffer in and out, see wire.h): a request that does not
// parse is answered INVALID_ARGUMENT naming its message type.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "adapters.h"
#include "dispatcher.h"
#include "executor.h"
#include "kv_events_stream.h"
#include "switchyard/worker/v1/worker.grpc.pb.h"
#include "wire.h"

namespace switchyard::rt {

namespace wv1 = ::switchyard::worker::v1;

// A StreamLoad call, ticked by the service's ticker thread.
class LoadStream {
 public:
  virtual ~LoadStream() = default;
  virtual void tick(std::chrono::steady_clock::time_point now) = 0;
};

// Worker::Service with all eight methods raw.
using RawWorkerService = wv1::Worker::WithRawCallbackMethod_Generate<
    wv1::Worker::WithRawCallbackMethod_GenerateStream<wv1::Worker::WithRawCallbackMethod_Abort<
        wv1::Worker::WithRawCallbackMethod_GetInfo<wv1::Worker::WithRawCallbackMethod_StreamLoad<
            wv1::Worker::WithRawCallbackMethod_LoadAdapter<
                wv1::Worker::WithRawCallbackMethod_UnloadAdapter<
                    wv1::Worker::WithRawCallbackMethod_SubscribeKvEvents<
                        wv1::Worker::Service>>>>>>>>;

class WorkerService final : public RawWorkerService {
 public:
  using Bytes = grpc::ByteBuffer;

  WorkerService(Executor& executor, Dispatcher& dispatcher);
  ~WorkerService() override;  // stops and joins the ticker

  // Each parses its request message itself and serializes what it answers (wire.h).
  grpc::ServerWriteReactor<Bytes>* Generate(grpc::CallbackServerContext* context,
                                            const Bytes* request) override;
  grpc::ServerBidiReactor<Bytes, Bytes>* GenerateStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const Bytes* request,
                                  Bytes* response) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* context, const Bytes* request,
                                    Bytes* response) override;
  grpc::ServerWriteReactor<Bytes>* StreamLoad(grpc::CallbackServerContext* context,
                                              const Bytes* request) override;
  grpc::ServerUnaryReactor* LoadAdapter(grpc::CallbackServerContext* context,
                                        const Bytes* request, Bytes* response) override;
  grpc::ServerUnaryReactor* UnloadAdapter(grpc::CallbackServerContext* context,
                                          const Bytes* request, Bytes* response) override;
  grpc::ServerWriteReactor<Bytes>* SubscribeKvEvents(grpc::CallbackServerContext* context,
                                                     const Bytes* request) override;

  // Fills a load report from the executor's latest iteration and the streams in flight.
  void fill_load(wv1::LoadReport* report);
  // From now on, new Generate calls are refused with UNAVAILABLE.
  void start_drain() { draining_.store(true); }
  // Generate streams not yet done (their last message may still be on its way), plus
  // requests in flight on GenerateStream sessions.
  int live_streams() const { return live_streams_.load(); }
  void remove_load_stream(LoadStream* stream);

 private:
  Executor& executor_;
  Dispatcher& dispatcher_;
  const EngineInfo info_;
  AdapterRegistry adapters_;
  // LoadAdapter and UnloadAdapter block (reading weights, waiting for requests): each runs
  // on a thread of its own, joined when the service goes.
  void run_off_thread(std::function<void()> work);
  struct AdminThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex admin_mu_;
  std::vector<AdminThread> admin_threads_;  // finished ones are joined at the next call
  std::atomic<bool> draining_{false};
  std::atomic<int> live_streams_{0};
  void ticker();
  std::mutex load_mu_;
  std::vector<std::shared_ptr<LoadStream>> load_streams_;
  std::atomic<bool> stop_ticker_{false};
  std::mutex rate_mu_;  // tokens/s over windows of at least 0.5 s
  std::chrono::steady_clock::time_point rate_at_{};
  std::uint64_t rate_tokens_ = 0;
  double rate_ = 0;
  KvEventHub kv_hub_;   // its pump thread reads the executor's KV-cache events
  std::thread ticker_;  // last: starts once everything above exists
};

}  // namespace switchyard::rt
