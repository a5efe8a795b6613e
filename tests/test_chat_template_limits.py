"""A chat template is code from the model folder: one that raises anything, recurses, loops 10**10 times or builds
a value past memory is an error for each chat line (InvalidRequest naming the template file), quickly and in
bounded memory; never the end of the run, a hang or an out-of-memory kill."""
from __future__ import annotations

import resource
import shutil
import time

import pytest

from prefixrun.engine.load import chat_template
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.load.tokenizer import Tokenizer
from prefixrun.engine.request import InvalidRequest

USER = [{"role": "user", "content": "hi"}]

RUNAWAY = {
    "recursion": ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "nested-loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "loops take more than"),
    "range-past-the-sandbox": ("{% for i in range(1000000) %}{% endfor %}", "OverflowError"),
    "division-by-zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "repeated-text": ('{{ "x" * 10**10 }}', "'*' would build 10,000,000,000 items"),
    "repeated-list": ("{{ (messages * 10**9) | length }}", "'*' would build 1,000,000,000 items"),
    "doubled-text": ('{% set ns = namespace(s="x") %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}'
                     '{% endfor %}{{ ns.s }}', "'+' would build more than"),
    "huge-power": ("{% set n, m = 2, 10 ** 9 %}{{ n ** m }}", "'**' would build an integer"),
    "wide-format": ('{{ "%999999999d" % 1 }}', "'%' formats a field wider than"),
    "tojson-indent": ("{{ messages | tojson(indent=1000000000) }}", "tojson's indent"),
    "growing-output": ('{% for i in range(100000) %}{{ "y" * 10000 }}{% endfor %}', "its text grows past"),
    "huge-constant": ("{{ 10 ** 100000 }}", "ValueError"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"), TINY_QWEN3_5, seed=3)


def _with_template(model_dir, tmp_path, source: str) -> Tokenizer:
    folder = shutil.copytree(model_dir, tmp_path / "m")
    (folder / "chat_template.jinja").write_text(source)
    return Tokenizer.from_model_dir(folder)


@pytest.mark.parametrize("case", sorted(RUNAWAY))
def test_a_runaway_template_is_an_error_for_the_line(model_dir, tmp_path, case):
    source, message = RUNAWAY[case]
    tokenizer = _with_template(model_dir, tmp_path, source)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="chat_template.jinja") as caught:
        tokenizer.render_chat(USER)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - start < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 400 << 10  # KiB: under 400 MiB
    with pytest.raises(InvalidRequest, match="chat_template.jinja"):  # and again for the next line
        tokenizer.render_chat(USER)


def test_a_template_too_deeply_nested_to_parse_is_a_compile_error_for_each_line(model_dir, tmp_path):
    tokenizer = _with_template(model_dir, tmp_path, "{% if 1 %}" * 3000)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="chat template 'default' is not valid jinja"):
            tokenizer.render_chat(USER)


def test_the_bounded_range_still_behaves_as_a_range():
    """Templates index, measure, reverse and slice ranges (Qwen3's walks messages backwards by index)."""
    source = ("{% set r = range(2, 12, 3) %}{{ r | length }} {{ r[1] }} {{ r | reverse | list }} {{ r[1:] | list }} "
              "{{ 5 in r }} {% for i in range(messages | length - 1, -1, -1) %}{{ messages[i].content }}{% endfor %} "
              "{{ (range(3) | list) * 2 }} {{ [1] + [2] }} {{ 'ab' * 3 }} {{ '%05d' % 42 }} {{ 2 ** 10 }}")
    rendered = chat_template.compile_template(source).render([{"role": "user", "content": "a"},
                                                             {"role": "user", "content": "b"}])
    assert rendered == "4 5 [11, 8, 5, 2] [5, 8, 11] True ba [0, 1, 2, 0, 1, 2] [1, 2] ababab 00042 1024"
