"""``picc serve --ray``: two replicas of the server on a local Ray cluster (loopback only, started
and stopped here), spoken to through Ray Serve's HTTP proxy with the official ``openai`` client.

A separate suite (marker ``ray``, run with ``pytest -m ray``; Ray from ``pip install picc[ray]``):
starting Ray and its replicas takes ~30 s on a 2-core machine. What it shows: the same answers as
a session alone (a request runs whole on one replica), the same error objects (429 when every
replica is busy and the router's queue is full), clients that leave freeing their slots, and a
replica killed under load replaced by Ray while the other keeps answering, the requests it took
with it ending in OpenAI error objects (a 503, or an error event in a stream that had started).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import served_model

from runtime.ray_serve import APP_NAME as APP
from runtime.ray_serve import ReplicaOptions, application
from runtime.session import Session

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytestmark = pytest.mark.ray

KEY = "test-key"
CTX = 2048
LONG = CTX - 48  # tokens of a request that decodes for seconds (~4 s on a replica's one thread)
PROMPTS = ["the company said", "it is", "in the new york stock exchange the", "a year"]
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
        # One sequence a replica and one request waiting per replica: two streams fill the replicas,
        # two more wait in the router, a fifth is refused.
        options = ReplicaOptions(str(model), threads=1, max_batch=1, max_queue=1, api_key=KEY, model_name="tiny")
        serve.run(application(options, replicas=2), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def alone(path, text: str, n: int, chat: bool = False) -> str:
    """What a session alone generates greedily from ``text`` (``picc run``'s path), as text."""
    with Session(path, 1) as s:
        ids = s.text.encode_chat(text) if chat else s.text.encode(text)
        out = [t for t in s.generate(ids, n) if t != s.text.eos_id]
        return s.text.decode(out)


def test_completions_chat_and_streams_through_ray_are_a_session_alones(url, model):
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    for prompt in PROMPTS:  # two replicas: the router spreads these over both
        done = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert done.choices[0].text == alone(model, prompt, 10) and done.usage.completion_tokens == 10
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == alone(model, PROMPTS[0], 10)
    messages = [{"role": "user", "content": "hello there"}, {"role": "system", "content": "be brief"}]
    reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == alone(model, "user hello there system be brief the company", 8,
                                                     chat=True)


def test_errors_are_openai_error_objects_through_ray(url):
    bad = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
    unknown = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"},
                         headers={"Authorization": f"Bearer {KEY}"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/health").json()["status"] == "ok"


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
    # Each replica decodes one sequence and the router holds one waiting request per replica:
    # of eight long requests sent at once, two decode, two wait, the others are refused, as one
    # picc serve refuses those beyond its slots and queue.
    def ask(_: int) -> httpx.Response:
        return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": LONG // 4},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, [(r.status_code, r.text[:300]) for r in answers]
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "rate_limit_exceeded", r.text


def test_clients_that_leave_free_their_replicas_slots(url):
    # Two long requests fill both replicas' slots; their clients leave, one mid-stream, one while
    # waiting for a whole completion (its read times out). Had their sequences decoded on (seconds
    # more), four requests a second later would find both slots taken: two would wait and two be
    # refused. Freed, all four are answered.
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "the", "max_tokens": LONG}
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=60) as stream:
        assert next(stream.iter_lines()).startswith("data: {")  # decoding on one replica
        with pytest.raises(httpx.ReadTimeout):  # decoding on the other, then gone
            httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=httpx.Timeout(60, read=1.0))
    time.sleep(1)

    def ask(_: int) -> int:
        return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 8},
                          headers=auth, timeout=60).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == [200] * 4


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
