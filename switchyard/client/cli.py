"""The `switchyard` commands that call a running service, on `switchyard.client`.

Every command takes the connection options: `--address`, `--token` (or
SWITCHYARD_TOKEN), `--tls` with `--ca`, `--cert` and `--key` for TLS and mutual TLS,
and `--timeout`. A failure prints its status, message and the fields it names, and exits
1. Long admin actions (load, unload, drain) show a progress line while they run.

`control/cli.py` (the `switchyard` entry point, whose own command is `serve`) adds these
commands to its parser and hands them here; like the rest of `switchyard.client`, this
module imports nothing of the control plane, the worker or `switchyard_common`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from switchyard.client import Client, SwitchyardError, Tls

T = TypeVar("T")

# Where `switchyard serve` listens by default (control.config.DEFAULT_LISTEN; a test
# holds the two equal, as the client package imports nothing of the server's).
DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_commands(sub: Any) -> None:
    """The client commands, on the `switchyard` parser's subparsers."""
    conn = argparse.ArgumentParser(add_help=False)
    c = conn.add_argument_group("connection")
    c.add_argument("--address", default=DEFAULT_ADDRESS, help="host:port of the service")
    c.add_argument(
        "--token",
        default=os.environ.get("SWITCHYARD_TOKEN"),
        help="bearer token (default: $SWITCHYARD_TOKEN)",
    )
    c.add_argument("--tls", action="store_true", help="TLS (the system's roots, or --ca)")
    c.add_argument("--ca", help="CA certificate (PEM) to trust; implies --tls")
    c.add_argument("--cert", help="client certificate (PEM), for mutual TLS; implies --tls")
    c.add_argument("--key", help="client key (PEM), for mutual TLS")
    c.add_argument("--timeout", type=float, default=None, help="deadline in seconds")

    gen = argparse.ArgumentParser(add_help=False)
    gen.add_argument("prompt")
    gen.add_argument("--model", default="tiny")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--traceparent", help="W3C trace context to continue")
    so = gen.add_argument_group("structured output (at most one)")
    so.add_argument("--json-schema", metavar="FILE", help="a JSON Schema file the output obeys")
    so.add_argument("--json-object", action="store_true", help="any JSON object")
    so.add_argument("--regex", help="a regular expression the whole output matches")
    so.add_argument("--choice", action="append", help="one of these strings (repeat it)")
    so.add_argument("--grammar", metavar="FILE", help="an EBNF or Lark grammar file")
    gen.add_argument("--adapter", default="", help="a LoRA adapter loaded on the model")
    gen.add_argument("--beam-width", type=int, help="beam search with this many beams")

    sub.add_parser("generate", parents=[gen, conn], help="stream a generation to the terminal")
    sub.add_parser("complete", parents=[gen, conn], help="print a whole generation at once")
    t = sub.add_parser("tokenize", parents=[conn], help="token ids (and pieces) of a text")
    t.add_argument("text")
    t.add_argument("--model", default="tiny")
    sub.add_parser("models", parents=[conn], help="list the served models")
    w = sub.add_parser("workers", parents=[conn], help="list the workers and their state")
    w.add_argument("--model", default="")
    w.add_argument("--json", action="store_true", help="one JSON object per worker")
    ld = sub.add_parser("load", parents=[conn], help="load a model (start or join its workers)")
    ld.add_argument("name")
    ld.add_argument("--engine", required=True, choices=("vllm", "trtllm", "sim"))
    ld.add_argument("--model-path", dest="model_path", required=True, help="dir or builtin:tiny")
    ld.add_argument("--tokenizer", default="")
    ld.add_argument("--replicas", type=int, default=1)
    ld.add_argument("--engine-args", default="{}", help="a JSON object")
    ld.add_argument("--worker", action="append", default=[], help="a running worker's address")
    ld.add_argument("--routing", default="")
    ld.add_argument(
        "--gpus", default="", help="CUDA_VISIBLE_DEVICES of its workers, split over replicas"
    )
    u = sub.add_parser("unload", parents=[conn], help="drain and stop a model's workers")
    u.add_argument("name")
    u.add_argument("--grace", type=float, default=None, help="seconds to let requests finish")
    h = sub.add_parser(
        "health", parents=[conn], help="grpc.health.v1 status; exit 0 when SERVING (a probe)"
    )
    h.add_argument("--service", default="", help="a model's name, or empty for the server")
    d = sub.add_parser("drain", parents=[conn], help="drain one worker (no new requests)")
    d.add_argument("address_", metavar="worker")
    d.add_argument("--grace", type=float, default=None)
    a = sub.add_parser("adapters", parents=[conn], help="list the LoRA adapters of the models")
    a.add_argument("--model", default="")
    al = sub.add_parser(
        "adapter-load", parents=[conn], help="load a LoRA adapter on every worker of a model"
    )
    al.add_argument("model_")
    al.add_argument("name")
    al.add_argument("path", help="the adapter's directory, as the workers see it")
    au = sub.add_parser(
        "adapter-unload", parents=[conn], help="unload a LoRA adapter once its requests end"
    )
    au.add_argument("model_")
    au.add_argument("name")
    au.add_argument("--grace", type=float, default=None, help="seconds to let requests finish")


