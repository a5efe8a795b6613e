"""bench/hf_generate.py, the independent transformers baseline (bench/device_bench.sh reports the faster of it and
`prefixrun bench --compare-transformers`): groups of equal-length prompts, left padding where lengths differ, the
settings tried and chosen by measurement, and greedy tokens that are the engine's own on the CPU (fp32), so the
figure it gives is the time of the right work."""
from __future__ import annotations

import json

import pytest

from conftest import PARITY_STD, bench_script, write_jsonl
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model
from prefixrun.engine.request import Request, SamplingParams
from prefixrun.engine.run.core import Engine, EngineOptions


def _model_and_workload(tmp_path, lines):
    """A tiny Qwen3.5 model's folder and `lines` written as its JSONL workload."""
    model_dir = make_model_dir(tmp_path / "m", TINY_QWEN3_5, seed=5, init_std=PARITY_STD)
    return model_dir, write_jsonl(tmp_path / "w.jsonl", lines)


def test_groups_are_equal_length_where_the_workload_allows_and_left_padded_otherwise():
    hf = bench_script("hf_generate")
    lines = [{"prompt_token_ids": [1] * n, "max_tokens": 4} for n in (5, 9, 5, 9, 5, 7)]
    groups = hf.groups_of(lines, 3, 16)
    assert [[len(l["prompt_token_ids"]) for l in g] for g in groups] == [[5, 5, 5], [7, 9, 9]]
    ids, mask = hf.batch_tensors([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6, 7, 8]}], "cpu")
    assert ids.tolist() == [[0, 4, 5], [6, 7, 8]] and mask.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_a_line_without_token_ids_is_refused_by_its_number(tmp_path):
    workload = write_jsonl(tmp_path / "w.jsonl", [{"prompt_token_ids": [1]}, {"prompt": "text"}])
    with pytest.raises(SystemExit, match="line 2 has no prompt_token_ids"):
        bench_script("hf_generate").read_lines(workload)


def test_greedy_tokens_are_the_engines_and_the_figures_say_how_they_were_made(cpu_ops, tmp_path):
    pytest.importorskip("transformers")
    hf = bench_script("hf_generate")
    prompts = [[(7 * i + j) % 500 + 3 for j in range(12)] for i in range(4)]
    lines = [{"custom_id": f"r{i}", "prompt_token_ids": p, "max_tokens": 6, "temperature": 0}
             for i, p in enumerate(prompts)]
    model_dir, workload = _model_and_workload(tmp_path, lines)
    h = hf.Harness(model_dir, 0.0, 16)
    got = h.generate(lines).tolist()  # one equal-length group of 4
    model = load_model(model_dir, cpu_ops)[0]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng = Engine(model, cpu_ops, options=EngineOptions(speculative="off", max_batch=4))
    want = {r.custom_id: r.token_ids for r in eng.run([Request(f"r{i}", p, sp, i) for i, p in enumerate(prompts)])}
    assert got == [want[f"r{i}"] for i in range(4)]
    figures = hf.run(model_dir, workload, group=3)
    assert figures["requests"] == 4 and figures["groups"] == 2 and figures["generated_tokens"] == 4 * 6
    assert figures["wall_seconds"] > 0 and figures["cache"] == "dynamic" and figures["device"] == "cpu"
    assert figures["tried"] == [{"settings": "dynamic cache", "probe_seconds": None}] and figures["complete"]
    stopped = hf.run(model_dir, workload, group=1, time_limit=0.0)  # stops after its first group
    assert not stopped["complete"] and stopped["groups_timed"] == 1 and stopped["generated_tokens"] == 6
    # both figures are rounded to 4 decimals: the wall's rounding, times 4 groups, plus the estimate's own
    assert stopped["estimated_wall_seconds"] == pytest.approx(stopped["wall_seconds"] * 4, abs=4 * 5e-5 + 5e-5)


def test_the_caches_tried_follow_the_option_and_the_device():
    hf = bench_script("hf_generate")
    assert hf.candidates("cuda") == ["static", None] and hf.candidates("cuda", ("dynamic",)) == [None]
    assert hf.candidates("cpu") == [None] and hf.candidates("cpu", ("static",)) == [None]
    with pytest.raises(SystemExit):
        hf.main(["m", "w.jsonl", "--caches", "paged"])


