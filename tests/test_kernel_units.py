"""kernels/kernel_units.py: how each kernel file is split into compile units. Every instantiation a file exports is
compiled by exactly one unit of that file, each unit compiles the file's whole text, and a kernel no unit lists
(a non-template kernel, in every unit) is found in the first one; the helpers every unit compiles keep no shared
memory of their own."""
from __future__ import annotations

import math

from prefixrun.kernels import kernel_units
from prefixrun.kernels.kernel_units import KERNEL_NAMES, UNITS, UNITS_PER_FILE, kernel_source, unit_of, units_of


def test_every_instantiation_is_in_exactly_one_unit_of_its_file():
    for file, names in KERNEL_NAMES.items():
        listed = [n for unit in UNITS[file] for n in unit.names]
        assert sorted(listed) == sorted(names), file
        assert len(set(listed)) == len(listed), file
        for name in names:
            assert name in unit_of(file, name).names


def test_units_are_non_empty_balanced_and_named_apart():
    keys = [unit.key for units in UNITS.values() for unit in units]
    assert len(set(keys)) == len(keys)
    for file, units in UNITS.items():
        assert units and all(unit.names and unit.file == file for unit in units)
        assert [unit.index for unit in units] == list(range(len(units)))
        assert units[0].key == file  # a file of one unit keeps its name in reports
        largest = math.ceil(len(KERNEL_NAMES[file]) / len(units))
        assert max(len(unit.names) for unit in units) <= largest, file


def test_the_declared_splits_are_of_real_files_and_split_the_costly_ones():
    assert set(UNITS_PER_FILE) <= set(KERNEL_NAMES)
    for file in ("attention", "attention_q8", "delta_tc"):
        assert len(UNITS[file]) > 1, file
    assert len(units_of(KERNEL_NAMES)) == sum(len(u) for u in UNITS.values())


def test_a_name_no_unit_lists_is_looked_up_in_the_first_unit():
    assert unit_of("moe", "moe_some_extern_c_kernel") is UNITS["moe"][0]


def test_every_unit_compiles_its_file_s_whole_text():
    for file in KERNEL_NAMES:
        text = kernel_source(file)
        source = kernel_units._SOURCE_OF.get(file, file)
        assert (kernel_units._KERNEL_DIR / f"{source}.cu").read_text() in text
        assert (kernel_units._KERNEL_DIR / "common.cu").read_text() in text


def test_the_helper_files_every_unit_compiles_declare_no_shared_memory():
    """common.cu and tc_mma.cu go into many units: a __shared__ variable in one of their device functions would be
    one object for every kernel of a module that calls it, laid out with the module's other kernels, so a kernel's
    machine code would differ between a split unit and the whole file (tests/test_cuda_compile.py on the device).
    Kernels declare their shared memory themselves and pass it in."""
    import re

    for helper in ("common", "tc_mma"):
        text = (kernel_units._KERNEL_DIR / f"{helper}.cu").read_text()
        code = re.sub(r"//[^\n]*", "", text)
        assert "__shared__" not in code, helper
