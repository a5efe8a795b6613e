"""Tokenizer layer: our encode/render/detokenize against transformers on a freshly trained tokenizer.

The parity tests need transformers (the `parity` extra) and are skipped without it; the rest runs anywhere.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.request import InvalidRequest, SamplingDefaults
from prefixrun.engine.load.tokenizer import GenerationDefaults, StreamDetokenizer, Tokenizer
from prefixrun.engine.load.tokenizer_maker import IM_END, default_corpus, write_tokenizer_files

VOCAB_SIZE = 512

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "Café naïve résumé — “quoted” … Zürich",
    "Emoji: 🙂👍🏽🚀 ❤️ 🇩🇪 and a family 👨‍👩‍👧",
    "日本語のテキスト, 中文, 한국어, Ελληνικά, русский",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> in the middle and a fake <|im_start special",
    "",
    "\n\n\n",
]

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Use <city> & 'country' names.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in français: é à ü 🙂"}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}],
    [{"role": "system", "content": "Use tools when useful."},
     {"role": "user", "content": "Weather in Zürich?"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "content": '{"temp_c": 3}'},
     {"role": "assistant", "content": "It is 3 °C in Zürich."}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(directory, VOCAB_SIZE, default_corpus())
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _load_hf(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _hf_chat_ids(hf, messages, **kw) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x returned a list."""
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"]) if not isinstance(out, list) else out


def _variant(model_dir: Path, target: Path, config_update: dict, drop_jinja: bool = False,
             post_processor=None) -> Path:
    """A copy of the trained model dir with tokenizer_config.json / tokenizer.json changed."""
    shutil.copytree(model_dir, target)
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config.update(config_update)
    config_file.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    if drop_jinja:
        (target / "chat_template.jinja").unlink()
    if post_processor is not None:
        backend = BackendTokenizer.from_file(str(target / "tokenizer.json"))
        backend.post_processor = post_processor
        backend.save(str(target / "tokenizer.json"))
    return target


# ---- (a) encode/decode parity ---------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_byte_level_round_trip_and_special_ids(tokenizer, model_dir):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.eos_token_id == tokenizer.token_to_id(IM_END)
    assert tokenizer.bos_token_id is None
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.encode("<|im_start|>") == [tokenizer.token_to_id("<|im_start|>")]


# ---- (b) chat rendering parity --------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_render_chat_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt, tools):
    ours = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools) == \
        _hf_chat_ids(hf_tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt)


@pytest.mark.parity
def test_sample_prompt_conversations_match_transformers(tokenizer, hf_tokenizer):
    sample_file = Path(__file__).resolve().parents[1] / "sample_prompts" / "multiturn_chat.jsonl"
    if not sample_file.is_file():
        pytest.skip("sample_prompts/ not present")
    for line in sample_file.read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        assert tokenizer.encode_chat(messages) == _hf_chat_ids(hf_tokenizer, messages, add_generation_prompt=True)


@pytest.mark.parity
def test_template_features_match_transformers(model_dir, tmp_path):
    """tojson without HTML escaping and with indent, loopcontrols, {% generation %}, extra kwargs and the
    special-token variables (including an undefined one) render as transformers renders them."""
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.role }}]{% endgeneration %}{{ m.content | tojson }}"
        "{% if loop.index == 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ {'k': '<&>', 'ü': [1, 2]} | tojson(indent=2) }}|{{ bos_token }}|{{ eos_token }}|{{ pad_token }}"
        "|{{ unk_token }}|{{ documents }}|{{ enable_thinking }}|{{ add_generation_prompt }}"
    )
    directory = _variant(model_dir, tmp_path / "features", {"chat_template": template}, drop_jinja=True)
    ours, hf = Tokenizer.from_model_dir(directory), _load_hf(directory)
    messages = [{"role": "user", "content": "a <b> & 'c'"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "é"}, {"role": "user", "content": "never"}]
    for kwargs in ({}, {"enable_thinking": False}, {"eos_token": "OVERRIDDEN"}):
        assert ours.render_chat(messages, add_generation_prompt=False, **kwargs) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kwargs)


# ---- (c) raise_exception and invalid messages ------------------------------------------------------------


def test_unknown_role_raises_invalid_request(tokenizer):
    with pytest.raises(InvalidRequest, match="Unknown message role: robot"):
        tokenizer.render_chat([{"role": "robot", "content": "beep"}])


