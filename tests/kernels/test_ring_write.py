"""Ring writes (interpreted on the CPU) against the index_put reference."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.ring_write


@pytest.fixture(scope="module")
def rw():
    return interpreted(ds4.kernels.ring_write, "_write_rings_kernel")


@pytest.mark.parametrize(
    "width,dtype,two", [(584, torch.uint8, False), (40, torch.float32, True), (7, torch.uint8, True)]
)
def test_matches_reference(rw, width, dtype, two):
    g = torch.Generator().manual_seed(width)

    def tensor(*shape):
        return torch.randint(0, 200, shape, generator=g).to(dtype)

    if two:  # the values row slices of one buffer, as a compressor's stacked projections give them
        values = tensor(4, 2 * width)
        rings = [(tensor(3, 5, width), values[:, :width]), (tensor(3, 5, width), values[:, width:])]
    else:
        rings = [(tensor(3, 5, width), tensor(4, width))]
    last = torch.tensor([2, 1, 2, 3])
    at = (torch.tensor([2, 0, 2, 1]), torch.tensor([4, 0, 4, 3]))  # slot 2 row 4 written twice, with one value
    want = [(ring.clone(), values) for ring, values in rings]
    rw.write_rings_reference(want, last, at)
    assert not torch.equal(want[0][0], rings[0][0])
    rw.write_rings_triton(rings, last, at)
    for (got, _), (ring, _) in zip(rings, want):
        assert torch.equal(got, ring)