def run(args: argparse.Namespace) -> int:
    tls: Tls | bool = False
    if args.ca or args.cert:
        tls = Tls(ca=args.ca, cert=args.cert, key=args.key)
    elif args.tls:
        tls = True
    try:
        with Client(args.address, token=args.token, tls=tls, timeout=args.timeout) as client:
            name = f"_{args.command.replace('-', '_')}"
            handler: Callable[[Client, argparse.Namespace], int] = globals()[name]
            return handler(client, args)
    except SwitchyardError as e:
        print(f"\nswitchyard: {e}", file=sys.stderr)
        for v in e.violations:
            print(f"  {v.field}: {v.description}", file=sys.stderr)
        if e.retry_after_s is not None:
            print(f"  retry after {e.retry_after_s:g} s", file=sys.stderr)
        return 1


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {"max_tokens": args.max_tokens, "stop": args.stop}
    if args.ignore_eos:
        opts["ignore_eos"] = True
    for name in ("temperature", "top_p", "top_k", "seed", "regex", "choice"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.json_object:
        opts["json_object"] = True
    if args.adapter:
        opts["adapter"] = args.adapter
    if args.beam_width is not None:
        opts["beam_width"] = args.beam_width
    for name in ("json_schema", "grammar"):  # files
        if getattr(args, name) is not None:
            opts[name] = Path(getattr(args, name)).read_text()
    given = [k for k in ("json_schema", "json_object", "regex", "choice", "grammar") if k in opts]
    if len(given) > 1:
        raise SystemExit(f"switchyard: give one structured-output option, not {', '.join(given)}")
    return opts


def _summary(final: Any) -> str:
    return (
        f"[{final.finish_reason.upper()}] {final.usage.completion_tokens} tokens, "
        f"TTFT {final.timing.time_to_first_token_ms:.1f} ms, "
        f"total {final.timing.total_ms:.1f} ms, {final.engine} at {final.worker}"
    )


def _generate(client: Client, args: argparse.Namespace) -> int:
    with client.generate(
        args.model, args.prompt, traceparent=args.traceparent, **_options(args)
    ) as stream:
        index = 0
        for chunk in stream:
            if chunk.index != index:  # the next beam (beam search)
                index = chunk.index
                sys.stdout.write(f"\n[{index}] ")
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if stream.final is not None:
        print(f"\n{_summary(stream.final)}", file=sys.stderr)
    return 0


def _complete(client: Client, args: argparse.Namespace) -> int:
    out = client.complete(args.model, args.prompt, traceparent=args.traceparent, **_options(args))
    if not out.choices:
        print(out.text)
    for c in out.choices:  # every beam, best first
        score = c.final.cumulative_logprob
        print(f"[{c.index}]" + (f" ({score:.3f})" if score is not None else "") + f" {c.text}")
    print(_summary(out.final), file=sys.stderr)
    return 0


def _tokenize(client: Client, args: argparse.Namespace) -> int:
    out = client.tokenize(args.model, args.text)
    print(" ".join(str(i) for i in out.token_ids))
    print(" ".join(repr(t) for t in out.tokens), file=sys.stderr)
    return 0


def _models(client: Client, args: argparse.Namespace) -> int:
    for m in client.models():
        print(
            f"{m.name}\t{m.engine}\tcontext {m.max_context}\t"
            f"{m.healthy_workers}/{m.workers} workers healthy"
        )
    return 0


def _workers(client: Client, args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    for w in client.workers(args.model):
        if args.json:
            print(json.dumps(MessageToDict(w, preserving_proto_field_name=True)))
            continue
        state = "draining" if w.draining else ("serving" if w.serving else "not serving")
        shape = f"tp {w.tensor_parallel_size or 1} x pp {w.pipeline_parallel_size or 1}"
        if w.gpus:
            shape += f" on GPUs {','.join(w.gpus)}"
        print(
            f"{w.model}\t{w.address}\t{w.engine}\t{state}, circuit {w.circuit}\t"
            f"running {w.running}, waiting {w.waiting}, in flight {w.in_flight}\t{shape}"
        )
    return 0


def _load(client: Client, args: argparse.Namespace) -> int:
    from switchyard.v1 import admin_pb2

    spec = admin_pb2.ModelSpec(
        name=args.name,
        engine=args.engine,
        model=args.model_path,
        tokenizer=args.tokenizer,
        replicas=args.replicas,
        workers=args.worker,
        routing=args.routing,
        gpus=[g.strip() for g in args.gpus.split(",") if g.strip()],
    )
    try:
        spec.engine_args.update(json.loads(args.engine_args))
    except (ValueError, TypeError) as e:
        print(f"switchyard: --engine-args: expected a JSON object ({e})", file=sys.stderr)
        return 2
    out = _with_progress(f"loading {args.name}", lambda: client.load_model(spec))
    print(f"{out.name}: {len(out.workers)} workers serving after {out.load_seconds:.1f} s")
    return 0


def _unload(client: Client, args: argparse.Namespace) -> int:
    out = _with_progress(
        f"unloading {args.name}", lambda: client.unload_model(args.name, grace_s=args.grace)
    )
    print(
        f"{args.name}: unloaded ({out.drained_requests} requests drained, "
        f"{out.cancelled_requests} cancelled)"
    )
    return 0


def _drain(client: Client, args: argparse.Namespace) -> int:
    out = _with_progress(
        f"draining {args.address_}", lambda: client.drain(args.address_, grace_s=args.grace)
    )
    print(f"{out.worker.address}: drained ({out.in_flight_left} requests left in flight)")
    return 0


def _adapters(client: Client, args: argparse.Namespace) -> int:
    for a in client.adapters(args.model):
        print(f"{a.model}/{a.name}: rank {a.rank}, {a.path}, on {', '.join(a.workers) or 'none'}")
    return 0


def _adapter_load(client: Client, args: argparse.Namespace) -> int:
    out = _with_progress(
        f"loading adapter {args.name}",
        lambda: client.load_adapter(args.model_, args.name, args.path),
    )
    a = out.adapter
    print(
        f"{a.model}/{a.name}: rank {a.rank} on {len(a.workers)} workers ({out.load_seconds:.1f} s)"
    )
    return 0


def _adapter_unload(client: Client, args: argparse.Namespace) -> int:
    out = _with_progress(
        f"unloading adapter {args.name}",
        lambda: client.unload_adapter(args.model_, args.name, grace_s=args.grace),
    )
    print(
        f"{args.model_}/{args.name}: unloaded ({out.drained_requests} requests drained, "
        f"{out.cancelled_requests} cancelled)"
    )
    return 0


def _health(client: Client, args: argparse.Namespace) -> int:
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def _with_progress(label: str, call: Callable[[], T]) -> T:
    """Run `call`, showing `label` and the seconds so far on stderr meanwhile: one line
    redrawn on a terminal, a line every 10 s otherwise."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(call())
        except BaseException as e:
            error.append(e)

    worker = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    worker.start()
    tty = sys.stderr.isatty()
    if not tty:
        print(f"{label} ...", file=sys.stderr, flush=True)
    last = 0.0
    while worker.is_alive():
        worker.join(0.5)
        elapsed = time.monotonic() - started
        if tty:
            sys.stderr.write(f"\r{label} ... {elapsed:.0f} s")
            sys.stderr.flush()
        elif elapsed - last >= 10:
            print(f"{label} ... {elapsed:.0f} s", file=sys.stderr, flush=True)
            last = elapsed
    outcome = "failed" if error else "done"
    end = "\r" if tty else ""
    print(f"{end}{label} ... {outcome} in {time.monotonic() - started:.1f} s", file=sys.stderr)
    if error:
        raise error[0]
    return result[0]
