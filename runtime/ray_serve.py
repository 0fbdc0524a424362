"""``picc serve --ray``: replicas of ``picc serve`` on Ray Serve, behind Ray's HTTP proxy.

Each replica is a Ray actor (its own process) that opens the same ``.pib``, starts the serving
engine of ``runtime.engine`` and answers with the ASGI application of ``runtime.server``: the same
OpenAI-compatible routes, streaming, errors and metrics as one ``picc serve``, and the same tokens
(a request runs whole on one replica, which is exact whatever else it serves). Ray Serve routes
requests among the replicas, restarts one whose process died, and asks each replica for its health
(``PiccReplica.check_health``: a replica whose engine thread has stopped reports itself unhealthy,
and Ray replaces it).

Ray is an optional dependency (``pip install picc[ray]``); nothing here imports it at module load,
so the rest of the runtime never needs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "picc"
HEALTH_CHECK_SECONDS = 5.0
"""How often Ray asks a replica for its health (and gives up on it after the same time)."""


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


_SERVED: dict[str, object] = {}
"""The replica's engine (in the replica's process), for its health checks."""


def build_app(options: ReplicaOptions):  # noqa: ANN201 - an ASGI application (FastAPI)
    """In a replica's process, once: open the model, start its engine, return the server's app."""
    from runtime.engine import Engine
    from runtime.sequences import gpu_kv_caches
    from runtime.server import ServedModel, create_app
    from runtime.session import Session

    session = Session(options.model, options.threads, options.ctx, options.gpu)
    if session.text is None:
        session.close()
        raise ValueError(f"{options.model}: the model has no tokenizer; a server needs one to read and write text")
    max_batch = options.max_batch or (1 if gpu_kv_caches(session.executor) else 8)
    engine = Engine(session, max_batch, options.max_queue)
    name = options.model_name or Path(options.model).stem
    served = ServedModel(engine, session.text, name, int(Path(options.model).stat().st_mtime), options.api_key)
    _SERVED["engine"], _SERVED["session"] = engine, session
    return create_app(served)


class PiccReplica:
    """A replica of the server (the ingress deployment's class; its HTTP side is ``build_app``'s)."""

    def check_health(self) -> None:
        """Ray Serve's periodic health check: raises when this replica can no longer serve."""
        engine = _SERVED.get("engine")
        if engine is None or not engine.alive:  # type: ignore[attr-defined]
            raise RuntimeError("picc replica: the serving engine has stopped")

    def __del__(self) -> None:
        engine, session = _SERVED.pop("engine", None), _SERVED.pop("session", None)
        if engine is not None:
            engine.close()  # type: ignore[attr-defined]
        if session is not None:
            session.close()  # type: ignore[attr-defined]


def application(options: ReplicaOptions, replicas: int = 1, gpus: float = 0.0):  # noqa: ANN201 - serve.Application
    """The Ray Serve application: ``replicas`` replicas of the server, each reserving
    ``options.threads`` CPUs (one if unset) and ``gpus`` GPUs from the cluster."""
    from ray import serve

    def builder():  # noqa: ANN202 - a function, as Ray Serve wants an app builder to be (not a partial)
        return build_app(options)

    ingress = serve.ingress(builder)(PiccReplica)
    deployment = serve.deployment(
        ingress, name=APP_NAME, num_replicas=replicas,
        ray_actor_options={"num_cpus": options.threads or 1, "num_gpus": gpus},
        health_check_period_s=HEALTH_CHECK_SECONDS, health_check_timeout_s=HEALTH_CHECK_SECONDS,
        # Enough requests in flight per replica for its engine to batch and queue them itself
        # (its own queue answers 429 when full, as one picc serve does).
        max_ongoing_requests=4 * (options.max_batch or 8) + (options.max_queue or 4 * (options.max_batch or 8)))
    return deployment.bind()


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
