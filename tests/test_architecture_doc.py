"""docs/ARCHITECTURE.md stays true to the tree: every path it names exists, every room of engine/ is described,
every module and CUDA source is named, and its lines are wrapped. The same path check holds docs/CACHE.md to the
tree."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
MAX_LINE = 120
# a path into the repository: a top folder, then names (a glob's * allowed), e.g. engine/load/config.py, kernels/*.cu
_PATH = re.compile(r"(?<![\w./-])((?:cli|engine|kernels|bench|tests|docs)/[\w*./-]*[\w*/])")
_BARE_MODULE = re.compile(r"`([a-z_0-9]+\.py)`")


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in _PATH.finditer(text)}


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    missing = [p for p in sorted(named_paths(text)) if not any(root.glob(p.rstrip("/")))]
    code = [p for folder in ("cli", "engine", "kernels") for p in (root / folder).rglob("*.py")]
    missing += [f"`{name}`" for name in sorted(set(_BARE_MODULE.findall(text))) if not any(p.name == name
                                                                                          for p in code)]
    return missing


@pytest.mark.parametrize("doc", ["docs/ARCHITECTURE.md", "docs/CACHE.md"])
def test_every_named_path_exists(doc):
    missing = missing_paths((ROOT / doc).read_text(encoding="utf-8"))
    assert not missing, f"{doc} names what the tree does not hold: {missing}"


def test_every_engine_room_is_described():
    text = ARCHITECTURE.read_text(encoding="utf-8")
    rooms = sorted(p.parent.name for p in (ROOT / "engine").glob("*/__init__.py"))
    assert len(rooms) >= 9
    undescribed = [room for room in rooms if f"`engine/{room}/`" not in text]
    assert not undescribed, f"engine/ sub-packages docs/ARCHITECTURE.md does not describe: {undescribed}"


def unnamed_modules(text: str, root: Path = ROOT) -> list[str]:
    """The modules and CUDA sources of cli/, engine/ and kernels/ (package __init__ files aside) the text names
    neither by path nor by their bare name in backquotes."""
    files = sorted(p for folder in ("cli", "engine", "kernels") for pattern in ("*.py", "*.cu")
                   for p in (root / folder).rglob(pattern) if p.name != "__init__.py")
    return [str(p.relative_to(root)) for p in files
            if str(p.relative_to(root)) not in text and f"`{p.name}`" not in text]


def test_every_module_is_named():
    unnamed = unnamed_modules(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not unnamed, f"modules docs/ARCHITECTURE.md does not name: {unnamed}"


def test_the_module_check_can_fail(tmp_path):
    (tmp_path / "kernels").mkdir()
    for name in ("ops.py", "conv.cu", "gone.cu", "__init__.py"):
        (tmp_path / "kernels" / name).write_text("")
    assert unnamed_modules("kernels/ops.py and `conv.cu`", tmp_path) == ["kernels/gone.cu"]


def test_lines_are_wrapped():
    long = [(n, len(line)) for n, line in enumerate(ARCHITECTURE.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, f"docs/ARCHITECTURE.md lines over {MAX_LINE} characters (line, length): {long}"


def test_the_path_check_can_fail(tmp_path):
    (tmp_path / "engine" / "load").mkdir(parents=True)
    (tmp_path / "engine" / "load" / "config.py").write_text("")
    text = "`engine/load/config.py`, engine/load/ and engine/load/*.py; engine/gone.py, `vanished.py`, `config.py`."
    assert missing_paths(text, tmp_path) == ["engine/gone.py", "`vanished.py`"]


def _rooms(text: str) -> dict[str, str]:
    """Each room's part of the Modules section, by the room its bold header names (`engine/load/`; `engine/` for
    the header of engine's own modules, `engine/request.py`, ...)."""
    heads = list(re.finditer(r"^\*\*`([a-z_/.]+)`", text, flags=re.M))
    parts = {}
    for head, after in zip(heads, heads[1:] + [None]):
        room = head.group(1) if head.group(1).endswith("/") else head.group(1).rsplit("/", 1)[0] + "/"
        parts[room] = parts.get(room, "") + text[head.start():after.start() if after else len(text)]
    return parts


def unplaced_modules(text: str, root: Path = ROOT) -> list[str]:
    """The modules and CUDA sources the text never names inside their own room's part (a module named only where
    another room's prose mentions it, e.g. a loader file only under engine/models/, is not placed)."""
    rooms = _rooms(text)
    files = sorted(p for folder in ("cli", "engine", "kernels") for pattern in ("*.py", "*.cu")
                   for p in (root / folder).rglob(pattern) if p.name != "__init__.py")
    unplaced = []
    for p in files:
        rel = p.relative_to(root)
        part = rooms.get("/".join(rel.parts[:-1]) + "/", "")
        if str(rel) not in part and f"`{p.name}`" not in part:
            unplaced.append(str(rel))
    return unplaced


def test_every_module_is_placed_in_its_room():
    unplaced = unplaced_modules(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not unplaced, f"modules docs/ARCHITECTURE.md names only outside their room's part: {unplaced}"


def test_the_placement_check_can_fail(tmp_path):
    (tmp_path / "engine" / "load").mkdir(parents=True)
    for name in ("mxfp4.py", "config.py"):
        (tmp_path / "engine" / "load" / name).write_text("")
    text = "**`engine/load/`** reading: `engine/load/config.py`.\n**`engine/models/`** gpt-oss: `engine/load/mxfp4.py`."
    assert unplaced_modules(text, tmp_path) == ["engine/load/mxfp4.py"]
