"""The greedy argmax kernels (through the CPU interpreter, and on CUDA) against torch.argmax."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.argmax
from ds4.kernels.argmax import PART, PARTS_BLOCK

# one part; three; Flash's vocabulary (a last part of 256 columns); more parts than the second pass takes a step
COLUMNS = [300, PART, 3 * PART, 129280, PARTS_BLOCK * PART + 5]


@pytest.fixture(scope="module")
def kernels():
    return interpreted(ds4.kernels.argmax, "_part_kernel")


def tied_logits(rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """Rows whose largest value repeats: in two parts, twice in one part, in the last part and in a block of parts
    after the first; a row with NaNs (the largest for argmax: the first one's index), one of -inf only, one all
    equal, one of +inf and -inf."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=g)
    top = x.max() + 1
    for row in range(rows):
        picks = torch.randint(0, cols, (1 + row % 4,), generator=g)
        x[row, picks] = top
    if cols > PART:
        x[0, [PART + 3, PART - 1, cols - 1]] = top + 1  # across a part boundary and in the last part
    if cols > PARTS_BLOCK * PART:
        x[4, [PARTS_BLOCK * PART + 1, 7]] = top + 2  # the second pass's first and second blocks
    x[1, [cols // 2, cols - 1]] = float("nan")
    x[2] = float("-inf")
    x[3] = 0.25
    x[5, [cols // 3, cols - 1]] = float("inf")
    x[5, : cols // 3] = float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("cols", COLUMNS)
def test_interpreted_argmax_is_the_first_index_of_the_largest_value(kernels, cols):
    logits = tied_logits(7, cols)
    assert torch.equal(kernels.argmax_triton(logits), logits.argmax(dim=-1))
    assert torch.equal(kernels.argmax_triton(logits[2:6]), logits[2:6].argmax(dim=-1))  # rows of a larger tensor


def test_interpreted_argmax_of_bf16_rows_and_of_no_rows(kernels):
    logits = tied_logits(7, 3 * PART, torch.bfloat16)
    assert torch.equal(kernels.argmax_triton(logits), logits.argmax(dim=-1))
    assert kernels.argmax_triton(logits[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", COLUMNS)
def test_argmax_on_cuda_is_the_cpu_argmax(cols):
    logits = tied_logits(64, cols)
    assert torch.equal(ds4.kernels.argmax.argmax(logits.cuda()).cpu(), logits.argmax(dim=-1))
    assert torch.equal(ds4.kernels.argmax.argmax(logits[3:9].cuda()).cpu(), logits[3:9].argmax(dim=-1))