def test_raise_exception_in_custom_template(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "strict",
                         {"chat_template": "{% if messages[0].role != 'user' %}"
                                           "{{ raise_exception('first message must be from the user') }}"
                                           "{% endif %}{{ messages[0].content }}"},
                         drop_jinja=True)
    strict = Tokenizer.from_model_dir(directory)
    assert strict.render_chat([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(InvalidRequest, match="first message must be from the user"):
        strict.render_chat([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize("messages, expected", [
    ([], "messages is empty"),
    ("hello", "messages must be a list"),
    (["hello"], r"messages\[0\] must be a \{role, content\} object"),
    ([{"content": "no role"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be a string or a list"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content is null"),
    ([{"role": "user", "content": ["text"]}], r"content\[0\] must be an object"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be a string"),
])
def test_invalid_messages_are_rejected(tokenizer, messages, expected):
    with pytest.raises(InvalidRequest, match=expected):
        tokenizer.render_chat(messages)


def test_non_text_parts_are_refused_before_the_template(tokenizer):
    """The engine is text-only: an image part is refused by the one message validator, whatever the template."""
    with pytest.raises(InvalidRequest, match='content\\[0\\].type "image" is not supported'):
        tokenizer.render_chat([{"role": "user", "content": [{"type": "image", "url": "x"}]}])


def test_tools_must_be_objects(tokenizer):
    with pytest.raises(InvalidRequest, match=r"tools\[0\] must be a tool object"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}], tools=["get_weather"])
    with pytest.raises(InvalidRequest, match="tools must be a list"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}], tools={"type": "function"})


# ---- (d) streaming detokenization -------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "Héllo 🙂 wörld! 日本語 👍🏽 naïve café ❤️ 🇩🇪 👨‍👩‍👧",
    "plain ascii only",
    "<|im_start|>assistant\nÜber 🙂<|im_end|>",
])
def test_stream_detokenizer_emits_only_complete_text(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = StreamDetokenizer(tokenizer)
    pieces = [stream.feed(token_id) for token_id in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == stream.text == tokenizer.decode(ids)
    assert stream.flush() == ""


def test_stream_detokenizer_splits_multibyte_characters(tokenizer):
    """With a 512-entry vocabulary an emoji spans several tokens; the detokenizer must hold it back."""
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1
    stream = StreamDetokenizer(tokenizer)
    assert [stream.feed(i) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]


def test_stream_detokenizer_flushes_incomplete_bytes(tokenizer):
    ids = tokenizer.encode("ok 🚀")
    stream = StreamDetokenizer(tokenizer)
    emitted = "".join(stream.feed(i) for i in ids[:-1])
    assert "\ufffd" not in emitted
    assert stream.flush().endswith("\ufffd")


def test_stream_detokenizer_keeps_special_tokens_when_asked(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>")
    stream = StreamDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream.feed(i) for i in ids) == "hi<|im_end|>"


# ---- (e) generation defaults ------------------------------------------------------------------------------


def test_generation_defaults_union_of_eos_and_do_sample(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "gen", {})
    (directory / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [2, 5], "do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "max_new_tokens": 100,
    }))
    defaults = GenerationDefaults.from_model_dir(directory, config_eos=7)
    assert defaults.eos_token_ids == (2, 5, 7)  # the tokenizer's eos (2) is already there
    assert defaults.sampling == SamplingDefaults(temperature=0.0, top_p=0.8, top_k=20, max_tokens=100)


def test_generation_defaults_sampling_and_config_eos_list(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "gen", {})
    (directory / "generation_config.json").write_text(json.dumps({
        "eos_token_id": 9, "do_sample": True, "temperature": 0.6, "min_p": 0.05}))
    defaults = GenerationDefaults.from_model_dir(directory, config_eos=[9, 11])
    assert defaults.eos_token_ids == (9, 11, 2)
    assert defaults.sampling == SamplingDefaults(temperature=0.6, min_p=0.05)
    assert defaults.sampling.max_tokens is None


def test_generation_defaults_without_file(model_dir, tmp_path):
    defaults = GenerationDefaults.from_model_dir(model_dir)
    assert defaults == GenerationDefaults(eos_token_ids=(2,))
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()  # no tokenizer, no config


@pytest.mark.parametrize("bad", [{"eos_token_id": "two"}, {"temperature": -1}, {"top_p": 1.5},
                                 {"max_new_tokens": 0}, {"top_k": 2.5}, {"do_sample": "no"}, {"do_sample": 2}])
def test_generation_defaults_reject_bad_values(tmp_path, bad):
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        GenerationDefaults.from_model_dir(tmp_path)


# ---- (f) deterministic files ------------------------------------------------------------------------------


def test_tokenizer_files_are_deterministic(tmp_path):
    corpus = default_corpus()
    first = write_tokenizer_files(tmp_path / "one", VOCAB_SIZE, corpus)
    second = write_tokenizer_files(tmp_path / "two", VOCAB_SIZE, corpus)
    assert first == second
    assert first["vocab_size_used"] <= VOCAB_SIZE
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_vocab_size_must_leave_room_for_bytes(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_tokenizer_files(tmp_path, 100, ["abc"])


def test_default_corpus_includes_builtin_text():
    corpus = default_corpus()
    assert corpus and all(isinstance(text, str) for text in corpus)
    assert any("🙂" in text for text in corpus)


# ---- (g) template sources and BOS handling ---------------------------------------------------------------


@pytest.mark.parity
def test_chat_template_list_in_tokenizer_config(model_dir, tmp_path):
    """A list of named templates: "default" normally, "tool_use" when tools are passed (transformers' choice)."""
    templates = [
        {"name": "default", "template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS={{ tools | tojson }}{% for m in messages %}{{ m.content }}"
                                         "{% endfor %}"},
    ]
    directory = _variant(model_dir, tmp_path / "named", {"chat_template": templates}, drop_jinja=True)
    ours, hf = Tokenizer.from_model_dir(directory), _load_hf(directory)
    messages = [{"role": "user", "content": "hello"}]
    assert ours.render_chat(messages) == "<user>hello"
    for tools in (None, TOOLS):
        assert ours.render_chat(messages, tools=tools) == \
            hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.encode_chat(messages, tools=tools) == \
            _hf_chat_ids(hf, messages, tools=tools, add_generation_prompt=True)


def test_chat_template_jinja_takes_precedence(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "both", {"chat_template": "FROM CONFIG"})
    assert Tokenizer.from_model_dir(directory).render_chat([{"role": "user", "content": "x"}]).startswith(
        "<|im_start|>user")


def test_no_chat_template_is_a_clear_error(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "none", {}, drop_jinja=True)
    with pytest.raises(InvalidRequest, match="no chat template"):
        Tokenizer.from_model_dir(directory).render_chat([{"role": "user", "content": "x"}])


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parity
def test_bos_is_not_doubled_in_chat(model_dir, tmp_path):
    """Llama/Gemma style: tokenizer.json's post-processor adds BOS, the template writes it too. Plain encode
    starts with one BOS; encode_chat must also start with exactly one."""
    bos = "<|endoftext|>"
    bos_id = BackendTokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(bos)
    adds_bos = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, bos_id)])
    directory = _variant(model_dir, tmp_path / "bos",
                         {"bos_token": bos, "add_bos_token": True, "chat_template": BOS_TEMPLATE},
                         drop_jinja=True, post_processor=adds_bos)
    ours, hf = Tokenizer.from_model_dir(directory), _load_hf(directory)
    assert ours.bos_token_id == bos_id
    assert ours.encode("hello") == hf.encode("hello")
    assert ours.encode("hello")[0] == bos_id
    messages = CONVERSATIONS[1]
    ids = ours.encode_chat(messages)
    assert ids == _hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert ids[0] == bos_id and ids[1] != bos_id


