"""A decode step with structured-output rows draws every row once: its graph draws the rows without a grammar or
logits edits and leaves the others undrawn (kernels/sampling.py SKIP_DRAW, padding rows too), and the logits stage
draws only those, after their masks, into the graph's ids (engine/step/logits_processors.py). The tokens are the
eager steps' (which draw the same way), and an unconstrained row's are the ones it gets alone. CPU, with a stand-in
for graph capture whose replay re-runs the step on the graph's buffers, as a real one reads them."""
from __future__ import annotations

import json

import jsonschema
import numpy as np

from prefixrun.engine.request import Request
from prefixrun.engine.run.core import Engine, EngineOptions
from prefixrun.engine.step.model_runner import ModelRunner
from prefixrun.kernels.sampling import skipped_rows
from test_structured_output import TICKET_SCHEMA, default_model, request  # noqa: F401 (a fixture)


class _GraphOps:
    """NumpyOps with graph capture stood in for, recording which rows each `sample_into` draws (and whether inside
    a replay)."""

    can_capture_graphs = True

    def __init__(self, base):
        self._base = base
        self.draws: list[tuple[bool, np.ndarray]] = []
        self.replaying = False

    def __getattr__(self, name):
        return getattr(self._base, name)

    def capture(self, fn, warmup=1):
        ops = self

        class Graph:
            @staticmethod
            def replay():
                ops.replaying = True
                try:
                    return fn()
                finally:
                    ops.replaying = False

        return Graph()

    def sample_into(self, logits, params, out):
        self.draws.append((self.replaying, ~skipped_rows(self._base.to_host(params))))
        return self._base.sample_into(logits, params, out)


def mixed_requests(loaded) -> list[Request]:
    prompt = "Tell me about the weather."
    return [request(loaded, 0, prompt, {"guided_json": TICKET_SCHEMA}, max_tokens=30),
            request(loaded, 1, prompt, max_tokens=30, temperature=0.9),
            request(loaded, 2, prompt, {"guided_choice": ["yes", "no", "maybe"]}, max_tokens=30, temperature=1.3),
            request(loaded, 3, "Describe a cat.", max_tokens=30, temperature=0),
            request(loaded, 4, prompt, max_tokens=30, presence_penalty=1.5),  # edits: drawn by the stage too
            request(loaded, 5, "JSON:", {"response_format": {"type": "json_object"}}, max_tokens=30, top_k=5)]


def run(loaded, ops, requests, **options) -> dict:
    engine = Engine(loaded.model, ops, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer,
                    options=EngineOptions(speculative="off", max_batch=8, **options))
    got = {r.custom_id: r for r in engine.run(requests)}
    assert engine.runner.decoder.enabled == ops.can_capture_graphs
    engine.close()
    engine.check_invariants()
    return got


def test_each_row_of_a_constrained_step_is_drawn_once(default_model, monkeypatch):  # noqa: F811
    ops = _GraphOps(default_model.ops)
    steps = []
    launch, finish = ModelRunner.launch_decode, ModelRunner.finish_decode

    def launch_decode(self, seqs, source, previous):
        ops.draws = []
        out = launch(self, seqs, source, previous)
        steps.append({"staged": out.staged.copy(), "graph": [d for inside, d in ops.draws if inside]})
        return out

    def finish_decode(self, step):
        ops.draws = []
        steps[-1]["live"] = np.array([not s.done for s in step.seqs])
        out = finish(self, step)
        steps[-1]["stage"] = [d for _, d in ops.draws]
        return out

    monkeypatch.setattr(ModelRunner, "launch_decode", launch_decode)
    monkeypatch.setattr(ModelRunner, "finish_decode", finish_decode)
    requests = mixed_requests(default_model)
    replayed = run(default_model, ops, requests)
    assert any(s["staged"].any() and not s["staged"].all() for s in steps)  # steps mixing both kinds of rows
    for step in steps:
        staged, live = step["staged"], step["live"]
        n = staged.shape[0]
        (graph,) = step["graph"]  # one draw inside the replay: the unstaged rows, no padding row
        assert graph[:n].tolist() == (~staged).tolist() and not graph[n:].any()
        want = staged & live
        assert [d.tolist() for d in step["stage"]] == ([want.tolist()] if want.any() else [])
    assert sum(len(s["stage"]) for s in steps) > 0
    monkeypatch.undo()
    eager = run(default_model, default_model.ops, requests)
    assert {k: r.token_ids for k, r in replayed.items()} == {k: r.token_ids for k, r in eager.items()}
    alone = run(default_model, _GraphOps(default_model.ops), [requests[1], requests[3]])
    assert all(alone[k].token_ids == replayed[k].token_ids for k in alone)
    assert replayed["r2"].text in ("yes", "no", "maybe")
    text = replayed["r0"].text
    if replayed["r0"].finish_reason == "stop":
        jsonschema.validate(json.loads(text), TICKET_SCHEMA)
