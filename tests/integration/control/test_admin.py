"""switchyard.v1.Admin: load and unload models at run time while others keep serving;
list and drain workers; DNS discovery of workers."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from tests.integration.conformance.conftest import start_cpp_worker
from tests.integration.control.test_faults import serve, sim_model
from tests.procs import Proc


def spec(name: str, replicas: int = 1, **engine_args: float) -> admin_pb2.ModelSpec:
    args = struct_pb2.Struct()
    args.update({"decode_step_us": 1000, **engine_args})
    return admin_pb2.ModelSpec(
        name=name, engine="sim", model="builtin:tiny", replicas=replicas, engine_args=args
    )


def complete(stub: generation_pb2_grpc.GenerationStub, model: str, n: int = 5) -> str:
    out = stub.Complete(
        generation_pb2.GenerateRequest(
            model=model,
            text="Hello",
            stopping=generation_pb2.StoppingParams(max_tokens=n, ignore_eos=True),
        ),
        timeout=30,
    )
    assert out.final.usage.completion_tokens == n
    return str(out.final.worker)


class Traffic:
    """Steady requests to one model on a thread; counts failures."""

    def __init__(self, address: str, model: str) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, model))
        self._thread.start()

    def _run(self, address: str, model: str) -> None:
        with grpc.insecure_channel(address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            while not self._stop.is_set():
                try:
                    complete(stub, model, 10)
                    self.ok += 1
                except grpc.RpcError as e:
                    self.failed.append(f"{e.code()}: {e.details()}")  # type: ignore[attr-defined]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_load_and_unload_at_run_time_while_others_serve(tmp_path: Path) -> None:
    ctl = serve(tmp_path, sim_model(replicas=1))
    try:
        with grpc.insecure_channel(ctl.address) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            gen = generation_pb2_grpc.GenerationStub(ch)
            traffic = Traffic(ctl.address, "sim")
            try:
                loaded = admin.LoadModel(
                    admin_pb2.LoadModelRequest(spec=spec("extra", 2)), timeout=60
                )
                assert loaded.name == "extra" and len(loaded.workers) == 2
                assert all(w.routable and w.local for w in loaded.workers)
                complete(gen, "extra")
                names = {m.name for m in gen.ListModels(generation_pb2.ListModelsRequest()).models}
                assert names == {"sim", "extra"}
                listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5).workers
                assert Counter(w.model for w in listed) == {"sim": 1, "extra": 2}
                assert all(w.engine.startswith("sim ") and w.circuit == "closed" for w in listed)

                # Unload while a long stream runs on it: the stream finishes first.
                long_call = gen.Generate(
                    generation_pb2.GenerateRequest(
                        model="extra",
                        text="long",
                        stopping=generation_pb2.StoppingParams(max_tokens=300, ignore_eos=True),
                    ),
                    timeout=30,
                )
                assert next(long_call).HasField("chunk")
                unloaded = admin.UnloadModel(admin_pb2.UnloadModelRequest(name="extra"), timeout=60)
                assert unloaded.drained_requests == 1 and unloaded.cancelled_requests == 0
                rest = list(long_call)
                assert rest[-1].final.usage.completion_tokens == 300
                with pytest.raises(grpc.RpcError) as info:
                    complete(gen, "extra")
                assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
            finally:
                traffic.stop()
            assert traffic.ok > 10
            assert traffic.failed == []  # the other model never noticed

            # Errors name what is wrong.
            with pytest.raises(grpc.RpcError) as info:
                admin.LoadModel(admin_pb2.LoadModelRequest(spec=spec("sim")), timeout=10)
            assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
            bad = spec("bad")
            bad.engine = "vlm"
            with pytest.raises(grpc.RpcError) as info:
                admin.LoadModel(admin_pb2.LoadModelRequest(spec=bad), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
            assert "spec.engine" in info.value.details()  # type: ignore[attr-defined]
            with pytest.raises(grpc.RpcError) as info:
                admin.UnloadModel(admin_pb2.UnloadModelRequest(name="nope"), timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    finally:
        assert ctl.stop() == 0, ctl.log_tail()


def test_drain_worker_takes_it_out_of_routing(tmp_path: Path) -> None:
    ctl = serve(tmp_path, sim_model(replicas=2))
    try:
        with grpc.insecure_channel(ctl.address) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            gen = generation_pb2_grpc.GenerationStub(ch)
            victim = complete(gen, "sim")
            drained = admin.DrainWorker(admin_pb2.DrainWorkerRequest(address=victim), timeout=30)
            assert drained.worker.draining and not drained.worker.routable
            assert drained.in_flight_left == 0
            assert {complete(gen, "sim") for _ in range(10)} == {
                w.address
                for w in admin.ListWorkers(admin_pb2.ListWorkersRequest()).workers
                if w.address != victim
            }
    finally:
        assert ctl.stop() == 0, ctl.log_tail()


def test_dns_discovery_joins_every_address_behind_a_name(tmp_path: Path) -> None:
    worker: Proc = start_cpp_worker(tmp_path)
    try:
        port = worker.address.rpartition(":")[2]
        model = (
            "  - name: dns\n"
            "    engine: sim\n"
            "    model: builtin:tiny\n"
            f"    discovery: {{dns: 'localhost:{port}', interval_s: 0.5}}\n"
        )
        ctl = serve(tmp_path, model, name="dns")
        try:
            with grpc.insecure_channel(ctl.address) as ch:
                gen = generation_pb2_grpc.GenerationStub(ch)
                assert complete(gen, "dns") == f"127.0.0.1:{port}"
        finally:
            assert ctl.stop() == 0, ctl.log_tail()
    finally:
        worker.stop()
