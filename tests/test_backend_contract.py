"""The backend contract: the engine and the CLI talk to a backend only through the `Ops` protocol
(kernels/ops.py), so no code outside kernels/ may ask which backend it has."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ops.name / ops.xp / ops.<anything>.name-style backend sniffing, and hasattr probes on an ops object
_BACKEND_CHECK = re.compile(r"\bops\.(name|xp)\b|hasattr\(\s*[\w.]*ops\b|\bisinstance\([^)]*\b(NumpyOps|CudaOps)\b")


def test_no_backend_checks_outside_kernels():
    offenders = []
    for folder in ("engine", "cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if _BACKEND_CHECK.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "backend checks outside kernels/ (use the Ops protocol's queries):\n" + "\n".join(offenders)


def test_the_backend_check_pattern_catches_what_it_must():
    for bad in ('if ops.name == "cpu":', "free = ops.xp.cuda.runtime.memGetInfo()", 'hasattr(ops, "capture")',
                'hasattr(self.ops, "capture")', "isinstance(self.ops, CudaOps)"):
        assert _BACKEND_CHECK.search(bad), bad
    for fine in ("ops.free_memory()", "self.ops.display_name", "ops.can_capture_graphs", "tops.name_of"):
        assert not _BACKEND_CHECK.search(fine), fine


# ---- both backends conform to kernels/ops.py --------------------------------------------------------------------
import ast  # noqa: E402
import inspect  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from prefixrun.kernels.ops import Ops  # noqa: E402
from prefixrun.kernels.reference import NumpyOps  # noqa: E402


def _protocol_members() -> tuple[dict[str, inspect.Signature], set[str]]:
    """(methods -> signature, data attributes) that the Ops protocol declares."""
    methods = {n: inspect.signature(f) for n, f in vars(Ops).items() if inspect.isfunction(f) and not n.startswith("_")}
    attrs = {n for n in Ops.__annotations__ if not n.startswith("_")}
    return methods, attrs


def _params(sig: inspect.Signature) -> list[tuple]:
    """Parameter names, kinds and defaults (annotations are documentation, not contract)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _check_conforms(methods_of: dict[str, inspect.Signature], attrs_of: set[str]):
    methods, attrs = _protocol_members()
    missing = sorted(set(methods) - set(methods_of)) + sorted(attrs - attrs_of)
    assert not missing, f"backend lacks protocol members: {missing}"
    for name, sig in methods.items():
        assert _params(methods_of[name]) == _params(sig), f"{name}: {methods_of[name]} differs from Ops{sig}"


def test_protocol_declares_what_the_engine_needs():
    methods, attrs = _protocol_members()
    for needed in ("free_memory", "storage_dtype", "capture", "sample", "paged_attention", "gated_delta_rule"):
        assert needed in methods
    for needed in ("display_name", "can_capture_graphs", "default_block_size", "act_dtype"):
        assert needed in attrs


def test_reference_backend_conforms():
    ops = NumpyOps()
    methods = {n: inspect.signature(getattr(type(ops), n)) for n in dir(type(ops))
               if inspect.isfunction(getattr(type(ops), n, None))}
    _check_conforms(methods, set(dir(ops)))
    assert isinstance(ops, Ops)


def test_reference_backend_queries():
    ops = NumpyOps()
    assert ops.free_memory() is None and ops.default_block_size >= 1 and ops.display_name == "cpu"
    assert ops.storage_dtype("float32") == np.float32 and ops.storage_dtype("act") == np.float32
    with pytest.raises(ValueError, match="unknown state region dtype"):
        ops.storage_dtype("int4")
    ops.release_cached_memory()
    # capture's stand-in: replay reruns the function on the buffers it was given, updated in place between replays
    buf = ops.upload_index([1, 2, 3])
    graph = ops.capture(lambda b: ops.add(b, b), buf, warmup=0)
    ops.write_index(buf, [5, 6, 7])
    assert graph.replay().tolist() == [10, 12, 14]


def _cuda_class_statically() -> tuple[dict[str, inspect.Signature], set[str]]:
    """CudaOps' methods and attributes read from kernels/cuda.py's source, without importing CuPy: methods with
    their signatures (its own and its op-family bases', each read from the kernels/ module it is imported from),
    attributes from class-level assignments and `self.x = ...` in __init__."""
    methods, attrs = {}, set()
    _read_class_statically("cuda", "CudaOps", methods, attrs)
    return methods, attrs


def _read_class_statically(module: str, name: str, methods: dict, attrs: set):
    tree = ast.parse((ROOT / "kernels" / f"{module}.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    sources = {a.asname or a.name: node.module.rsplit(".", 1)[-1] for node in tree.body
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefixrun.kernels.")
               for a in node.names}
    for base in reversed(cls.bases):  # the first base wins, as in the method resolution order
        _read_class_statically(sources[base.id], base.id, methods, attrs)
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            # compile the bare signature (defaults are literals in this file) into a real function to inspect
            stub = ast.Module(body=[ast.FunctionDef(name=node.name, args=node.args, body=[ast.Pass()],
                                                    decorator_list=[], returns=None, type_params=[])],
                              type_ignores=[])
            ns: dict = {}
            exec(compile(ast.fix_missing_locations(stub), "cuda.py", "exec"), ns)
            methods[node.name] = inspect.signature(ns[node.name])
            if node.name == "__init__":
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                        for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                attrs.add(t.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    attrs.add(t.id)


def test_cuda_backend_conforms_statically():
    _check_conforms(*_cuda_class_statically())


@pytest.mark.gpu
def test_cuda_backend_conforms():
    from prefixrun.kernels import cuda_available

    if not cuda_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    from prefixrun.kernels.cuda import CudaOps

    ops = CudaOps("bfloat16")
    methods = {n: inspect.signature(getattr(type(ops), n)) for n in dir(type(ops))
               if inspect.isfunction(getattr(type(ops), n, None))}
    _check_conforms(methods, set(dir(ops)))
    assert isinstance(ops, Ops)
    free = ops.free_memory()
    assert isinstance(free, int) and free > 0 and ops.can_capture_graphs
    assert ops.storage_dtype("act").itemsize == 2 and ops.storage_dtype("float32") == np.float32


# ---- what the queries decide ------------------------------------------------------------------------------------
def test_default_max_batch_follows_state_memory():
    """--max-batch on a device: seats of two slots + 4096 tokens of K/V in the memory left after the checkpoint
    budget, a power of two in [1, 256]."""
    from prefixrun.engine.state.pools import RegionSpec, max_batch_for_memory, pool_unit_bytes

    ops = NumpyOps()
    specs = [RegionSpec("rec", False, (4, 16, 16), "float32"), RegionSpec("k", True, (2, 8), "act"),
             RegionSpec("v", True, (2, 8), "act")]
    slot, block = pool_unit_bytes(specs, ops, 16)
    seat = 2 * slot + (4096 // 16) * block
    fit = lambda n_seats: max_batch_for_memory(specs, ops, state_bytes=n_seats * seat + 4 * slot + 1000,
                                               checkpoint_bytes=1000, block_size=16)
    assert [fit(n) for n in (0, 1, 2, 3, 5, 64, 100, 10_000)] == [1, 1, 2, 2, 4, 64, 64, 256]
    # a model without K/V (all recurrent) pays only for its slots
    rec = specs[:1]
    assert max_batch_for_memory(rec, ops, state_bytes=2 * 40 * slot + 4 * slot, checkpoint_bytes=0,
                                block_size=16) == 32
