"""``picc serve --ray``: replicas of ``picc serve`` on Ray Serve, behind a router that speaks OpenAI.

Two deployments. ``PiccReplica`` (``replicas`` of them, each a Ray actor in its own process) opens
the same ``.pib``, starts the serving engine of ``runtime.engine`` and runs the ASGI application of
``runtime.server`` on each request it is handed: the same OpenAI-compatible routes, streaming,
errors and metrics as one ``picc serve``, and the same tokens (a request runs whole on one replica,
which is exact whatever else it serves). ``PiccRouter`` (one, the ingress behind Ray's HTTP proxy)
hands each request to a replica through a deployment handle -- Ray routes it to the less busy of
two -- and relays the answer, so that a replica's failure still reaches the client as OpenAI's
error object: a 503 with ``Retry-After`` before the answer has started (the ``openai`` client
retries those), an error event in a stream that had (the replica that would have written them is
gone; Ray's proxy alone would answer with its own plain 5xx).

Ray Serve restarts a replica whose process died and asks each for its health
(``PiccReplica.check_health``: a replica whose engine thread has stopped reports itself unhealthy,
and Ray replaces it).

Ray is an optional dependency (``pip install picc[ray]``); nothing here imports it at module load,
so the rest of the runtime never needs it (and ``replica_answer`` is usable without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from runtime.openai_api import ApiError

APP_NAME = "picc"
HEALTH_CHECK_SECONDS = 5.0
"""How often Ray asks a replica for its health (and gives up on it after the same time)."""
RETRY_AFTER_SECONDS = 1
DISCONNECT_SECONDS = 2.0
"""How long a replica's app may take to notice its client left (the server polls every 0.25 s)
and free the sequence, before it is cancelled."""
ROUTER_MAX_ONGOING = 10_000
"""Requests the router relays at once: it only waits on replicas, and Ray caps their share."""
CONTROL_REQUESTS = 8
"""Requests a replica takes beyond its engine's (decoding and waiting ones): room for the routes
that do not generate."""


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """What every replica opens and serves: ``picc serve``'s options for one server."""

    model: str
    threads: int | None = None
    ctx: int | None = None
    gpu: str = "auto"
    max_batch: int | None = None
    max_queue: int | None = None
    api_key: str | None = None
    model_name: str | None = None
    prefix_cache: bool = True
    reasoning_format: str = "auto"  # runtime.reasoning.OPTIONS


@dataclass(frozen=True, slots=True)
class Forwarded:
    """An HTTP request as the router hands it to a replica (headers as ASGI's byte pairs)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


Head = tuple[int, list[tuple[bytes, bytes]]]
"""A response's status and headers: what a replica's answer yields first."""


async def replica_answer(app, request: Forwarded) -> AsyncIterator[Head | bytes]:  # noqa: ANN001 - an ASGI app
    """Run ``app`` on ``request`` in this process: yields the response's status and headers, then its
    body's chunks as the app sends them. Closing the generator early (the router's client went
    away, and Ray cancelled the request) tells the app the client disconnected, as a server would."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
             "root_path": "", "query_string": request.query, "headers": list(request.headers),
             "client": None, "server": None}
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            sent.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=DISCONNECT_SECONDS)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


def build_app(options: ReplicaOptions):  # noqa: ANN201 - (engine, session, ASGI application)
    """In a replica's process, once: open the model, start its engine, make the server's app."""
    from runtime.engine import Engine
    from runtime.reasoning import served_format
    from runtime.server import ServedModel, create_app
    from runtime.session import Session

    session = Session(options.model, options.threads, options.ctx, options.gpu)
    if session.text is None:
        session.close()
        raise ValueError(f"{options.model}: the model has no tokenizer; a server needs one to read and write text")
    engine = Engine(session, options.max_batch, options.max_queue, options.prefix_cache)
    name = options.model_name or Path(options.model).stem
    served = ServedModel(engine, session.text, name, int(Path(options.model).stat().st_mtime), options.api_key,
                         served_format(options.reasoning_format, session.text.chat_template))
    return engine, session, create_app(served)


class PiccReplica:
    """A replica of the server: answers the requests the router hands it."""

    def __init__(self, options: ReplicaOptions) -> None:
        self.engine, self.session, self.app = build_app(options)

    async def __call__(self, request: Forwarded) -> AsyncIterator[Head | bytes]:
        async with contextlib.aclosing(replica_answer(self.app, request)) as answer:
            async for item in answer:
                yield item

    def check_health(self) -> None:
        """Ray Serve's periodic health check: raises when this replica can no longer serve."""
        if not self.engine.alive:
            raise RuntimeError("picc replica: the serving engine has stopped")

    def __del__(self) -> None:
        if hasattr(self, "engine"):  # not when opening the model failed
            self.engine.close()
            self.session.close()


