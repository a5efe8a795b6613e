"""Byte sizes read and written one way (engine/sizes.py): the options' parser and the reports' formatter."""
import pytest

from prefixrun.engine.errors import InvalidOption
from prefixrun.engine.sizes import human_bytes, parse_size


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1,023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (1000 * 1024, "1,000.0 KiB"),
    (114 << 20, "114.0 MiB"), (10 << 30, "10.0 GiB"), (3 << 40, "3.0 TiB"), (5000 << 40, "5,000.0 TiB"),
    (-2048, "-2.0 KiB"),
])
def test_human_bytes(n, text):
    # the largest binary unit below 1024 of the value, up to TiB (the cache's figures reached GiB only before)
    assert human_bytes(n) == text


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("2GB", 2 * 10 ** 9), ("1e9", 10 ** 9),
                                         (" 4 k ", 4096), ("10GiB", 10 << 30), ("0", 0)])
def test_parse_size(text, value):
    assert parse_size(text, "--x") == value


@pytest.mark.parametrize("text, message", [("lots", "not a size"), ("-1MiB", "must not be negative"),
                                           ("inf", "not a usable size"), ("nan", "not a usable size"),
                                           ("0.5", "is a fraction"), ("1.5", "not a whole number of bytes"),
                                           ("9e30", "not a usable size"), ("", "not a size")])
def test_parse_size_refuses_with_one_line(text, message):
    with pytest.raises(InvalidOption, match=message):
        parse_size(text, "--x")


def test_a_fraction_where_one_is_allowed_and_a_floor():
    assert parse_size("0.25", "--x", allow_fraction=True) == 0.25
    with pytest.raises(InvalidOption, match="too small"):
        parse_size("12", "--x", minimum=64)
