"""Train a small byte-level BPE tokenizer and write it as a Hugging Face model directory would hold it.

Tests and tiny random-weight models need a real tokenizer without downloading one. This writes the three files a
Qwen-style model ships (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) so that both prefixrun's
`Tokenizer` and transformers' `AutoTokenizer` load the same thing, which is what the parity tests compare.

Byte-level BPE (ByteLevel pre-tokenizer and decoder, no normalizer) maps every UTF-8 string to tokens and back
exactly, so emoji, accents and code survive a round trip even with a 512-entry vocabulary.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
MODEL_MAX_LENGTH = 32768

# Written by hand for prefixrun (not copied from a model repository). ChatML as the Qwen family uses it: every
# message is `<|im_start|>role\n...<|im_end|>\n`; tools are announced in the system turn as one JSON object per
# line; consecutive tool results are grouped into one user turn of <tool_response> blocks.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is none -%}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got a part of type ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more of these functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, answer with <tool_call></tool_call> tags around a JSON object '
        'with keys \"name\" and \"arguments\".<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('A system message may only be the first message') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + render_content(message.content) }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- if not loop.first or message.content %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The training text of every tokenizer this module makes by default, shipped inside the package (package data):
# one JSON string per line (the prompts and message contents of sample_prompts/ when it was written, plus prose,
# code and non-ASCII text). Reading it from the package, never from a folder beside the code, makes the default
# model identical whether prefixrun was installed from a wheel, a source tree or in editable mode.
CORPUS_FILE = "tokenizer_corpus.jsonl"


def default_corpus() -> list[str]:
    """The texts to train the default tokenizer on (the packaged tokenizer_corpus.jsonl)."""
    return [json.loads(line) for line in default_corpus_bytes().decode("utf-8").splitlines() if line.strip()]


def default_corpus_bytes() -> bytes:
    """The packaged corpus file as stored (the default model's name is derived from a digest of it)."""
    return resources.files("prefixrun.engine.load").joinpath(CORPUS_FILE).read_bytes()


def write_tokenizer_files(out_dir: Path, vocab_size: int, corpus: list[str]) -> dict:
    """Train byte-level BPE on `corpus` and write tokenizer.json, tokenizer_config.json and chat_template.jinja.

    The vocabulary holds at most `vocab_size` entries, counting the 256 byte symbols and the three special
    tokens, so `vocab_size` must leave room for them. Same inputs give byte-identical files (the trainer breaks
    ties deterministically and the JSON is written with a fixed layout), so fixtures can be cached by content.
    Returns the ids a model config needs: eos (`<|im_end|>`), pad (`<|endoftext|>`) and the size actually used.
    """
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(byte_alphabet) + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an integer >= {minimum} (256 bytes + {len(SPECIAL_TOKENS)} special "
                         f"tokens), got {vocab_size!r}")
    if not all(isinstance(text, str) for text in corpus):
        raise ValueError("corpus must be a list of strings")

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=sorted(byte_alphabet),
    )
    backend.train_from_iterator(corpus, trainer=trainer, length=len(corpus))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "tokenizer.json", backend.to_str(pretty=True) + "\n")

    special_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(special_ids[token]): {
                "content": token, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True,
            }
            for token in SPECIAL_TOKENS
        },
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": END_OF_TEXT,
        "split_special_tokens": False,
        "unk_token": None,
    }
    _write_text(out_dir / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    _write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    return {
        "eos_token_id": special_ids[IM_END],
        "pad_token_id": special_ids[END_OF_TEXT],
        "vocab_size_used": backend.get_vocab_size(with_added_tokens=True),
    }


def _write_text(path: Path, text: str) -> None:
    """UTF-8 with '\\n' line ends on every platform, so the files are byte-identical wherever they are made."""
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)
