"""Transport security and tokens, as a caller meets them: mutual TLS on the public port
(with a CA the test makes), bearer tokens with scopes, models and rates from a tokens
file that is reloaded on change and on SIGHUP, open health, message size limits, and
reflection and Admin switched off."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control.fleet.local_workers import free_port
from tests.pki import Pki, make_pki
from tests.procs import Proc, start_process, wait_serving

GEN = "gen-secret-0123456789abcdef"
ADMIN = "admin-secret-0123456789abcdef"
SLOW = "slow-secret-0123456789abcdef"
LATER = "later-secret-0123456789abcdef"


def tokens_yaml(*extra: str) -> str:
    return (
        "tokens:\n"
        "  - {name: team-gen, token: " + GEN + ", scopes: [generate], models: [sim]}\n"
        "  - {name: team-ops, sha256: " + hashlib.sha256(ADMIN.encode()).hexdigest() + ", "
        "scopes: [admin, generate]}\n"
        "  - {name: team-slow, token: " + SLOW + ", scopes: [generate], "
        "rate_limit: {requests_per_s: 0.5}}\n" + "".join(extra)
    )


SIM = (
    "  - name: {name}\n"
    "    engine: sim\n"
    "    model: builtin:tiny\n"
    "    engine_args: {{decode_step_us: 2000}}\n"
)


@dataclass
class Secured:
    proc: Proc
    pki: Pki
    tokens: Path
    health: str  # the plaintext health-only address

    def channel(self, cert: bytes | None = None, key: bytes | None = None) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.pki.ca,
            private_key=self.pki.client_key if key is None else key,
            certificate_chain=self.pki.client_cert if cert is None else cert,
        )
        return grpc.secure_channel(self.proc.address, creds)


def secured_config(tmp: Path, pki: Pki, tls_extra: str, rest: str) -> tuple[Path, int, Path]:
    """(tokens file, port, config) of a control plane with TLS and tokens."""
    tokens = tmp / "tokens.yaml"
    tokens.write_text(tokens_yaml())
    port = free_port()
    config = tmp / "secured.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\n"
        f"tls: {{cert: {pki.server_cert}, key: {pki.server_key}{tls_extra}}}\n"
        f"auth: {{tokens_file: {tokens}}}\n" + rest
    )
    return tokens, port, config


@pytest.fixture(scope="module", params=["python", "native"])
def secured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    """The secured control plane, once with each api.front: the same promises on both."""
    tmp = tmp_path_factory.mktemp(f"secured-{request.param}")
    pki = make_pki(tmp)
    health = f"127.0.0.1:{free_port()}"
    tokens, port, config = secured_config(
        tmp,
        pki,
        f", client_ca: {pki.ca_file}",
        f"health: {{listen: {health}}}\n"
        f"api: {{max_message_bytes: 65536, front: {request.param}}}\n"
        + "models:\n"
        + SIM.format(name="sim")
        + SIM.format(name="sim-b"),
    )
    proc = start_process(["-m", "control", "serve", "--config", str(config)], port, tmp, "ctl")
    s = Secured(proc, pki, tokens, health)
    creds = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_cert)
    try:
        wait_serving(proc, "sim-b", timeout=120, credentials=creds)
        yield s
    finally:
        assert proc.stop() == 0, proc.log_tail()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def request(
    model: str = "sim", max_tokens: int = 4, text: str = "Hello"
) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model=model,
        text=text,
        stopping=generation_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def refused(call: object, *args: object, **kw: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kw)  # type: ignore[operator]
    return e.value


def test_mutual_tls_needs_a_client_certificate_the_ca_signed(secured: Secured) -> None:
    with secured.channel() as ch:
        out = generation_pb2_grpc.GenerationStub(ch).Complete(
            request(), timeout=30, metadata=bearer(GEN)
        )
        assert out.final.usage.completion_tokens == 4
    with secured.channel(secured.pki.rogue_cert, secured.pki.rogue_key) as ch:
        err = refused(generation_pb2_grpc.GenerationStub(ch).Complete, request(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=secured.pki.ca)
    with grpc.secure_channel(secured.proc.address, no_cert) as ch:
        err = refused(generation_pb2_grpc.GenerationStub(ch).Complete, request(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secured.proc.address) as ch:  # plaintext: no
        err = refused(generation_pb2_grpc.GenerationStub(ch).Complete, request(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_tokens_scopes_and_models(secured: Secured) -> None:
    with secured.channel() as ch:
        gen = generation_pb2_grpc.GenerationStub(ch)
        admin = admin_pb2_grpc.AdminStub(ch)
        err = refused(gen.Complete, request(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer" in (err.details() or "")
        err = refused(gen.Complete, request(), timeout=10, metadata=bearer("not-a-token-at-all!!"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not any(n in (err.details() or "") for n in ("team-", GEN, ADMIN))
        err = refused(
            admin.ListWorkers, admin_pb2.ListWorkersRequest(), timeout=10, metadata=bearer(GEN)
        )
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in (err.details() or "") and "team-ops" not in (err.details() or "")
        err = refused(gen.Complete, request("sim-b"), timeout=10, metadata=bearer(GEN))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "sim-b" in (err.details() or "")
        models = gen.ListModels(
            generation_pb2.ListModelsRequest(), timeout=10, metadata=bearer(GEN)
        )
        assert [m.name for m in models.models] == ["sim"]
        # A token with both scopes, stored as its digest only.
        workers = admin.ListWorkers(
            admin_pb2.ListWorkersRequest(), timeout=10, metadata=bearer(ADMIN)
        )
        assert {w.model for w in workers.workers} == {"sim", "sim-b"}
        out = gen.Complete(request("sim-b"), timeout=30, metadata=bearer(ADMIN))
        assert out.final.usage.completion_tokens == 4
        # Health stays open for probes.
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="sim"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_probes_get_health_in_plaintext_on_their_own_port_and_nothing_else(
    secured: Secured,
) -> None:
    with grpc.insecure_channel(secured.health) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "sim", ""):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING, service
        err = refused(
            generation_pb2_grpc.GenerationStub(ch).Complete,
            request(),
            timeout=10,
            metadata=bearer(GEN),
        )
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_token_over_its_rate_hears_resource_exhausted_with_retry_info(secured: Secured) -> None:
    with secured.channel() as ch:
        gen = generation_pb2_grpc.GenerationStub(ch)
        gen.Complete(request(), timeout=30, metadata=bearer(SLOW))
        err = refused(gen.Complete, request(), timeout=10, metadata=bearer(SLOW))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    retry = error_details_pb2.RetryInfo()
    assert status is not None and any(d.Unpack(retry) for d in status.details)
    assert 0 < retry.retry_delay.ToMilliseconds() <= 2000


def test_a_message_over_the_limit_is_refused_clearly(secured: Secured) -> None:
    with secured.channel() as ch:
        gen = generation_pb2_grpc.GenerationStub(ch)
        err = refused(gen.Complete, request(text="x" * 100_000), timeout=10, metadata=bearer(GEN))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "65536" in (err.details() or "")


def _works(ch: grpc.Channel, token: str) -> bool:
    try:
        generation_pb2_grpc.GenerationStub(ch).Tokenize(
            generation_pb2.TokenizeRequest(model="sim", text="hi"),
            timeout=10,
            metadata=bearer(token),
        )
        return True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED
        return False


def _until(condition: object, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_the_tokens_file_reloads_on_change_and_on_sighup_without_dropping_streams(
    secured: Secured,
) -> None:
    with secured.channel() as ch:
        gen = generation_pb2_grpc.GenerationStub(ch)
        assert not _works(ch, LATER)
        # A stream that runs across both reloads, on a token that the second one revokes.
        stream = gen.Generate(request(max_tokens=1500), timeout=60, metadata=bearer(GEN))
        assert next(stream).chunk.token_ids
        # 1. The file changes: the new token works within the poll interval.
        secured.tokens.write_text(
            tokens_yaml("  - {name: later, token: " + LATER + ", scopes: [generate]}\n")
        )
        _until(lambda: _works(ch, LATER), "the changed tokens file was not reloaded")
        # 2. SIGHUP: team-gen revoked; the file's mtime put back, so only the signal tells.
        stat = secured.tokens.stat()
        revoked = secured.tokens.with_suffix(".new")
        revoked.write_text(
            tokens_yaml("  - {name: later, token: " + LATER + ", scopes: [generate]}\n").replace(
                "  - {name: team-gen, token: " + GEN + ", scopes: [generate], models: [sim]}\n", ""
            )
        )
        os.utime(revoked, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        os.replace(revoked, secured.tokens)  # at once, with the old mtime
        assert _works(ch, GEN)
        os.kill(secured.proc.popen.pid, signal.SIGHUP)
        _until(lambda: not _works(ch, GEN), "SIGHUP did not reload the tokens file")
        # A file that does not parse leaves the tokens as they were.
        secured.tokens.write_text("tokens: [{name: broken}]\n")
        os.kill(secured.proc.popen.pid, signal.SIGHUP)
        _until(
            lambda: "tokens file not reloaded" in secured.proc.log_path.read_text(),
            "no error for the broken file",
        )
        assert _works(ch, LATER)
        # The stream begun before either reload ran to its end.
        final = next(m for m in stream if m.HasField("final")).final
        assert final.usage.completion_tokens == 1500


def test_reflection_and_admin_can_be_switched_off(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "closed.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\napi: {{reflection: false, admin: false}}\n"
        "models:\n" + SIM.format(name="sim")
    )
    proc = start_process(["-m", "control", "serve", "--config", str(config)], port, tmp_path, "c")
    try:
        wait_serving(proc, "sim", timeout=120)
        with grpc.insecure_channel(proc.address) as ch:
            err = refused(
                admin_pb2_grpc.AdminStub(ch).ListWorkers, admin_pb2.ListWorkersRequest(), timeout=10
            )
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED
            reflect = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            err = refused(lambda: list(reflect))
            assert err.code() == grpc.StatusCode.UNIMPLEMENTED
            out = generation_pb2_grpc.GenerationStub(ch).Complete(request(), timeout=30)
            assert out.final.usage.completion_tokens == 4
    finally:
        assert proc.stop() == 0, proc.log_tail()


def test_router_processes_serve_tls_and_check_tokens_too(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    _, port, config = secured_config(tmp_path, pki, "", "models:\n" + SIM.format(name="sim"))
    argv = ["-m", "control", "serve", "--config", str(config), "--routers", "2"]
    proc = start_process(argv, port, tmp_path, "routed")
    creds = grpc.ssl_channel_credentials(root_certificates=pki.ca)
    try:
        wait_serving(proc, "sim", timeout=120, credentials=creds)
        # Separate connections, as separate clients: the kernel spreads them over both.
        channels = [
            grpc.secure_channel(
                proc.address, creds, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            for _ in range(12)
        ]
        try:
            for ch in channels:
                gen = generation_pb2_grpc.GenerationStub(ch)
                assert gen.Complete(request(), timeout=30, metadata=bearer(GEN)).final.usage
                err = refused(gen.Complete, request(), timeout=10)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
                # Admin on a router goes to the supervisor with the caller's token.
                admin = admin_pb2_grpc.AdminStub(ch)
                listed = admin.ListWorkers(
                    admin_pb2.ListWorkersRequest(), timeout=10, metadata=bearer(ADMIN)
                )
                assert [w.model for w in listed.workers] == ["sim"]
                err = refused(
                    admin.ListWorkers,
                    admin_pb2.ListWorkersRequest(),
                    timeout=10,
                    metadata=bearer(GEN),
                )
                assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        finally:
            for ch in channels:
                ch.close()
        # The router follows the supervisor's drains with a token of its own.
        assert "supervisor unreachable" not in proc.log_path.read_text()
    finally:
        assert proc.stop() == 0, proc.log_tail()
