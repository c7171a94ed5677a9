// Raw calls: every Worker method takes and gives grpc::ByteBuffer, and parses its request
// itself. A body that is not a valid encoding of its message is answered INVALID_ARGUMENT
// naming the type (grpc++ answers it UNIMPLEMENTED, saying nothing), and logged once with
// the caller's address. Responses are serialized here into a ByteBuffer that the reactor
// keeps until the write is done; grpc++ would serialize them the same way.
#pragma once

#include <google/protobuf/message_lite.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/status.h>

#include <cstddef>
#include <string>

namespace switchyard::rt {

using Message = ::google::protobuf::MessageLite;

// A google.rpc.Status with one BadRequest field violation, as gRPC error details.
grpc::Status field_status(grpc::StatusCode code, const std::string& field,
                          const std::string& message);
grpc::Status invalid_argument(const std::string& field, const std::string& message);

// INVALID_ARGUMENT, "request body is not a valid encoding of <type_name> (<bytes> bytes)",
// the same as a BadRequest violation of the field `request`.
grpc::Status malformed_status(const std::string& type_name, std::size_t bytes);

// False when `body` is not a valid encoding of out's type (or there is no body).
bool parse(const grpc::ByteBuffer& body, Message* out);

// Parses a request (or a stream's next message) of `method` ("/package.Service/Name") into
// `out`; when it does not parse, logs that once and returns the status to end the call with.
grpc::Status parse_request(grpc::CallbackServerContext* context, const char* method,
                           const grpc::ByteBuffer& body, Message* out);
// The same for a unary call: false once `reactor` has finished the call with that status.
bool parse_unary(grpc::CallbackServerContext* context, const char* method,
                 const grpc::ByteBuffer& body, Message* out, grpc::ServerUnaryReactor* reactor);

// Replaces what `out` held with `message`; INTERNAL only past protobuf's 2 GiB.
grpc::Status serialize(const Message& message, grpc::ByteBuffer* out);

// Finishes a raw unary call: OK, with `reply` serialized into its `response` first.
void finish_unary(grpc::ServerUnaryReactor* reactor, const Message& reply,
                  grpc::ByteBuffer* response);

// A server-streaming call's reactor that writes nothing and ends with `status`.
grpc::ServerWriteReactor<grpc::ByteBuffer>* finished_writer(grpc::Status status);

}  // namespace switchyard::rt
