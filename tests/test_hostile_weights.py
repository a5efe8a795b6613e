"""Weight files as whoever made them left them: every header field, the shard index and the stored dtypes are
checked at load, and each fault is one ModelLoadError naming the file and the tensor (never a traceback, never a
tensor read from another tensor's or the header's bytes, never a shard outside the model folder)."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from conftest import PARITY_STD, new_state, random_prompt
from prefixrun.engine.errors import ModelLoadError
from prefixrun.engine.load.model_maker import TINY_QWEN3_5, make_model_dir
from prefixrun.engine.models import load_model

SHARD = "model-00001-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("sharded"), TINY_QWEN3_5, seed=11, init_std=PARITY_STD, shards=2)


def _read(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _first_two(header):
    """The names of the shard's first two tensors in file order."""
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def _shift_back(header, a, b):
    start, end = header[a]["data_offsets"]
    header[a]["data_offsets"] = [start - 16, end - 16]  # 16 bytes of the header read as the tensor's


def _overlap(header, a, b):
    start, end = header[b]["data_offsets"]
    header[b]["data_offsets"] = [header[a]["data_offsets"][0], header[a]["data_offsets"][0] + end - start]


def _negative(header, a, b):
    start, end = header[b]["data_offsets"]
    header[b]["shape"] = [-header[b]["shape"][0]] + header[b]["shape"][1:]
    header[b]["data_offsets"] = [end, start]


def _set(key, value, which=0):
    def edit(header, a, b):
        header[(a, b)[which]][key] = value
    return edit


HEADER_FAULTS = {
    "data-before-the-data-section": (_shift_back, "data_offsets"),
    "overlapping-tensors": (_overlap, "overlap"),
    "negative-shape-and-size": (_negative, "shape must be a list of non-negative integers"),
    "offsets-of-three": (_set("data_offsets", [0, 1, 2]), "data_offsets"),
    "offsets-as-text": (_set("data_offsets", ["0", "8"]), "data_offsets"),
    "no-offsets": (_set("data_offsets", None), "data_offsets"),
    "shape-as-text": (_set("shape", "12"), "shape"),
    "shape-of-floats": (_set("shape", [512.0, 64.0]), "shape"),
    "dtype-a-list": (_set("dtype", ["F32"]), "dtype"),
    "entry-not-an-object": (lambda h, a, b: h.__setitem__(a, "x"), "header entry"),
    "metadata-a-list": (lambda h, a, b: h.__setitem__("__metadata__", [1]), "__metadata__"),
    "metadata-nested": (lambda h, a, b: h.__setitem__("__metadata__", {"format": {"pt": 1}}), "__metadata__"),
}


@pytest.mark.parametrize("fault", sorted(HEADER_FAULTS))
def test_a_hostile_header_field_is_one_line_naming_the_file(sharded, tmp_path, cpu_ops, fault):
    edit, message = HEADER_FAULTS[fault]
    bad = shutil.copytree(sharded, tmp_path / "bad")
    header, data = _read(bad / SHARD)
    edit(header, *_first_two(header))
    _write(bad / SHARD, header, data)
    with pytest.raises(ModelLoadError, match=message) as caught:
        load_model(bad, cpu_ops)
    assert SHARD in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("header", [[1, 2], 5, "text"])
def test_a_header_that_is_not_an_object_is_one_line(sharded, tmp_path, cpu_ops, header):
    bad = shutil.copytree(sharded, tmp_path / "bad")
    _write(bad / SHARD, header, _read(bad / SHARD)[1])
    with pytest.raises(ModelLoadError, match="corrupt safetensors header: a JSON"):
        load_model(bad, cpu_ops)


def test_a_header_length_past_the_end_of_the_file_is_named_once(sharded, tmp_path, cpu_ops):
    bad = shutil.copytree(sharded, tmp_path / "bad")
    raw = (bad / SHARD).read_bytes()
    (bad / SHARD).write_bytes(struct.pack("<Q", 50_000_000) + raw[8:])
    with pytest.raises(ModelLoadError) as caught:
        load_model(bad, cpu_ops)
    assert str(caught.value).count(SHARD) == 1 and "runs past the end of the file" in str(caught.value)


def _edit_index(model_dir, edit):
    index = json.loads((model_dir / INDEX).read_text())
    edit(index["weight_map"])
    (model_dir / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["absolute", "parent", "dot"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(sharded, tmp_path, cpu_ops, where):
    """A shard named by an absolute path or through `..` (transformers would read it) is refused: a model folder
    loads what it holds, never a file elsewhere."""
    bad = shutil.copytree(sharded, tmp_path / "bad")
    outside = {"absolute": str(sharded / SHARD), "parent": f"../{sharded.name}/{SHARD}", "dot": "."}[where]
    _edit_index(bad, lambda wm: wm.__setitem__(next(iter(wm)), outside))
    with pytest.raises(ModelLoadError, match="is not a file name inside"):
        load_model(bad, cpu_ops)


def test_an_index_placing_a_tensor_in_a_shard_that_lacks_it_is_one_line(sharded, tmp_path, cpu_ops):
    bad = shutil.copytree(sharded, tmp_path / "bad")
    header, data = _read(bad / SHARD)
    index = json.loads((bad / INDEX).read_text())["weight_map"]
    name = next(n for n, f in index.items() if f == SHARD and n != _first_two(header)[0])
    del header[name]
    _write(bad / SHARD, header, data)
    with pytest.raises(ModelLoadError, match=f"{name}.*places in this shard, is not in it"):
        load_model(bad, cpu_ops)


@pytest.mark.parametrize("kind", ["loop", "folder"])
def test_a_shard_that_is_no_regular_file_is_named_so(sharded, tmp_path, cpu_ops, kind):
    bad = shutil.copytree(sharded, tmp_path / "bad")
    (bad / SHARD).unlink()
    (bad / SHARD).symlink_to(SHARD) if kind == "loop" else (bad / SHARD).mkdir()
    with pytest.raises(ModelLoadError, match="is not a regular file"):
        load_model(bad, cpu_ops)


def test_a_shard_linked_as_the_hugging_face_cache_links_it_loads(sharded, tmp_path, cpu_ops):
    linked = shutil.copytree(sharded, tmp_path / "snapshot")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    os.replace(linked / SHARD, blobs / "0123abcd")
    (linked / SHARD).symlink_to(os.path.relpath(blobs / "0123abcd", linked))
    prompt = random_prompt(3, 20)
    logits = []
    for folder in (sharded, linked):
        model, _ = load_model(folder, cpu_ops)
        st = new_state(model, cpu_ops)
        logits.append(model.forward(st.prepare_step([st.new_sequence()], [prompt], prefill=True), st))
    np.testing.assert_array_equal(*logits)


@pytest.mark.parametrize("dtype", ["I16"])
def test_a_weight_stored_as_integers_is_refused(sharded, tmp_path, cpu_ops, dtype):
    """Integers of a float weight's size (transformers would cast them into the parameter: other numbers)."""
    bad = shutil.copytree(sharded, tmp_path / "bad")
    header, data = _read(bad / SHARD)
    name = _first_two(header)[0]
    header[name]["dtype"] = dtype
    _write(bad / SHARD, header, data)
    with pytest.raises(ModelLoadError, match=f"{name}.*a weight must be floating point"):
        load_model(bad, cpu_ops)
