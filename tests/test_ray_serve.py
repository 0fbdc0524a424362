"""``picc serve --ray``: two replicas of the server on a local Ray cluster (loopback only, started
and stopped here), spoken to through Ray Serve's HTTP proxy with the official ``openai`` client.

A separate suite (marker ``ray``, run with ``pytest -m ray``; Ray from ``pip install picc[ray]``):
starting Ray and its replicas takes ~30 s on a 2-core machine. What it shows: ``picc serve``'s own
client tests (tests/test_server.py: completions, chat, streams and concurrent requests equal to a
session alone, stop strings, every error object) pass through the deployment; a full replica
answers 429; clients that leave free their sequences; and a replica killed under load is replaced
by Ray while the other keeps answering, the requests it took with it ending in OpenAI error
objects (a 503, or an error event in a stream that had started).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest
from conftest import served_model
from test_server import (  # noqa: F401 - collected here too, against the Ray deployment's ``server``
    CTX,
    KEY,
    Endpoint,
    test_bad_completions_get_openai_error_objects,
    test_completions_and_chat_through_the_openai_client_are_picc_runs_tokens,
    test_concurrent_requests_get_single_run_outputs,
    test_keys_routes_and_chat_errors,
    test_stop_strings_end_the_text_before_them,
)

from runtime.ray_serve import APP_NAME as APP
from runtime.ray_serve import ReplicaOptions, application

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

LONG = CTX - 48  # tokens of a request that decodes for seconds (~4 s on a replica's one thread)
SLOTS, QUEUE = 2, 6  # per replica: test_server's eight concurrent clients fit on either one alone
READY_SECONDS = 120  # a replica's start (a process, the model, the engine), on a loaded 2-core machine


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Wide enough that a long request is still decoding while the test does what it is for.
    return served_model(tmp_path_factory.mktemp("ray") / "tiny.pib", CTX, batch_step=False, hidden=1024, n_ff=2816)


@pytest.fixture(scope="module")
def url(model):
    with socket.socket() as s:  # a free loopback port for Ray's HTTP proxy
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = ReplicaOptions(str(model), threads=1, max_batch=SLOTS, max_queue=QUEUE, api_key=KEY,
                                 model_name="tiny")
        serve.run(application(options, replicas=2), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def server(url):
    return Endpoint(url)  # metrics: of the replica that answers


def _replicas() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "PiccReplica" in a["name"]]


def _kill(names: list[str]) -> None:
    for name in names:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _wait_for_new_replicas(killed: list[str]) -> None:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        now = _replicas()
        if len(now) == 2 and not set(killed) & set(now) and serve.status().applications[APP].status == "RUNNING":
            return
        time.sleep(1)
    raise AssertionError(f"no two new replicas after {READY_SECONDS} s: {_replicas()}")


def test_a_full_deployment_answers_429(url):
    # Each replica's engine takes SLOTS decoding and QUEUE waiting requests: of 24 long requests
    # sent at once at least 24 - 2 x (SLOTS + QUEUE) are refused, as one picc serve refuses those
    # beyond its slots and queue, and the others are answered.
    def ask(_: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": LONG // 8},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(ask, range(24)))
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 429} and codes.count(429) >= 24 - 2 * (SLOTS + QUEUE), codes
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "rate_limit_exceeded", r.text


def test_clients_that_leave_free_their_sequences(server):
    # Two long requests whose clients leave, one mid-stream, one while waiting for a whole
    # completion (its read times out): their replicas must stop decoding them at once, not seconds
    # later at their end. /metrics answers for one replica at a time: ask until several in a row,
    # from both, say nothing decodes.
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "the", "max_tokens": LONG}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=60) as stream:
        assert next(stream.iter_lines()).startswith("data: {")  # decoding
        with pytest.raises(httpx.ReadTimeout):  # decoding too, then gone
            httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=httpx.Timeout(60, read=1.0))
    left, idle = time.monotonic(), 0
    while idle < 8 and time.monotonic() < left + 1.5:  # a sequence left alone decodes for ~4 s
        idle = idle + 1 if server.metric("picc_active_sequences") == 0 else 0
        time.sleep(0.05)
    assert idle == 8


def test_a_stream_whose_replica_dies_ends_with_an_error_event(url):
    body = {"model": "tiny", "prompt": "the", "max_tokens": LONG, "stream": True}
    before = _replicas()
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120) as r:
        lines = r.iter_lines()
        assert r.status_code == 200 and next(lines).startswith("data: {")  # the stream has started
        _kill(before)  # both: the one streaming this request among them
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["type"] == "server_error" and error["code"] == "replica_failed", events[-3:]
    _wait_for_new_replicas(before)


def test_a_replica_killed_under_load_is_replaced_and_the_other_keeps_answering(url):
    # Two clients ask one after another throughout; one replica's process is killed in the middle.
    # Requests in flight on it fail with a 503 error object (at most one per client at the time of
    # the kill; the openai client retries those); every other request is answered, and Ray starts
    # a new replica in its place.
    results: list[tuple[float, httpx.Response]] = []
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 16},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
            results.append((time.monotonic(), r))

    before = _replicas()
    assert len(before) == 2
    clients = [threading.Thread(target=ask) for _ in range(2)]
    for t in clients:
        t.start()
    time.sleep(3)
    killed_at = time.monotonic()
    _kill(before[:1])
    _wait_for_new_replicas(before[:1])
    time.sleep(3)  # some requests after the new replica is in place
    stop.set()
    for t in clients:
        t.join()
    after = [r for at, r in results if at > killed_at]
    failed = [r for r in after if r.status_code != 200]
    assert len(failed) <= 2, [r.text for r in failed]  # at most the requests in flight on the killed replica
    for r in failed:
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "replica_failed"
    assert after and after[-1].status_code == 200 and sum(r.status_code == 200 for r in after) >= 5
