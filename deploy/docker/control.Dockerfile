# The Switchyard control plane: Python only (no C++ worker, no engine).
#
#   docker build -f deploy/docker/control.Dockerfile -t switchyard-control .
#   docker run -p 50051:50051 -v $PWD/switchyard.yaml:/etc/switchyard/switchyard.yaml \
#       switchyard-control serve --config /etc/switchyard/switchyard.yaml
FROM python:3.11-slim

COPY . /src/switchyard
# The gRPC stubs are generated at build time (grpcio-tools, a build requirement).
RUN pip install --no-cache-dir "/src/switchyard" -C cmake.define.SWITCHYARD_BUILD_CPP=OFF \
    && rm -rf /src/switchyard

RUN useradd --create-home --uid 10001 switchyard
USER 10001
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s \
  CMD ["switchyard", "health", "--address", "127.0.0.1:50051"]
ENTRYPOINT ["switchyard"]
CMD ["serve", "--config", "/etc/switchyard/switchyard.yaml"]