@pytest.mark.gpu
def test_the_harness_on_the_gpu_picks_settings_that_work_and_times_the_workload(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hf = bench_script("hf_generate")
    lines = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(40)], "max_tokens": 8} for i in range(6)]
    model_dir, workload = _model_and_workload(tmp_path, lines)
    figures = hf.run(model_dir, workload, group=4)
    assert figures["device"] == "cuda" and figures["generated_tokens"] == 6 * 8 and figures["groups"] == 2
    assert figures["cache"] in ("static", "dynamic") and len(figures["tried"]) == 2
    assert any("probe_seconds" in t for t in figures["tried"]), figures["tried"]


def _refusing_groups_over(torch, limit: int):
    """A generate that runs out of device memory for more than `limit` prompts at once, as transformers' reference
    Mamba2 scan does at long prompts."""
    def generate(ids, **kwargs):
        if ids.shape[0] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 432.00 GiB")
        return torch.zeros((ids.shape[0], ids.shape[1] + kwargs["max_new_tokens"]), dtype=torch.long)
    return generate


def test_both_harnesses_halve_the_group_while_transformers_runs_out_of_memory(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from prefixrun.cli import bench

    hf = bench_script("hf_generate")
    lines = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(12)], "max_tokens": 3} for i in range(8)]
    model_dir, workload = _model_and_workload(tmp_path, lines)
    real = hf.Harness.__init__

    def small_memory(self, *a, **k):
        real(self, *a, **k)
        self.model.generate = _refusing_groups_over(torch, 2)
    monkeypatch.setattr(hf.Harness, "__init__", small_memory)
    figures = hf.run(model_dir, workload, group=8)
    assert figures["group_size"] == 2 and figures["groups"] == 4 and figures["generated_tokens"] == 8 * 3

    import transformers

    class Tiny:
        generate = staticmethod(_refusing_groups_over(torch, 3))

        def to(self, dev):
            return self

        def eval(self):
            return self
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Tiny())
    seconds, used = bench.transformers_baseline(model_dir, lines, "cpu", 8, {"temperature": 0}, 4)
    assert used == 2 and seconds >= 0
    monkeypatch.setattr(Tiny, "generate", staticmethod(_refusing_groups_over(torch, 0)))
    setup = {"model_dir": model_dir, "device": "cpu", "lines": lines, "sampling": {"temperature": 0},
             "default_max_tokens": 4}
    skipped = bench.compare_with_transformers(setup, 8, 1.0)
    assert skipped["transformers_skipped"].startswith("transformers failed: OutOfMemoryError"), skipped


def test_bench_compares_nothing_when_lines_failed(tmp_path):
    """Token ids outside a small model's vocabulary (bench/workloads.py without --vocab-limit): every line is an
    error record, and the comparison says so, not transformers' `IndexError: index out of range in self`."""
    from conftest import cli

    model_dir, work = _model_and_workload(tmp_path, [{"prompt_token_ids": [1, 2, 100_000], "max_tokens": 2},
                                                     {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}])
    res = cli("bench", work, "--model", model_dir, "--device", "cpu", "--no-cache", "--compare-transformers", "-q")
    assert res.exit_code == 3, res.output
    figures = json.loads(res.stdout)
    assert figures["transformers_skipped"].startswith("1 of the workload's lines got error records"), figures
    assert "speedup_vs_transformers" not in figures and "IndexError" not in res.stderr


def test_bench_quiet_keeps_transformers_quiet(tmp_path):
    """`bench -q --compare-transformers` prints its figures on stdout and nothing on stderr: not transformers'
    progress bar over the weights' load, nor its notes on the kernels it falls back from. Without -q they stay."""
    import subprocess

    from conftest import cmd

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model_dir, work = _model_and_workload(tmp_path, [{"prompt_token_ids": [3, 4, 5, 6], "max_tokens": 2}])

    def bench(*quiet):
        return subprocess.run(cmd("bench", work, "--model", model_dir, "--device", "cpu", "--no-cache",
                                  "--compare-transformers", *quiet), capture_output=True, text=True, timeout=300)
    quiet = bench("-q")
    assert quiet.returncode == 0, quiet.stderr
    assert "speedup_vs_transformers" in json.loads(quiet.stdout) and quiet.stderr == "", quiet.stderr
    loud = bench()
    assert loud.returncode == 0 and "Loading weights" in loud.stderr, loud.stderr
