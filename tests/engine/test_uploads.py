"""Host lists to device tensors (ds4.engine.uploads): the values and dtypes arrive, into fresh tensors or where
`views` of a given buffer find them, and on CUDA a copy still in flight is never overwritten by later uploads
through the same small ring (wrapping and growing)."""

import random

import pytest
import torch

from ds4.engine.uploads import Uploader, layout, pack, padded, upload, upload_into, views

DTYPES = (torch.int32, torch.long, torch.float32, torch.float64)


def _random_fields(rng: random.Random) -> list[tuple[list, torch.dtype]]:
    fields = []
    for _ in range(rng.randint(1, 4)):
        dtype = rng.choice(DTYPES)
        n = rng.randint(0, 40)
        values = (
            [rng.uniform(-1e3, 1e3) for _ in range(n)]
            if dtype.is_floating_point
            else rng.sample(range(-900_000, 900_000), n)
        )
        fields.append((values, dtype))
    return fields


def test_upload_on_cpu_gives_tensors_of_the_values():
    got = upload(torch.device("cpu"), ([3, -1, 7], torch.int32), ([0.5, 2.25], torch.float64), ([], torch.long))
    assert [t.dtype for t in got] == [torch.int32, torch.float64, torch.long]
    assert [t.tolist() for t in got] == [[3, -1, 7], [0.5, 2.25], []]
    fields = _random_fields(random.Random(1))
    for (values, dtype), tensor in zip(fields, upload(torch.device("cpu"), *fields)):
        assert tensor.dtype == dtype and tensor.tolist() == pytest.approx(values)


def test_pack_lays_out_each_field_as_torch_stores_it_aligned_and_apart():
    rng = random.Random(2)
    for _ in range(50):
        fields = _random_fields(rng)
        payload, starts = pack(fields)
        assert len(payload) % 16 == 0
        raw = torch.tensor(list(payload), dtype=torch.uint8)
        ends = [start + len(values) * dtype.itemsize for (values, dtype), start in zip(fields, starts)]
        assert all(start % 16 == 0 for start in starts) and all(e <= s for e, s in zip(ends, starts[1:]))
        for (values, dtype), start, end in zip(fields, starts, ends):
            assert torch.equal(raw[start:end].view(dtype), torch.tensor(values, dtype=dtype))


def test_upload_into_a_buffer_puts_each_field_where_its_view_finds_it():
    rng = random.Random(3)
    for _ in range(20):
        fields = _random_fields(rng) + [padded([5, -2], torch.int32, 7, -1)]
        sizes = [(len(values), dtype) for values, dtype in fields]
        buffer = torch.full((layout(sizes)[1] + 16,), 0xAB, dtype=torch.uint8)
        upload_into(buffer, *fields)
        for (values, dtype), tensor in zip(fields, views(buffer, sizes)):
            assert tensor.dtype == dtype and tensor.tolist() == pytest.approx(list(values))
    assert list(padded([5, -2], torch.int32, 4, -1)[0]) == [5, -2, -1, -1]


@pytest.mark.gpu
def test_uploads_in_flight_are_never_overwritten():
    rng = random.Random(0)
    uploader = Uploader(torch.device("cuda"), capacity=256)  # wraps every few uploads, grows for large ones
    sent, received = [], []
    torch.cuda._sleep(200_000_000)  # keep the stream busy, so the copies below are still queued as the ring turns
    for _ in range(200):
        fields = _random_fields(rng)
        sent.append(fields)
        if len(sent) % 2:
            received.append(uploader.upload(*fields))
        else:  # into a buffer of its own
            sizes = [(len(values), dtype) for values, dtype in fields]
            buffer = torch.empty(layout(sizes)[1], dtype=torch.uint8, device="cuda")
            uploader.upload_into(buffer, *fields)
            received.append(views(buffer, sizes))
    torch.cuda.synchronize()
    for fields, tensors in zip(sent, received):
        for (values, dtype), tensor in zip(fields, tensors):
            assert tensor.is_cuda and tensor.dtype == dtype and tensor.data_ptr() % 16 == 0
            assert torch.equal(tensor.cpu(), torch.tensor(values, dtype=dtype))
