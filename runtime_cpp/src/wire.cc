#include "wire.h"

#include <grpcpp/impl/codegen/proto_utils.h>  // GenericSerialize, GenericDeserialize

#include <utility>

#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "worker_log.h"

namespace switchyard::rt {
namespace {

// `message` as the status's, `description` as its one violation's, on `field`.
grpc::Status bad_request(grpc::StatusCode code, const std::string& message,
                         const std::string& field, const std::string& description) {
  google::rpc::BadRequest bad;
  auto* v = bad.add_field_violations();
  v->set_field(field);
  v->set_description(description);
  google::rpc::Status status;
  status.set_code(static_cast<int>(code));
  status.set_message(message);
  status.add_details()->PackFrom(bad);
  return grpc::Status(code, message, status.SerializeAsString());
}

class FinishedWriter final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit FinishedWriter(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::Status field_status(grpc::StatusCode code, const std::string& field,
                          const std::string& message) {
  return bad_request(code, field + ": " + message, field, message);
}

grpc::Status invalid_argument(const std::string& field, const std::string& message) {
  return field_status(grpc::StatusCode::INVALID_ARGUMENT, field, message);
}

grpc::Status malformed_status(const std::string& type_name, std::size_t bytes) {
  const std::string message = "request body is not a valid encoding of " + type_name + " (" +
                              std::to_string(bytes) + " bytes)";
  return bad_request(grpc::StatusCode::INVALID_ARGUMENT, message, "request", message);
}

bool parse(const grpc::ByteBuffer& body, Message* out) {
  if (!body.Valid()) return false;
  grpc::ByteBuffer copy(body);  // shares the slices; the reader consumes the copy
  return grpc::GenericDeserialize<grpc::ProtoBufferReader, Message>(&copy, out).ok();
}

grpc::Status parse_request(grpc::CallbackServerContext* context, const char* method,
                           const grpc::ByteBuffer& body, Message* out) {
  if (parse(body, out)) return grpc::Status::OK;
  if (!body.Valid()) {  // no message at all: the client half-closed first
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the call ended before its " + out->GetTypeName());
  }
  const std::size_t bytes = body.Length();
  log("malformed request", std::string("method=") + method + " peer=" + context->peer() +
                               " bytes=" + std::to_string(bytes));
  return malformed_status(out->GetTypeName(), bytes);
}

bool parse_unary(grpc::CallbackServerContext* context, const char* method,
                 const grpc::ByteBuffer& body, Message* out, grpc::ServerUnaryReactor* reactor) {
  auto status = parse_request(context, method, body, out);
  if (status.ok()) return true;
  reactor->Finish(std::move(status));
  return false;
}

grpc::Status serialize(const Message& message, grpc::ByteBuffer* out) {
  out->Clear();  // the writer wants an empty buffer
  bool own = false;
  return grpc::GenericSerialize<grpc::ProtoBufferWriter, Message>(message, out, &own);
}

void finish_unary(grpc::ServerUnaryReactor* reactor, const Message& reply,
                  grpc::ByteBuffer* response) {
  reactor->Finish(serialize(reply, response));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* finished_writer(grpc::Status status) {
  return new FinishedWriter(std::move(status));
}

}  // namespace switchyard::rt
