# The vLLM worker, on vLLM's official image (vLLM and torch come from it; the worker is
# installed beside them without touching them).
#
#   docker build -f deploy/docker/vllm-worker.Dockerfile \
#       --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.11.0 -t switchyard-vllm-worker .
#   docker run --gpus all -p 7001:7001 -v /models:/models switchyard-vllm-worker \
#       --model /models/llama-8b --host 0.0.0.0 --port 7001
ARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0
FROM ${VLLM_IMAGE}

COPY . /src/switchyard
RUN pip install --no-cache-dir "/src/switchyard" -C cmake.define.SWITCHYARD_BUILD_CPP=OFF \
    && rm -rf /src/switchyard

RUN useradd --create-home --uid 10001 switchyard
USER 10001
EXPOSE 7001
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
  CMD ["switchyard", "health", "--address", "127.0.0.1:7001"]
ENTRYPOINT ["switchyard-pyworker"]
CMD ["--model", "/models/model", "--host", "0.0.0.0", "--port", "7001"]
