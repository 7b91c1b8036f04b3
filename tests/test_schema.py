"""tdstore._core.schema: from_schema's schema and batch size checked with no server (pure)."""

from __future__ import annotations

import pytest
import torch

from tdstore._core.schema import check_batch_size, parse_schema
from tdstore.errors import SchemaError


def test_a_schema_gives_its_entries_in_order():
    entries = parse_schema({"obs": ([84, 84, 3], torch.uint8), ("next", "done"): ((), torch.bool), "r": (torch.Size([]), torch.float32)})
    assert entries == [(("obs",), [84, 84, 3], torch.uint8), (("next", "done"), [], torch.bool), (("r",), [], torch.float32)]


@pytest.mark.parametrize(
    "schema, match",
    [
        ([("obs", ([1], torch.float32))], "schema must be a mapping"),
        ({3: ([1], torch.float32)}, "schema key 3"),
        ({"obs": [1]}, "schema entry 'obs' must be \\(shape, dtype\\)"),
        ({"obs": ([1], "float32")}, "schema entry 'obs': dtype must be a torch.dtype"),
        ({"obs": (5, torch.float32)}, "schema entry 'obs': shape must be a sequence of ints"),
        ({"obs": ([2, -1], torch.float32)}, "schema entry 'obs': shape must hold non-negative ints"),
        ({"obs": ([True], torch.float32)}, "schema entry 'obs': shape must hold non-negative ints"),
        ({"a": ([1], torch.float32), ("a", "b"): ([1], torch.float32)}, "schema key \\('a',\\) is both an entry and the parent"),
        ({"a": ([1], torch.float32), ("a",): ([1], torch.float32)}, "schema has duplicate keys"),
    ],
)
def test_a_bad_schema_names_the_key_and_what_was_expected(schema, match):
    with pytest.raises(SchemaError, match=match):
        parse_schema(schema)


def test_batch_sizes():
    assert check_batch_size([3, 0]) == torch.Size([3, 0])
    for bad, match in (([-1], "non-negative ints, got \\[-1\\]"), ("abc", "a sequence of non-negative ints"), ([1.5], "a sequence")):
        with pytest.raises(SchemaError, match=match):
            check_batch_size(bad)
