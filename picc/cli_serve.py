"""``picc serve``: a compiled model behind an OpenAI-compatible HTTP API (``runtime.server``), on
uvicorn. The socket is bound here first, so that a port in use is a one-line error and ``--port
0`` can say which port it got."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from picc.cli_runtime import add_gpu_flag, add_reasoning_flag, add_threads_flag, open_session
from picc.errors import PiccError


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve", help="serve a compiled .pib over an OpenAI-compatible HTTP API",
        description="Serve MODEL.pib over HTTP: POST /v1/completions and /v1/chat/completions (streaming "
        "with \"stream\": true), GET /v1/models, /health and /metrics (Prometheus). Up to --max-batch "
        "requests decode at once, each with its own KV cache, and each gets exactly the tokens 'picc run' "
        "would give it (greedy, or sampling with the request's seed), whatever else is being served. "
        "Chat requests use the chat template the model's tokenizer carries.")
    s.add_argument("model", metavar="MODEL.pib")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed at start)")
    s.add_argument("--max-batch", type=int,
                   help="sequences decoded at once, each with its own KV cache of --ctx positions (default 8; 1 "
                   "for a model whose KV caches live on the GPU); refused at start when their caches do not fit "
                   "in memory")
    s.add_argument("--max-queue", type=int,
                   help="requests that may wait for a free sequence before the server answers 429 "
                   "(default: 4 x --max-batch)")
    s.add_argument("--ctx", type=int, help="positions per sequence (default: what the model was compiled for)")
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt whole (default: a prompt takes the KV cache rows it shares with the "
                   "start of one run before, a system prompt or a chat's earlier turns, where they are the rows it "
                   "would compute; the tokens are the same either way)")
    add_threads_flag(s)
    s.add_argument("--api-key", default=os.environ.get("PICC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every /v1 request (default: $PICC_API_KEY; "
                   "unset: no key)")
    s.add_argument("--model-name", help="the model's id in the API (default: the file's name without .pib)")
    add_reasoning_flag(s, "a chat reply's thoughts come apart from its answer: in message.reasoning_content "
                       "(streamed: delta.reasoning_content chunks, before the answer's delta.content ones), as "
                       "llama.cpp's and vLLM's servers give them; none: the reply whole in content, thoughts and "
                       "tags included. Completions are always the raw text")
    add_gpu_flag(s)
    ray = s.add_argument_group("Ray Serve", "serve replicas of this server on a Ray cluster (pip install -e '.[ray]'; "
                               "docs/ray.md)")
    ray.add_argument("--ray", action="store_true",
                     help="run --replicas replicas of the server on Ray Serve, behind Ray's HTTP proxy at "
                     "--host:--port (a local Ray cluster unless --ray-address names one)")
    # Their defaults are None so that one given without --ray can be told apart (and refused).
    ray.add_argument("--replicas", type=int, help="with --ray: replicas, each on --threads CPUs (default 1)")
    ray.add_argument("--ray-address", help="with --ray: the cluster to join ('auto': the one 'ray start' began here)")
    ray.add_argument("--gpus-per-replica", type=float,
                     help="with --ray: GPUs each replica reserves (default 0; 1 for a model compiled with a GPU part)")
    s.set_defaults(func=cmd_serve)


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise PiccError(f"--port {port}: expected 0 to 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PiccError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise PiccError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from runtime.cpu import ExecutorError
    from runtime.engine import Engine
    from runtime.reasoning import served_format
    from runtime.server import ServedModel, create_app

    if (args.max_batch is not None and args.max_batch < 1) or (args.max_queue is not None and args.max_queue < 0):
        raise PiccError("--max-batch must be >= 1 and --max-queue >= 0")
    if args.ray:
        return _serve_on_ray(args)
    ray_only = [flag for flag, value in (("--replicas", args.replicas), ("--ray-address", args.ray_address),
                                         ("--gpus-per-replica", args.gpus_per_replica)) if value is not None]
    if ray_only:
        raise PiccError(f"{ray_only[0]} is for --ray: without it one server runs in this process")
    sock = _bind(args.host, args.port)
    with open_session(args.model, args.threads, args.ctx, args.gpu) as session:
        if session.text is None:
            raise PiccError(f"{args.model}: the model has no tokenizer; a server needs one to read and write text")
        try:
            engine = Engine(session, args.max_batch, args.max_queue, args.prefix_cache)
        except ExecutorError as e:
            raise PiccError(str(e)) from None
        try:
            name = args.model_name or Path(args.model).stem
            reasoning = served_format(args.reasoning_format, session.text.chat_template)
            served = ServedModel(engine, session.text, name, int(Path(args.model).stat().st_mtime), args.api_key,
                                 reasoning)
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"picc serve: {name} on http://{shown}:{port}/v1 (max-batch {engine.max_batch}, ctx {session.ctx}, "
                  f"{session.executor.cpu.team.nthreads} threads, {engine.rows_per_step} "
                  f"sequence{'s' if engine.rows_per_step != 1 else ''} per step"
                  f"{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
            if session.text.sampling:  # a request's own fields win
                print("picc serve: the model's sampling defaults (generation_config.json) for requests that leave "
                      "them out: " + ", ".join(f"{k} {v:g}" for k, v in session.text.sampling.items()),
                      file=sys.stderr, flush=True)
            if reasoning is not None:
                print(f"picc serve: chat replies' thoughts in reasoning_content, apart from the answer (the chat "
                      f"template's {reasoning} format; --reasoning-format none keeps replies whole)",
                      file=sys.stderr, flush=True)
            config = uvicorn.Config(create_app(served), log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5)
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            engine.close()
            sock.close()


def _serve_on_ray(args: argparse.Namespace) -> None:
    args.replicas = 1 if args.replicas is None else args.replicas
    args.gpus_per_replica = 0.0 if args.gpus_per_replica is None else args.gpus_per_replica
    if args.replicas < 1 or not 0 <= args.gpus_per_replica < float("inf"):
        raise PiccError("--replicas must be >= 1 and --gpus-per-replica >= 0")
    if args.port == 0:
        raise PiccError("--port 0: Ray's HTTP proxy needs a fixed port")
    if not Path(args.model).is_file() or Path(args.model).suffix != ".pib":
        raise PiccError(f"{args.model}: expected a .pib file written by 'picc compile'")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise PiccError("--ray needs Ray Serve: pip install -e '.[ray]' (from picc's checkout)") from None
    from runtime.ray_serve import ReplicaOptions, run
    options = ReplicaOptions(str(Path(args.model).resolve()), args.threads, args.ctx, args.gpu, args.max_batch,
                             args.max_queue, args.api_key, args.model_name or Path(args.model).stem,
                             args.prefix_cache, args.reasoning_format)
    run(options, replicas=args.replicas, gpus=args.gpus_per_replica, host=args.host, port=args.port,
        address=args.ray_address, say=lambda line: print(line, file=sys.stderr, flush=True))
