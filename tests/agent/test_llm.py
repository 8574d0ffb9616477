"""The LLM proposer against a real HTTP server on loopback that speaks chat completions."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from specpilot.agent.llm import LLMProposer
from specpilot.core.errors import SpecPilotError
from specpilot.passes.base import PassContext
from specpilot.passes.pipeline import parse

REPORT = {"pipeline": "", "engine": "compiled-spec", "target": "llvm", "bottleneck": "acceptance",
          "factors": {"acceptance": 1.4, "kernel": 1.1, "overhead": 1.0}, "tree_acceptance": {"16": 1.7},
          "accepted_per_verification": 1.3, "wall_seconds": 1.0, "kernel_seconds": 0.9, "kernels": []}


class _Server:
    def __init__(self, answers):
        self.answers, self.requests = list(answers), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                status, content = outer.answers.pop(0) if len(outer.answers) > 1 else outer.answers[0]
                payload = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": content}}]})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload.encode() if status == 200 else b'{"error": {"message": "overloaded"}}')

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _proposer(url, **kw):
    return LLMProposer(model="local-test", base_url=url, api_key="k", timeout=5, retries=kw.pop("retries", 1), **kw)


def test_valid_answer_becomes_checked_candidates():
    answer = {"candidates": [
        {"pipeline": "tree-verify{budget=32},gdn-path-recompute", "direction": "acceptance", "estimated_gain": 0.2,
         "rationale": "trees"},
        {"pipeline": "tree-verify{budget=32}", "estimated_gain": 0.1},                      # illegal on a hybrid
        {"pipeline": "os.system('rm -rf /')", "estimated_gain": 9},                         # not a pipeline
        {"pipeline": "logit-bias-fault", "estimated_gain": 0.5},                            # test-only pass
        {"pipeline": "draft-length{length=2}", "direction": "nonsense", "estimated_gain": 0.3}]}
    server = _Server([(200, json.dumps(answer))])
    try:
        p = _proposer(server.url)
        cands = p.propose(REPORT, parse(""), PassContext(hybrid=True), 5, [], set())
    finally:
        server.close()
    assert [c.pipeline for c in cands] == ["tree-verify{budget=32},gdn-path-recompute", "draft-length{length=2}"]
    assert all(c.source == "llm" for c in cands) and cands[1].direction == "acceptance"
    assert len(p.rejected) == 3 and "illegal" in p.rejected[0] and "test-only" in p.rejected[2]
    sent = json.loads(server.requests[0]["messages"][1]["content"])
    assert sent["cost_report"]["bottleneck"] == "acceptance" and server.requests[0]["model"] == "local-test"
    assert "logit-bias-fault" not in [x["name"] for x in sent["passes"]]


def test_garbage_then_good_answer_is_retried():
    good = json.dumps({"candidates": [{"pipeline": "draft-length{length=3}", "estimated_gain": 0.1}]})
    server = _Server([(200, "I think you should use trees!"), (200, good)])
    try:
        cands = _proposer(server.url).propose(REPORT, parse(""), PassContext(), 5, [], set())
    finally:
        server.close()
    assert [c.pipeline for c in cands] == ["draft-length{length=3}"] and len(server.requests) == 2


def test_garbage_and_dead_endpoints_are_clear_errors():
    server = _Server([(200, '{"candidates": "lots"}')])
    try:
        with pytest.raises(SpecPilotError, match="did not answer in the schema after 2 tries"):
            _proposer(server.url).propose(REPORT, parse(""), PassContext(), 5, [], set())
    finally:
        server.close()
    server = _Server([(400, "")])
    try:
        with pytest.raises(SpecPilotError, match="answered HTTP 400"):
            _proposer(server.url, retries=0).propose(REPORT, parse(""), PassContext(), 5, [], set())
    finally:
        server.close()
    with pytest.raises(SpecPilotError, match="unreachable"):
        _proposer("http://127.0.0.1:9/v1", retries=0).propose(REPORT, parse(""), PassContext(), 5, [], set())
    with pytest.raises(SpecPilotError, match="OPENAI_BASE_URL"):
        LLMProposer(model="m", base_url="")


def test_one_out_of_range_candidate_drops_only_itself():
    answer = {"candidates": [{"pipeline": "draft-length{length=3}", "estimated_gain": 1e9},
                             {"pipeline": "draft-length{length=2}", "estimated_gain": 0.2}]}
    server = _Server([(200, json.dumps(answer))])
    try:
        p = _proposer(server.url)
        cands = p.propose(REPORT, parse(""), PassContext(), 5, [], set())
    finally:
        server.close()
    assert [c.pipeline for c in cands] == ["draft-length{length=2}"]
    assert len(p.rejected) == 1 and "less than or equal" in p.rejected[0]


def test_a_200_whose_body_is_not_json_is_a_clear_error():
    server = _Server([(200, "x")])
    handler = server.httpd.RequestHandlerClass

    def do_post(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"<html>proxy error</html>")
    handler.do_POST = do_post
    try:
        with pytest.raises(SpecPilotError, match="LLM endpoint"):
            _proposer(server.url, retries=0).propose(REPORT, parse(""), PassContext(), 5, [], set())
    finally:
        server.close()


def test_a_failing_proposer_costs_the_phase_not_the_search():
    from types import SimpleNamespace

    from specpilot.agent.cycle import Search

    class Dead:
        rejected = []

        def propose(self, *args):
            raise SpecPilotError("LLM endpoint http://x unreachable: refused")

    events, said = [], []
    search = SimpleNamespace(proposer=Dead(), say=said.append,
                             log=SimpleNamespace(add=lambda kind, **kw: events.append((kind, kw))))
    assert Search._propose(search, lambda current: (), "") == []
    assert events == [("proposer_failed", {"error": "LLM endpoint http://x unreachable: refused"})]
    assert "going on without its candidates" in said[0]
