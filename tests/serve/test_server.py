"""`specpilot serve` on loopback, answered by the openai client and plain HTTP: the served tokens are
the engine's own (greedy and sampled, plain and streamed, completions and chat), bad requests get
OpenAI-shaped 4xx errors, a full queue 429, and a client that leaves mid-stream frees its row."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from specpilot.compiler.build import BuildRequest, build
from specpilot.core.spec import load_spec
from specpilot.core.target import parse_target

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def serve_build(tmp_path_factory):
    """A tiny hybrid build (early-exit drafter, trees)."""
    tmp = tmp_path_factory.mktemp("serve")
    data = yaml.safe_load((ROOT / "examples" / "tiny-hybrid.yaml").read_text())
    data["deployment"].update(max_seq_len=256, max_batch=1)
    data["passes"] = "tree-verify{budget=8},gdn-path-recompute"
    (tmp / "model.yaml").write_text(yaml.safe_dump(data))
    build(BuildRequest(load_spec(tmp / "model.yaml"), parse_target("llvm"), tmp / "build"))
    (tmp / "chat.jinja").write_text(TEMPLATE)
    return tmp / "build"


@pytest.fixture(scope="module")
def served(serve_build):
    """The build served in-process on a free loopback port."""
    import uvicorn

    from specpilot.serve.app import create_app
    from specpilot.serve.launch import make_server
    server = make_server(serve_build, None, None, serve_build.parent / "chat.jinja", queue_size=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not web.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield server, f"http://127.0.0.1:{port}"
    web.should_exit = True
    thread.join(timeout=30)


def client(base):
    from openai import OpenAI
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def post(base, path, body, raw: bytes | None = None):
    req = urllib.request.Request(f"{base}{path}", data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_health_and_name(served):
    server, base = served
    models = client(base).models.list().data
    assert [m.id for m in models] == [server.model_name] == ["build"]
    assert server.engine == "compiled-tree"
    with urllib.request.urlopen(f"{base}/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_completion_tokens_are_the_engine_s(served):
    from specpilot.core.sampling import SamplingParams
    server, base = served
    api = client(base)
    prompt = "def f(x):"
    ids = server.system.tokenizer.encode(prompt)
    for kwargs, sampling in (({"temperature": 0}, None),
                             ({"temperature": 0.9, "top_p": 0.95, "seed": 42},
                              SamplingParams(temperature=0.9, top_p=0.95, seed=42))):
        out = api.completions.create(model="build", prompt=prompt, max_tokens=24, extra_body={"return_token_ids": True},
                                     **kwargs)
        want = server.system.generate("compiled", ids, 24, stop_at_eos=True, sampling=sampling)
        assert out.choices[0].token_ids == want.tokens
        assert out.choices[0].text == server.system.tokenizer.decode(want.tokens)
        assert out.usage.completion_tokens == len(want.tokens) and out.usage.prompt_tokens == len(ids)
        streamed = api.completions.create(model="build", prompt=ids, max_tokens=24, stream=True,
                                          extra_body={"return_token_ids": True}, **kwargs)
        chunks = list(streamed)
        assert sum((c.choices[0].token_ids for c in chunks), []) == want.tokens
        assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_plain_and_streamed(served):
    server, base = served
    api = client(base)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = api.chat.completions.create(model="build", messages=messages, max_tokens=16, temperature=0)
    ids = server.system.tokenizer.encode("<system>Be brief.\n<user>Hi\n<assistant>")
    want = server.system.generate("compiled", ids, 16, stop_at_eos=True)
    assert out.choices[0].message.content == server.system.tokenizer.decode(want.tokens)
    assert out.choices[0].message.role == "assistant"
    chunks = list(api.chat.completions.create(model="build", messages=messages, max_tokens=16, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_stop_strings_end_the_text(served):
    server, base = served
    out = post(base, "/v1/completions", {"model": "build", "prompt": "ab", "max_tokens": 40, "temperature": 0})[1]
    text = out["choices"][0]["text"]
    stop = text[5:7]
    assert len(stop) == 2
    cut = post(base, "/v1/completions", {"model": "build", "prompt": "ab", "max_tokens": 40, "temperature": 0,
                                         "stop": [stop]})[1]
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body,status,field", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "build", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "build", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "build", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "build", "prompt": "x", "seed": 2 ** 64}, 400, "seed"),
    ({"model": "build", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": "build", "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": "build", "prompt": list(range(3, 259))}, 400, "prompt"),     # fills the 256-token context
    ({"model": "build", "prompt": ""}, 400, "prompt"),
    ({"model": "build"}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(served, body, status, field):
    _, base = served
    code, out = post(base, "/v1/completions", body)
    assert code == status, out
    assert out["error"]["code"] == status and out["error"]["param"] == field, out
    assert out["error"]["message"]


def test_bad_json_and_bad_chat(served):
    _, base = served
    code, out = post(base, "/v1/completions", None, raw=b'{"model": "build", "prompt": ')
    assert code == 400 and "JSON" in out["error"]["message"]
    code, out = post(base, "/v1/chat/completions", {"model": "build", "messages": [{"role": "robot", "content": "x"}]})
    assert code == 400 and out["error"]["param"].startswith("messages")
    code, _ = post(base, "/v1/chat/completions", {"model": "build", "messages": []})
    assert code == 400


def _wait(predicate, seconds=60):
    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline
        time.sleep(0.05)


def test_full_queue_is_429_and_disconnect_frees_the_row(served, monkeypatch):
    server, base = served
    model = server.system.engines[server.engine].model
    rows = len(model.free_rows)
    gate = threading.Event()
    real = server.system.generate

    def held(*args, **kwargs):          # the engine busy until the test lets it go
        gate.wait(60)
        return real(*args, **kwargs)
    monkeypatch.setattr(server.system, "generate", held)
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "build", "prompt": "abc", "max_tokens": 250,
                                                        "temperature": 0, "stream": True}),
                 {"Content-Type": "application/json"})
    _wait(lambda: server.scheduler.waiting.qsize() == 0 and server.metrics.running._value.get() == 1)
    queued = threading.Thread(target=post, args=(base, "/v1/completions",
                                                  {"model": "build", "prompt": "q", "max_tokens": 2}))
    queued.start()
    _wait(lambda: server.scheduler.waiting.qsize() == 1)
    code, out = post(base, "/v1/completions", {"model": "build", "prompt": "x", "max_tokens": 2})
    assert code == 429 and out["error"]["type"] == "RateLimitError"
    gate.set()
    response = conn.getresponse()
    assert response.status == 200
    assert response.read(6) == b"data: "
    conn.close()                        # the client goes away mid-stream
    queued.join(60)
    _wait(lambda: len(model.free_rows) == rows and server.metrics.running._value.get() == 0)
    cancelled = server.metrics.requests.labels("cancelled")._value.get()
    assert cancelled >= 1
    with urllib.request.urlopen(f"{base}/metrics") as r:
        text = r.read().decode()
    assert "specpilot_requests_total" in text and 'outcome="rejected"' in text


def test_load_test_in_its_own_server_process(serve_build, tmp_path):
    """bench/serve_load.py against a real `specpilot serve` process: concurrent clients, every
    response's tokens equal the prompt's single-request run, nothing lost."""
    import subprocess
    import sys
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "serve_load.py"), str(serve_build), "--engines",
                    "compiled,compiled-tree", "--clients", "1,3", "--seconds", "2", "--max-tokens", "12",
                    "--requests", "3", "-o", str(out)], check=True, cwd=ROOT, timeout=600)
    report = json.loads(out.read_text())
    assert report["passed"] and set(report["engines"]) == {"compiled", "compiled-tree"}
    for rows in report["engines"].values():
        assert [r["clients"] for r in rows] == [1, 3]
        assert all(r["requests"] > 0 and r["lost"] == 0 and r["tokens_identical"] for r in rows)
    assert report["environment"]["torch"]
