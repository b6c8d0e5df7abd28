"""``device_batches``: the prefetching host→device loop of the feature and evaluation passes.

Its CUDA side (page-locked memory, a side stream) runs in tests/test_gpu.py; here the same loop
on the CPU, where a copy is a slice.
"""

from __future__ import annotations

import pytest
import torch

from starfed.shared.data.images import device_batches


@pytest.mark.parametrize("n, batch_size", [(0, 4), (3, 4), (8, 4), (10, 4), (5, 1)])
def test_every_image_comes_once_in_order(n: int, batch_size: int) -> None:
    images = torch.randint(0, 256, (n, 3, 2, 2), dtype=torch.uint8)
    batches = list(device_batches(images, batch_size, torch.device("cpu")))
    assert [len(b) for b in batches] == [min(batch_size, n - i) for i in range(0, n, batch_size)]
    assert torch.equal(torch.cat(batches) if batches else images, images)


def test_a_batch_size_below_one_is_an_error() -> None:
    images = torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(device_batches(images, 0, torch.device("cpu")))
