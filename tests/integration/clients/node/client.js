// A Node.js caller of switchyard.v1.Generation with @grpc/grpc-js and @grpc/proto-loader:
// it streams a generation, reads the details of a typed error (google.rpc.BadRequest in
// the grpc-status-details-bin trailer) and cancels a stream mid-way.
// Usage: node client.js ADDRESS PROTO_DIR GOOGLEAPIS_PROTO_DIR MODEL [TOKEN]
// With SWITCHYARD_CA set to a PEM file, over TLS trusting that CA.
// Prints one JSON object with what it saw.
'use strict';
const fs = require('fs');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const [address, protoDir, googleDir, model, token] = process.argv.slice(2);

const definition = protoLoader.loadSync('switchyard/v1/generation.proto', {
  includeDirs: [protoDir],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const pkg = grpc.loadPackageDefinition(definition);
const credentials = process.env.SWITCHYARD_CA
  ? grpc.credentials.createSsl(fs.readFileSync(process.env.SWITCHYARD_CA))
  : grpc.credentials.createInsecure();
const client = new pkg.switchyard.v1.Generation(address, credentials);

const rpcRoot = new protobuf.Root();
rpcRoot.resolvePath = (_origin, target) => path.join(googleDir, target);
rpcRoot.loadSync(['google/rpc/status.proto', 'google/rpc/error_details.proto']);
const Status = rpcRoot.lookupType('google.rpc.Status');

function metadata() {
  const md = new grpc.Metadata();
  if (token) md.add('authorization', `Bearer ${token}`);
  return md;
}

function request(maxTokens, extra) {
  return Object.assign(
    { model, text: 'Hello', stopping: { max_tokens: maxTokens, ignore_eos: true } },
    extra || {},
  );
}

function stream() {
  return new Promise((resolve, reject) => {
    const out = { chunks: 0, tokens: 0, text: '', final: null };
    const call = client.Generate(request(8), metadata());
    call.on('data', (msg) => {
      if (msg.chunk) {
        out.chunks += 1;
        out.tokens += msg.chunk.token_ids.length;
        out.text += msg.chunk.text;
      } else {
        out.final = {
          finish_reason: msg.final.finish_reason,
          completion_tokens: msg.final.usage.completion_tokens,
        };
      }
    });
    call.on('error', reject);
    call.on('end', () => resolve(out));
  });
}

function typedError() {
  return new Promise((resolve) => {
    client.Complete(request(4, { sampling: { temperature: -1 } }), metadata(), (err) => {
      const out = { code: err ? err.code : 0, violations: [] };
      const raw = err && err.metadata.get('grpc-status-details-bin')[0];
      if (raw) {
        const status = Status.decode(raw);
        for (const any of status.details) {
          const name = any.type_url.split('/').pop();
          const type = rpcRoot.lookupType(name);
          const detail = type.decode(any.value);
          if (name === 'google.rpc.BadRequest') {
            for (const v of detail.fieldViolations) out.violations.push(v.field);
          }
        }
      }
      resolve(out);
    });
  });
}

function cancelMidStream() {
  return new Promise((resolve) => {
    const out = { chunks_before_cancel: 0, code: null };
    const call = client.Generate(request(1500), metadata());
    call.on('data', () => {
      out.chunks_before_cancel += 1;
      if (out.chunks_before_cancel === 1) call.cancel();
    });
    call.on('error', (err) => {
      out.code = err.code;
      resolve(out);
    });
    call.on('end', () => resolve(out));
  });
}

(async () => {
  const result = {
    stream: await stream(),
    error: await typedError(),
    cancel: await cancelMidStream(),
  };
  console.log(JSON.stringify(result));
  client.close();
})().catch((err) => {
  console.error(err);
  process.exit(1);
});
