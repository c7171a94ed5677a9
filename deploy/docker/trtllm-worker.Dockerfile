# The C++ worker on TensorRT-LLM, on NVIDIA's TensorRT-LLM release image.
#
# This cannot be built on Switchyard's development and CI machines: they have no GPU,
# and their network reaches only PyPI, Debian and npm, not NVIDIA's registry. It is the
# recipe for a GPU host; there the adapter is compiled and linked for real. Pick a release
# of the 1.0-1.2 line, which still ships the engine-based C++ executor.
#
#   docker build -f deploy/docker/trtllm-worker.Dockerfile --build-arg TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.1.0 -t switchyard-trtllm .
#   docker run --gpus all -v /engines:/engines -p 7001:7001 switchyard-trtllm \
#       --engine trtllm --model /engines/llama-8b --host 0.0.0.0 --port 7001 \
#       --max-context 8192 --vocab-size 128256 --eos-id 128001
ARG TRTLLM_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.1.0
FROM ${TRTLLM_IMAGE}

RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config libgrpc++-dev libprotobuf-dev \
      protobuf-compiler protobuf-compiler-grpc libgtest-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src/switchyard
COPY . .
# The tensorrt_llm Python package carries the C++ headers and libtensorrt_llm.so.
RUN TRTLLM_ROOT=$(python3 -c "import os, tensorrt_llm; print(os.path.dirname(tensorrt_llm.__file__))") \
    && pip install --no-cache-dir . -C cmake.define.TRTLLM_ROOT="$TRTLLM_ROOT"

RUN useradd --create-home --uid 10001 switchyard
USER 10001
EXPOSE 7001
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["switchyard", "health", "--address", "127.0.0.1:7001"]
ENTRYPOINT ["switchyard-cpp-worker"]
