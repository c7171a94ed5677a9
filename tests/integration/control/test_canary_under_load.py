"""The canary of a saturated simulated worker behind a real control plane: it times out behind
the worker's load, yet the engine is generating, so the worker stays in (the canary's
rules on their own: tests/unit/control/workers/test_health.py)."""

from __future__ import annotations

from pathlib import Path

import grpc
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from tests.procs import serving_control


def test_a_saturated_worker_is_not_ejected_for_canaries_queued_behind_its_load(
    tmp_path: Path,
) -> None:
    """One simulated worker, two requests at a time, eight sent, 2 s each pair: the canary
    waits behind six and times out again and again, yet the engine is generating, so the
    worker stays in, and every stream completes (before, two such canaries between two
    finished requests ejected it, and its streams had nowhere to go)."""
    models = (
        "  - name: sim\n    engine: sim\n    model: builtin:tiny\n"
        "    engine_args: {max_batch: 2, decode_step_us: 20000}\n"
        "    health: {canary_interval_s: 0.2, canary_timeout_s: 0.5, failure_threshold: 2}\n"
    )
    with serving_control(tmp_path, models, "sim") as proc:
        with grpc.insecure_channel(proc.address) as ch:
            gen = generation_pb2_grpc.GenerationStub(ch)
            req = generation_pb2.GenerateRequest(
                model="sim",
                text="Hello",
                stopping=generation_pb2.StoppingParams(max_tokens=100, ignore_eos=True),
            )
            futures = [gen.Complete.future(req, timeout=60) for _ in range(8)]
            done = [f.result() for f in futures]
            (w,) = (
                admin_pb2_grpc.AdminStub(ch)
                .ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
                .workers
            )
        log = proc.log_path.read_text()
    assert [d.final.usage.completion_tokens for d in done] == [100] * 8
    assert w.routable and w.circuit == "closed", w
    assert "worker ejected" not in log and "circuit open" not in log
