"""Bearer tokens: who may call what, and how fast.

The tokens file (`auth: {tokens_file: FILE}`) is YAML:

```yaml
tokens:
  - name: team-a                 # for logs; never sent back to anyone else
    token: "long random secret"  # or `sha256: <hex>`: the secret's digest only
    scopes: [generate]           # generate: Generation/*; admin: Admin/*
    models: [tiny]               # optional: the only models it may use
    rate_limit: {requests_per_s: 20, tokens_per_s: 20000}   # optional
```

`AuthInterceptor` checks `authorization: Bearer <token>` on every call but health:
UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for a missing scope,
RESOURCE_EXHAUSTED with RetryInfo beyond the token's request rate. The caller is then
`current_caller()` for the servicer (same task as the handler), which checks the
model and charges the token rate. Reflection needs any valid token. Rates hold for the
whole service: with `--routers N` the buckets live in a file that every process maps
(control/fleet/shared_limits.py), found by the token's name and rates, so N processes
together let a token use its rate once.

Tokens are looked up by the SHA-256 of what the caller sent, so the lookup's timing
says nothing about the secrets. `TokenStore.reload()` (on SIGHUP, or when the file
changes) swaps the whole table at once; calls already running keep going; a file that
no longer parses leaves the old table in place, with the error in the log.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
import yaml

from control.api.status import to_rpc_status
from control.config import ConfigError
from control.errors import Overloaded, PermissionDenied, StatusError, Unauthenticated
from control.fleet.shared_limits import Bucket, LimitState, LocalLimits

log = structlog.get_logger(__name__)

SCOPES = ("generate", "admin")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_OPEN_SERVICES = ("/grpc.health.v1.Health/",)
_ANY_TOKEN_SERVICES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.")
_SCOPE_OF = {"/switchyard.v1.Generation/": "generate", "/switchyard.v1.Admin/": "admin"}


class RateLimiter:
    """Token buckets of one token's requests and tokens per second, each holding up to
    one second's worth (and at least one request). A generation takes its prompt plus
    max_tokens when admitted and gets back what it did not generate; the bucket may go
    into debt, and then waits.

    The buckets live in `state`: one of its own by default; with `--routers N`, the
    service's shared state, where every process finds the same buckets by the token's
    `name` and rates."""

    def __init__(
        self,
        requests_per_s: float | None,
        tokens_per_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
        state: LimitState | None = None,
    ) -> None:
        self.requests_per_s = requests_per_s
        self.tokens_per_s = tokens_per_s
        self._clock = clock
        self._state: LimitState = state if state is not None else LocalLimits()
        key = f"{name}\0{requests_per_s!r}\0{tokens_per_s!r}"
        # A request bucket holds at least one request, or a rate under 1/s admits none.
        self._requests = (
            Bucket.of(f"{key}\0requests", requests_per_s, max(1.0, requests_per_s))
            if requests_per_s
            else None
        )
        self._tokens = (
            Bucket.of(f"{key}\0tokens", tokens_per_s, tokens_per_s) if tokens_per_s else None
        )

    def same_rates(self, other: RateLimiter) -> bool:
        return (self.requests_per_s, self.tokens_per_s) == (
            other.requests_per_s,
            other.tokens_per_s,
        )

    def take_request(self) -> float | None:
        """None if the call may go ahead, else the seconds to wait."""
        if self._requests is None:
            return None
        return self._state.take(self._requests, 1, 1, self._clock())

    def take_tokens(self, n: int) -> float | None:
        if self._tokens is None:
            return None
        return self._state.take(self._tokens, n, 0, self._clock())

    def give_back_tokens(self, n: int) -> None:
        if self._tokens is not None and n > 0:
            self._state.give_back(self._tokens, n)


@dataclass(frozen=True, slots=True)
class Caller:
    """A token's grants; `name` is the only thing about it that is ever logged."""

    name: str
    scopes: frozenset[str]
    models: frozenset[str] | None = None  # None: every model
    limiter: RateLimiter | None = None

    def check_model(self, model: str) -> None:
        if self.models is not None and model not in self.models:
            raise PermissionDenied(f"token {self.name!r} may not use model {model!r}")

    def take_tokens(self, n: int) -> None:
        if self.limiter is not None:
            wait = self.limiter.take_tokens(n)
            if wait is not None:
                raise Overloaded(
                    f"token {self.name!r} is over its rate of {self.limiter.tokens_per_s:g} "
                    "tokens per second",
                    wait,
                )

    def give_back_tokens(self, n: int) -> None:
        if self.limiter is not None:
            self.limiter.give_back_tokens(n)


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "switchyard_caller", default=None
)


