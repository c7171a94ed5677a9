// Request bodies that are not a valid encoding of their message, sent as raw bytes over
// real gRPC: every method answers INVALID_ARGUMENT naming the type, with a BadRequest on
// the field `request`; on GenerateStream such a message fails that stream alone.
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>  // what generated stubs call
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "wire.h"
#include "worker_fixture.h"

namespace switchyard::rt {
namespace {

using namespace switchyard::rt::test_support;  // NOLINT: the shared fixture
using grpc::internal::RpcMethod;
using Bytes = grpc::ByteBuffer;

// A truncated varint where a field tag belongs: no protobuf message parses it.
const std::string kGarbage = "\xff\xff\xff\xff\xff\xff\xff";

Bytes bytes(const std::string& s) {
  grpc::Slice slice(s);
  return Bytes(&slice, 1);
}

Bytes encoded(const Message& m) {
  Bytes b;
  EXPECT_TRUE(serialize(m, &b).ok());
  return b;
}

std::string method(const std::string& name) { return "/switchyard.worker.v1.Worker/" + name; }

// The call a generated stub makes, with bytes for messages.
grpc::Status unary(grpc::Channel* channel, const std::string& name, const Bytes& request,
                   Bytes* response) {
  grpc::ClientContext ctx;
  const std::string path = method(name);  // RpcMethod keeps the pointer
  const RpcMethod m(path.c_str(), RpcMethod::NORMAL_RPC);
  return grpc::internal::BlockingUnaryCall(channel, m, &ctx, request, response);
}

grpc::Status server_streaming(grpc::Channel* channel, const std::string& name,
                              const Bytes& request) {
  grpc::ClientContext ctx;
  const std::string path = method(name);
  const RpcMethod m(path.c_str(), RpcMethod::SERVER_STREAMING);
  std::unique_ptr<grpc::ClientReader<Bytes>> reader(
      grpc::internal::ClientReaderFactory<Bytes>::Create(channel, m, &ctx, request));
  Bytes msg;
  while (reader->Read(&msg)) {
  }
  return reader->Finish();
}

using RawStream = grpc::ClientReaderWriter<Bytes, Bytes>;

std::unique_ptr<RawStream> raw_stream(grpc::Channel* channel, grpc::ClientContext* ctx) {
  static const std::string path = method("GenerateStream");
  const RpcMethod m(path.c_str(), RpcMethod::BIDI_STREAMING);
  return std::unique_ptr<RawStream>(
      grpc::internal::ClientReaderWriterFactory<Bytes, Bytes>::Create(channel, m, ctx));
}

// INVALID_ARGUMENT, the message naming `type` and the size, the same as a BadRequest
// violation of the field `request`.
void expect_malformed(const grpc::Status& status, const std::string& type, std::size_t size) {
  const std::string message = "request body is not a valid encoding of switchyard.worker.v1." +
                              type + " (" + std::to_string(size) + " bytes)";
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << type;
  EXPECT_EQ(status.error_message(), message);
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(status.error_details())) << type;
  EXPECT_EQ(details.code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  ASSERT_EQ(details.details_size(), 1) << type;
  google::rpc::BadRequest bad;
  ASSERT_TRUE(details.details(0).UnpackTo(&bad)) << type;
  ASSERT_EQ(bad.field_violations_size(), 1) << type;
  EXPECT_EQ(bad.field_violations(0).field(), "request");
  EXPECT_EQ(bad.field_violations(0).description(), message);
}

TEST_F(WorkerServiceTest, MalformedGetInfoIsInvalidArgumentNamingTheTypeAndLoggedOnce) {
  start(config());
  Bytes response;
  ::testing::internal::CaptureStderr();
  const auto status = unary(channel_.get(), "GetInfo", bytes(kGarbage), &response);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  expect_malformed(status, "GetInfoRequest", 7);
  const std::string line = "[cpp-worker] malformed request method=" + method("GetInfo") +
                           " peer=ipv4:127.0.0.1:";
  ASSERT_NE(logged.find(line), std::string::npos) << logged;
  EXPECT_EQ(logged.find(line, logged.find(line) + 1), std::string::npos) << "logged twice";
  EXPECT_NE(logged.find(" bytes=7\n"), std::string::npos) << logged;
  // An empty body is a valid (empty) message.
  ASSERT_TRUE(unary(channel_.get(), "GetInfo", bytes(""), &response).ok());
  wv1::GetInfoResponse info;
  ASSERT_TRUE(parse(response, &info));
  EXPECT_EQ(info.engine(), "sim");
}

TEST_F(WorkerServiceTest, EveryMethodAnswersAMalformedBodyInvalidArgument) {
  start(config());
  const auto garbage = bytes(kGarbage);
  for (const auto& [name, type] : std::vector<std::pair<std::string, std::string>>{
           {"Abort", "AbortRequest"},
           {"GetInfo", "GetInfoRequest"},
           {"LoadAdapter", "LoadAdapterRequest"},
           {"UnloadAdapter", "UnloadAdapterRequest"}}) {
    Bytes response;
    expect_malformed(unary(channel_.get(), name, garbage, &response), type, kGarbage.size());
  }
  for (const auto& [name, type] : std::vector<std::pair<std::string, std::string>>{
           {"Generate", "GenerateRequest"},
           {"StreamLoad", "StreamLoadRequest"},
           {"SubscribeKvEvents", "SubscribeKvEventsRequest"}}) {
    expect_malformed(server_streaming(channel_.get(), name, garbage), type, kGarbage.size());
  }
  grpc::ClientContext ctx;
  auto stream = raw_stream(channel_.get(), &ctx);
  ASSERT_TRUE(stream->Write(garbage));
  Bytes msg;
  EXPECT_FALSE(stream->Read(&msg));
  expect_malformed(stream->Finish(), "StreamRequest", kGarbage.size());
  EXPECT_EQ(engine_->enqueues.load(), 0);
  // Well-formed calls still work, raw or typed.
  wv1::AbortRequest abort;
  abort.add_request_ids("nobody");
  Bytes response;
  ASSERT_TRUE(unary(channel_.get(), "Abort", encoded(abort), &response).ok());
  wv1::AbortResponse aborted;
  ASSERT_TRUE(parse(response, &aborted));
  EXPECT_EQ(aborted.aborted(), 0u);
  grpc::ClientContext gen_ctx;
  EXPECT_EQ(read_all(&gen_ctx, gen(20)).tokens.size(), 20u);
}

// A stream whose second message does not parse ends INVALID_ARGUMENT, its request in
// flight cancelled (once); another stream and a Generate call carry on to their finals.
TEST_F(WorkerServiceTest, GenerateStreamMalformedMessageFailsThatStreamAlone) {
  start(config(1000));
  grpc::ClientContext bad_ctx;
  auto bad = raw_stream(channel_.get(), &bad_ctx);
  wv1::StreamRequest first;
  *first.add_start() = attempt(1, 5000, "doomed");
  ASSERT_TRUE(bad->Write(encoded(first)));
  Bytes msg;
  ASSERT_TRUE(bad->Read(&msg));  // its first tokens: the request runs
  wv1::StreamResponse response;
  ASSERT_TRUE(parse(msg, &response));
  ASSERT_GT(response.events_size(), 0);
  EXPECT_EQ(response.events(0).attempt_id(), 1u);

  grpc::ClientContext good_ctx;
  auto good = stub_->GenerateStream(&good_ctx);
  wv1::StreamRequest other;
  *other.add_start() = attempt(1, 300, "fine");
  ASSERT_TRUE(good->Write(other));
  wv1::StreamResponse good_msg;
  ASSERT_TRUE(good->Read(&good_msg));
  grpc::ClientContext gen_ctx;
  auto reader = stub_->Generate(&gen_ctx, gen(300, "unary"));
  wv1::GenerateResponse gen_msg;
  ASSERT_TRUE(reader->Read(&gen_msg));
  EXPECT_TRUE(eventually([&] { return running() == 3; }));

  ASSERT_TRUE(bad->Write(bytes(kGarbage)));
  while (bad->Read(&msg)) {
  }
  expect_malformed(bad->Finish(), "StreamRequest", kGarbage.size());
  EXPECT_TRUE(eventually([&] { return running() == 2; }));
  EXPECT_EQ(engine_->cancels.load(), 1);

  std::size_t tokens = static_cast<std::size_t>(good_msg.events(0).chunk().token_ids_size());
  bool final = false;
  while (!final && good->Read(&good_msg)) {
    for (const auto& e : good_msg.events()) {
      tokens += static_cast<std::size_t>(e.chunk().token_ids_size());
      final = final || e.has_final();
    }
  }
  ASSERT_TRUE(final);
  EXPECT_EQ(tokens, 300u);
  good->WritesDone();
  EXPECT_TRUE(good->Finish().ok());
  std::size_t gen_tokens = static_cast<std::size_t>(gen_msg.chunk().token_ids_size());
  while (reader->Read(&gen_msg)) {
    gen_tokens += static_cast<std::size_t>(gen_msg.chunk().token_ids_size());
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(gen_tokens, 300u);
  EXPECT_TRUE(eventually([&] { return idle(); }));
  EXPECT_EQ(engine_->cancels.load(), 1);
}

// A call that ends before its request message arrived (the client half-closed first).
TEST_F(WorkerServiceTest, CallEndedBeforeItsRequestIsInvalidArgument) {
  start(config());
  for (const std::string name : {"GetInfo", "Generate"}) {
    grpc::ClientContext ctx;
    const std::string path = method(name);
    const RpcMethod m(path.c_str(), RpcMethod::BIDI_STREAMING);  // lets the client send none
    std::unique_ptr<RawStream> call(
        grpc::internal::ClientReaderWriterFactory<Bytes, Bytes>::Create(channel_.get(), m, &ctx));
    ASSERT_TRUE(call->WritesDone());
    Bytes msg;
    EXPECT_FALSE(call->Read(&msg));
    const auto status = call->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << name;
    EXPECT_EQ(status.error_message(),
              "the call ended before its switchyard.worker.v1." + name + "Request");
  }
  EXPECT_EQ(engine_->enqueues.load(), 0);
}

}  // namespace
}  // namespace switchyard::rt
