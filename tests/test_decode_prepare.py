"""The decode graph captured ahead (DecodeGraphs.prepare, while a prefill's tail computes) is the graph the first
decode step looks up, and it is prepared only when decoding comes next (a graph for an intermediate batch would be
captured and never replayed). The CPU backend cannot capture, so the capture is a stand-in that records the keys;
the step itself then runs eagerly, so answers are the plain path's."""
from __future__ import annotations

from prefixrun.engine.step.decode_graphs import DecodeGraphs, bucket
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions

from conftest import random_prompt


def loaded_ops():
    from prefixrun.kernels import get_ops

    return get_ops("cpu", "float32")


def _keyed_run(loaded, prompts, monkeypatch, **options):
    events = []

    def stand_in_capture(self, like, rows=None):
        return "captured"

    real_step = DecodeGraphs.step_sampled

    def step_sampled(self, handles, tokens, params, feed=None):
        if self.enabled:
            st = self.state
            n, b = len(handles), bucket(len(handles))
            width = bucket(max(st.blocks_for(h.length + 1) for h in handles))
            saved = [(h.length, list(h.blocks)) for h in handles]
            host = st.step_arrays(handles, [[t] for t in tokens], table_width=width,
                                  pad=self._padding(b) if b > n else None)
            for h, (length, blocks) in zip(handles, saved):  # undo what the look-ahead reserved
                st.blocks.decref(h.blocks[len(blocks):])
                h.length, h.blocks[:] = length, blocks
            key = (b, width, host.shared is not None)
            events.append(("step", key, key in self.graphs, len(self.graphs)))
            self.graphs.clear()
            self.enabled = False  # from here on eager: the stand-in graphs cannot replay
        return real_step(self, handles, tokens, params, feed)

    real_prepare = DecodeGraphs.prepare

    def prepare(self, handles):
        real_prepare(self, handles)
        events.append(("prepared", sorted(self.graphs)))

    monkeypatch.setattr(DecodeGraphs, "_capture", stand_in_capture)
    monkeypatch.setattr(DecodeGraphs, "step_sampled", step_sampled)
    monkeypatch.setattr(DecodeGraphs, "prepare", prepare)
    engine = Engine(loaded, loaded_ops(), options=EngineOptions(**{"speculative": "off", **options}))
    engine.runner.decoder.enabled = True  # as on a backend that captures
    sp = SamplingParams(max_tokens=4, temperature=0)
    results = list(engine.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)]))
    engine.close()
    engine.check_invariants()
    return events, {r.custom_id: r.token_ids for r in results}


def test_the_prepared_graph_is_the_first_steps(loaded, monkeypatch):
    base = random_prompt(0, 200)
    prompts = [base + random_prompt(i + 1, 30 + i) for i in range(12)]  # a shared prefix, one group of suffixes
    events, _ = _keyed_run(loaded["qwen3_5"], prompts, monkeypatch, max_batch=16)
    steps = [e for e in events if e[0] == "step"]
    prepared = [e for e in events if e[0] == "prepared"]
    assert steps and steps[0][2], events  # the first step's key was captured ahead
    assert len(prepared) == 1 and steps[0][3] == 1, events  # and nothing else was


def test_no_graph_prepared_for_an_intermediate_batch(loaded, monkeypatch):
    """Groups that more prefill groups follow (the batch still growing) prepare nothing; only the last does."""
    base = random_prompt(0, 100)
    prompts = [base + random_prompt(i + 1, 20) for i in range(12)]
    events, got = _keyed_run(loaded["qwen3_5"], prompts, monkeypatch, max_batch=16, max_prefill_tokens=64)
    prepared = [e for e in events if e[0] == "prepared"]
    steps = [e for e in events if e[0] == "step"]
    assert len(prepared) == 1 and steps[0][2] and steps[0][3] == 1, events
    plain = Engine(loaded["qwen3_5"], loaded_ops(), options=EngineOptions(speculative="off", max_batch=16,
                                                                                        max_prefill_tokens=64))
    sp = SamplingParams(max_tokens=4, temperature=0)
    want = {r.custom_id: r.token_ids for r in plain.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    assert got == want