def current_caller() -> Caller | None:
    """The caller of the RPC being served (None when there is no authentication)."""
    return _CALLER.get()


def parse_tokens(raw: object, where: str, limits: LimitState | None = None) -> dict[str, Caller]:
    """{sha256 of the secret: its Caller}; ConfigError names the entry and key. The
    rate limiters keep their buckets in `limits` (None: each its own)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tokens"), list):
        raise ConfigError(f"{where}: tokens", "expected a mapping with a list 'tokens'")
    out: dict[str, Caller] = {}
    names: set[str] = set()
    for i, t in enumerate(raw["tokens"]):
        key = f"{where}: tokens[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(key, "expected a mapping")
        unknown = set(t) - {"name", "token", "sha256", "scopes", "models", "rate_limit"}
        if unknown:
            raise ConfigError(f"{key}.{sorted(unknown)[0]}", "unknown key")
        name = t.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{key}.name", "expected a unique name")
        names.add(name)
        digest = _digest(t, key)
        if digest in out:
            raise ConfigError(key, f"the same secret as token {out[digest].name!r}")
        scopes = t.get("scopes")
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise ConfigError(f"{key}.scopes", f"expected a list of {', '.join(SCOPES)}")
        models = t.get("models")
        if models is not None and (
            not isinstance(models, list) or not all(isinstance(m, str) for m in models)
        ):
            raise ConfigError(f"{key}.models", "expected a list of model names")
        out[digest] = Caller(
            name=name,
            scopes=frozenset(scopes),
            models=None if models is None else frozenset(models),
            limiter=_limiter(t.get("rate_limit"), f"{key}.rate_limit", name, limits),
        )
    return out


def _digest(t: dict[str, Any], key: str) -> str:
    secret, digest = t.get("token"), t.get("sha256")
    if (secret is None) == (digest is None):
        raise ConfigError(key, "expected one of 'token' or 'sha256'")
    if secret is not None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise ConfigError(f"{key}.token", "expected a secret of at least 16 characters")
        return hashlib.sha256(secret.encode()).hexdigest()
    if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
        raise ConfigError(f"{key}.sha256", "expected 64 hex digits")
    return digest.lower()


def _limiter(raw: object, key: str, name: str, limits: LimitState | None) -> RateLimiter | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"requests_per_s", "tokens_per_s"}:
        raise ConfigError(key, "expected a mapping of requests_per_s and tokens_per_s")
    for name, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{key}.{name}", f"expected a number > 0, got {v!r}")
    return RateLimiter(raw.get("requests_per_s"), raw.get("tokens_per_s"), name=name, state=limits)


class TokenStore:
    """The tokens of one file, reloaded whole; their buckets in `limits` (None: each
    rate limiter its own)."""

    def __init__(self, path: Path, limits: LimitState | None = None) -> None:
        self.path = path
        self.limits = limits
        self._mtime = 0.0
        self._internal: dict[str, Caller] = {}
        self._callers = self._read()  # fails the start when the file is bad

    def _read(self) -> dict[str, Caller]:
        try:
            stat = self.path.stat()
            raw = yaml.safe_load(self.path.read_text())
        except OSError as e:
            raise ConfigError(str(self.path), f"cannot read: {e.strerror}") from e
        except yaml.YAMLError as e:
            raise ConfigError(str(self.path), f"not valid YAML: {e}") from e
        callers = parse_tokens(raw, str(self.path), self.limits)
        self._mtime = stat.st_mtime
        return callers

    def reload(self) -> bool:
        """Read the file again; on an error keep the tokens there were. A token whose
        rates did not change keeps its buckets (a reload is no way to refill them)."""
        try:
            callers = self._read()
        except ConfigError as e:
            log.error("tokens file not reloaded; the previous tokens stay", error=str(e))
            with contextlib.suppress(OSError):  # reported once, not at every poll
                self._mtime = self.path.stat().st_mtime
            return False
        kept = {c.name: c.limiter for c in self._callers.values() if c.limiter is not None}
        for digest, caller in callers.items():
            old = kept.get(caller.name)
            new = caller.limiter
            if old is not None and new is not None and old.same_rates(new):
                callers[digest] = dataclasses.replace(caller, limiter=old)
        self._callers = callers
        log.info("tokens reloaded", path=str(self.path), tokens=len(self._callers))
        return True

    def changed(self) -> bool:
        try:
            return self.path.stat().st_mtime != self._mtime
        except OSError:
            return False

    def lookup(self, secret: str) -> Caller | None:
        digest = hashlib.sha256(secret.encode()).hexdigest()
        return self._callers.get(digest) or self._internal.get(digest)

    def add_internal(self, name: str, secret: str) -> None:
        """A token of the control plane's own (its routers'), kept across reloads."""
        self._internal[hashlib.sha256(secret.encode()).hexdigest()] = Caller(
            name=name, scopes=frozenset(SCOPES)
        )


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """`rate_limits=False` where the calls come through another process that charged
    them already (the supervisor's private port, behind its routers)."""

    def __init__(self, store: TokenStore, rate_limits: bool = True) -> None:
        self._store = store
        self._rate_limits = rate_limits

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        method: str = details.method
        handler = await continuation(details)
        if handler is None or method.startswith(_OPEN_SERVICES):
            return handler
        try:
            caller = self._authenticate(details.invocation_metadata or ())
            if not method.startswith(_ANY_TOKEN_SERVICES):
                scope = next((s for p, s in _SCOPE_OF.items() if method.startswith(p)), "admin")
                if scope not in caller.scopes:
                    raise PermissionDenied(f"token {caller.name!r} lacks the scope {scope!r}")
                if self._rate_limits and caller.limiter is not None:
                    wait = caller.limiter.take_request()
                    if wait is not None:
                        raise Overloaded(
                            f"token {caller.name!r} is over its rate of "
                            f"{caller.limiter.requests_per_s:g} requests per second",
                            wait,
                        )
        except StatusError as e:
            log.info("call refused", method=method, error=str(e))
            return _refusal(handler, e)
        # The handler runs in this task next: it sees the caller.
        _CALLER.set(caller)
        return handler

    def _authenticate(self, metadata: Any) -> Caller:
        value = next((v for k, v in metadata if k == "authorization"), None)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            raise Unauthenticated("missing bearer token (metadata 'authorization: Bearer ...')")
        caller = self._store.lookup(value[len("Bearer ") :].strip())
        if caller is None:
            raise Unauthenticated("unknown or revoked token")
        return caller


def _refusal(handler: Any, err: StatusError) -> Any:
    """A handler of the same kind as `handler` that ends the call with `err`."""
    code, message, trailers = to_rpc_status(err)

    async def refuse(request: Any, context: Any) -> Any:
        await context.abort(code, message, trailing_metadata=trailers)

    async def refuse_stream(request: Any, context: Any) -> Any:
        await context.abort(code, message, trailing_metadata=trailers)
        yield  # an async generator, as streaming handlers are

    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, refuse),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, refuse_stream),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, refuse),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, refuse_stream),
    )
    for attr, make, fn in kinds:
        if getattr(handler, attr) is not None:
            return make(
                fn,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    raise AssertionError("a handler of no kind")