@pytest.mark.parity
def test_add_bos_token_flag_follows_transformers(model_dir, tmp_path):
    """transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists: only the
    post-processor decides. We must agree, or prompts would gain a BOS the model never saw."""
    directory = _variant(model_dir, tmp_path / "flag",
                         {"bos_token": "<|endoftext|>", "add_bos_token": True, "chat_template": BOS_TEMPLATE},
                         drop_jinja=True)
    ours, hf = Tokenizer.from_model_dir(directory), _load_hf(directory)
    assert ours.encode("hello") == hf.encode("hello")
    messages = CONVERSATIONS[0]
    assert ours.encode_chat(messages) == _hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert ours.encode_chat(messages).count(ours.bos_token_id) == 1


@pytest.mark.parity
def test_added_token_dicts_and_model_specific_tokens(model_dir, tmp_path):
    """Special tokens given as AddedToken dicts, and `*_token` keys such as image_token, reach the template."""
    directory = _variant(model_dir, tmp_path / "added", {
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "image_token": "<|im_start|>",
        "chat_template": "{{ bos_token }}|{{ image_token }}|{{ messages[0].content }}",
    }, drop_jinja=True)
    ours, hf = Tokenizer.from_model_dir(directory), _load_hf(directory)
    messages = [{"role": "user", "content": "x"}]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == "<|endoftext|>|<|im_start|>|x"


# ---- loading errors ----------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_malformed_tokenizer_config_names_the_file(model_dir, tmp_path):
    directory = _variant(model_dir, tmp_path / "broken", {})
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_model_dir(directory)


def test_invalid_template_syntax_fails_each_chat_request_not_the_load(model_dir, tmp_path, monkeypatch):
    """As transformers: the folder loads (plain prompts work), each chat request is refused naming the file."""
    directory = _variant(model_dir, tmp_path / "syntax", {})
    (directory / "chat_template.jinja").write_text("{% for m in messages %}")
    tok = Tokenizer.from_model_dir(directory)
    with pytest.raises(InvalidRequest, match="chat_template.jinja: chat template 'default' is not valid jinja"):
        tok.render_chat([{"role": "user", "content": "x"}])
    # compiled once: later chat lines get the same error without another compile
    import prefixrun.engine.load.chat_template as chat_template
    compiles = []
    real = chat_template._template_environment
    monkeypatch.setattr(chat_template, "_template_environment", lambda: compiles.append(1) or real())
    for _ in range(3):
        with pytest.raises(InvalidRequest, match="is not valid jinja"):
            tok.render_chat([{"role": "user", "content": "y"}])
    assert compiles == []
    assert tok.encode("plain prompt")
