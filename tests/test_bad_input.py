"""Bad inputs to a Memory Layer get errors that name the problem."""

import pytest
import torch

from modeling_memoryformer import MemoryLayer


def test_hashed_rows_outside_the_tables_are_rejected():
    layer = MemoryLayer(16, 8, 4)  # 4 tables of 16 rows = 64 rows
    rows, scores = layer.hash(torch.randn(3, 16))
    with pytest.raises(ValueError, match="rows must index the 64 table rows"):
        layer(hashed=(rows + 64, scores))


def test_input_of_the_wrong_width_is_rejected():
    layer = MemoryLayer(16, 8, 4)
    with pytest.raises(ValueError, match="in_features=16"):
        layer(torch.randn(3, 12))