def failure(e: BaseException) -> ApiError:
    """What a client is told when the replica answering its request failed (its process died, or Ray
    could not reach it)."""
    return ApiError(503, f"the replica serving this request failed ({type(e).__name__}); retry",
                    kind="server_error", code="replica_failed", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


async def relay(replicas, request: Forwarded) -> object:  # noqa: ANN001 - a DeploymentHandle; a starlette Response
    """The router's response to ``request``, from a replica's answer: a whole body is gathered
    before it is sent (so a failure anywhere is a clean error object), a stream is passed on as it
    comes."""
    from starlette.responses import JSONResponse, Response, StreamingResponse

    try:
        answer = replicas.remote(request)
        status, headers = await answer.__anext__()
        if not _is_event_stream(headers):
            response = Response(b"".join([chunk async for chunk in answer]), status_code=status)
            response.raw_headers = headers
            return response
    except Exception as e:  # noqa: BLE001 - whatever ended the replica's answer, the client gets an error object
        error = failure(e)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def rest() -> AsyncIterator[bytes]:
        # A client that leaves cancels this request, and Ray cancels the replica's with it (which
        # frees the sequence: ``replica_answer``).
        try:
            async for chunk in answer:
                yield chunk
        except Exception as e:  # noqa: BLE001 - the stream had started: its end is an error event
            yield f"data: {json.dumps(failure(e).body())}\r\n\r\ndata: [DONE]\r\n\r\n".encode()

    response = StreamingResponse(rest(), status_code=status)
    response.raw_headers = headers
    return response


class PiccRouter:
    """The ingress: relays each request to a replica (``replicas``, a deployment handle)."""

    def __init__(self, replicas) -> None:  # noqa: ANN001 - a ray.serve.handle.DeploymentHandle
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request) -> object:  # noqa: ANN001 - starlette Request -> Response
        forwarded = Forwarded(request.method, request.url.path, request.url.query.encode("latin-1"),
                              tuple(request.headers.raw), await request.body())
        return await relay(self.replicas, forwarded)


def application(options: ReplicaOptions, replicas: int = 1, gpus: float = 0.0):  # noqa: ANN201 - serve.Application
    """The Ray Serve application: ``replicas`` replicas of the server, each reserving
    ``options.threads`` CPUs (one if unset) and ``gpus`` GPUs from the cluster, behind the router.

    Ray hands each request to the less busy of two replicas, and hands a replica as many requests
    as its engine takes (decoding and waiting: its engine answers 429 beyond them, as one picc
    serve does) and ``CONTROL_REQUESTS`` more, so that ``/health``, ``/metrics`` and ``/v1/models``
    are answered while it is full."""
    from ray import serve

    from runtime.engine import serving_limits
    from runtime.pib import PibFile

    with PibFile(options.model, verify=False) as pib:
        slots, queue = serving_limits(pib.plan(), options.max_batch, options.max_queue)
    replica = serve.deployment(
        PiccReplica, name="PiccReplica", num_replicas=replicas,
        ray_actor_options={"num_cpus": options.threads or 1, "num_gpus": gpus},
        health_check_period_s=HEALTH_CHECK_SECONDS, health_check_timeout_s=HEALTH_CHECK_SECONDS,
        max_ongoing_requests=slots + queue + CONTROL_REQUESTS)
    router = serve.deployment(PiccRouter, name="PiccRouter", ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=ROUTER_MAX_ONGOING)
    return router.bind(replica.bind(options))


def run(options: ReplicaOptions, *, replicas: int, gpus: float, host: str, port: int,
        address: str | None = None, say=print) -> None:  # noqa: ANN001
    """Start (or join, with ``address``) a Ray cluster, deploy the application on Ray Serve's HTTP
    proxy at ``host:port`` and serve until interrupted; then take the application down."""
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(options, replicas, gpus), name=APP_NAME, route_prefix="/")
        shown = f"[{host}]" if ":" in host else host
        say(f"picc serve: {options.model_name or Path(options.model).stem} on http://{shown}:{port}/v1 "
            f"(Ray Serve, {replicas} replica{'s' if replicas != 1 else ''})")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
