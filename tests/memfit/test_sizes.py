import pytest

from memfit.errors import UserError
from memfit.sizes import format_bytes, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), (123456, 123456), ("64 kib", 65536),
    ("4096", 4096), ("2TiB", 2 * 2**40), ("1.5KiB", 1536),
])
def test_parse_size(text, expected):
    assert parse_size(text, "--f") == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "1.5.3GiB", "-1GiB", "0", "800MB", "2GB", True, None,
                                  "1e9"])
def test_parse_size_refuses_junk_and_decimal_units(text):
    with pytest.raises(UserError, match="activation_budget: .* is not a size"):
        parse_size(text, "activation_budget")


def test_format_bytes():
    assert format_bytes(3 * 2**29) == "1.5GiB" and format_bytes(512) == "512B"
