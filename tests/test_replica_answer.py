"""A Ray replica's side of ``picc serve --ray``, without Ray: ``runtime.ray_serve.replica_answer``
runs the server's ASGI application on a forwarded request in the replica's own process and yields
the response's head and body chunks for the router to relay. What it must keep: the server's answers
(the same tokens, the same error objects) and its freeing of a sequence whose client went away.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from conftest import served_model

from runtime.ray_serve import Forwarded, ReplicaOptions, build_app, replica_answer
from runtime.session import Session

CTX = 2048  # a whole-context stream (~2000 tokens) lasts long past its first chunk


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    path = served_model(tmp_path_factory.mktemp("replica") / "tiny.pib", CTX, batch_step=False)
    engine, session, app = build_app(ReplicaOptions(str(path), threads=1, max_batch=2, model_name="tiny"))
    yield path, engine, app
    engine.close()
    session.close()


def post(path: str, body: object) -> Forwarded:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Forwarded("POST", path, b"", ((b"content-type", b"application/json"),), content)


async def answer_of(app, request: Forwarded) -> tuple[int, dict, bytes]:  # noqa: ANN001
    head, *chunks = [item async for item in replica_answer(app, request)]
    status, headers = head
    return status, {k.decode().lower(): v.decode() for k, v in headers}, b"".join(chunks)


def alone(path, prompt: str, n: int) -> str:
    with Session(path, 1) as s:
        return s.text.decode([t for t in s.generate(s.text.encode(prompt), n) if t != s.text.eos_id])


def test_a_whole_completion_and_a_stream_are_the_servers(replica):
    path, _, app = replica
    expected = alone(path, "the company said", 12)
    body = {"model": "tiny", "prompt": "the company said", "max_tokens": 12, "temperature": 0}
    status, headers, content = asyncio.run(answer_of(app, post("/v1/completions", body)))
    assert status == 200 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(content) and json.loads(content)["choices"][0]["text"] == expected

    status, headers, content = asyncio.run(answer_of(app, post("/v1/completions", {**body, "stream": True})))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in content.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected


def test_errors_pass_as_the_servers_error_objects(replica):
    _, _, app = replica
    status, _, content = asyncio.run(answer_of(app, post("/v1/completions", b"{not json")))
    assert status == 400 and json.loads(content)["error"]["type"] == "invalid_request_error"
    status, _, content = asyncio.run(answer_of(app, Forwarded("GET", "/v1/nowhere", b"", (), b"")))
    assert status == 404 and json.loads(content)["error"]["code"] == "unknown_url"


def test_closing_the_answer_mid_stream_frees_the_sequence(replica):
    # What a replica sees when the router's client leaves: Ray cancels the request, which closes
    # the answer. The app must hear of the disconnect and cancel the sequence, not decode on.
    _, engine, app = replica
    body = {"model": "tiny", "prompt": "the", "max_tokens": CTX - 48, "stream": True}

    async def leave_after_first_chunk() -> None:
        answer = replica_answer(app, post("/v1/completions", body))
        status, _ = await anext(answer)
        assert status == 200
        assert (await anext(answer)).startswith(b"data: ")  # decoding has started
        await answer.aclose()

    generated = engine.stats.generated_tokens
    asyncio.run(leave_after_first_chunk())
    for _ in range(100):  # the engine's thread frees it at its next turn
        if engine.pool.free == engine.max_batch:
            break
        time.sleep(0.05)
    assert engine.active == 0 and engine.waiting == 0 and engine.pool.free == engine.max_batch
    assert engine.stats.generated_tokens - generated < CTX - 48  # freed early, not run to its end
