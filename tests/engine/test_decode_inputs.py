"""The CUDA graphs' static inputs (DecodeInputs, here on the CPU): whatever graph shapes the steps before loaded into
the shared buffers, a step's load leaves exactly its batch and then padding requests in the graph's view, the MTP
graph's inputs likewise, and the batch `load` returns is the step's rows of that view."""

import random

import torch

from ds4.engine.cuda_graphs import DecodeInputs, GraphKey

PADDING_SLOT = 9


def _step(rng: random.Random, key: GraphKey, num_requests: int) -> tuple[list, ...]:
    """Host values of a step of num_requests requests for the graph of `key`, as build_step lays them out."""
    n = key.tokens_per_request
    context = [rng.randrange(1, 500) for _ in range(num_requests)]
    ids = [rng.randrange(1, 1000) for _ in range(num_requests * n)]
    positions = [c + i for c in context for i in range(n)]
    slots = rng.sample(range(PADDING_SLOT), num_requests)
    tables = []
    for _ in range(num_requests):
        pages = rng.randint(1, key.pages)
        tables += rng.sample(range(100), pages) + [-1] * (key.pages - pages)
    return ids, positions, context, slots, tables


def _padded_batch(key: GraphKey, ids, positions, context, slots, tables) -> dict[str, list]:
    """The padded batch the graph must read: the step's requests, then padding requests (token 0 at position 0,
    context length 0, the padding slot, no pages)."""
    pad = key.size - len(slots)
    return dict(
        input_ids=ids + [0] * pad * key.tokens_per_request,
        positions=positions + [0] * pad * key.tokens_per_request,
        query_start_loc=list(range(0, (key.size + 1) * key.tokens_per_request, key.tokens_per_request)),
        context_lens=context + [0] * pad,
        slots=slots + [PADDING_SLOT] * pad,
        block_tables=torch.tensor(tables + [-1] * pad * key.pages).view(key.size, key.pages).tolist(),
    )


def _values(batch) -> dict[str, list]:
    names = ("input_ids", "positions", "query_start_loc", "context_lens", "slots", "block_tables")
    return {name: getattr(batch, name).tolist() for name in names}


def test_each_load_leaves_its_batch_then_padding_whatever_was_loaded_before():
    inputs = DecodeInputs(16, 32, PADDING_SLOT, torch.device("cpu"), max_tokens_per_request=3)
    rng = random.Random(0)
    # Larger, then smaller batches; wider, then narrower block tables; 1 and 3 tokens a request; an empty step.
    steps = [
        (GraphKey(1, 4, 4), 3),
        (GraphKey(1, 16, 32), 9),
        (GraphKey(1, 4, 4), 2),
        (GraphKey(3, 8, 16), 5),
        (GraphKey(1, 4, 16), 4),
        (GraphKey(3, 2, 4), 1),
        (GraphKey(1, 16, 32), 0),
        (GraphKey(1, 1, 1), 1),
    ]
    for key, num_requests in steps:
        step = _step(rng, key, num_requests)
        batch = inputs.load(key, *step)
        expected = _padded_batch(key, *step)
        view = inputs.view(key)
        assert view.decode_only and view.tokens_per_request == key.tokens_per_request
        assert _values(view) == expected, key
        assert [t.dtype for t in (view.input_ids, view.positions)] == [torch.long] * 2
        assert [t.dtype for t in (view.context_lens, view.slots, view.block_tables)] == [torch.int32] * 3
        # The step's own rows, sharing the view's memory.
        t = num_requests * key.tokens_per_request
        assert batch.decode_only and batch.tokens_per_request == key.tokens_per_request
        assert batch.num_requests == num_requests and batch.num_tokens == t
        rows = {name: values[: num_requests + (name == "query_start_loc")] for name, values in expected.items()}
        rows["input_ids"], rows["positions"] = expected["input_ids"][:t], expected["positions"][:t]
        assert _values(batch) == rows
        assert batch.block_tables.untyped_storage().data_ptr() == view.block_tables.untyped_storage().data_ptr()


def test_each_draft_load_leaves_its_rows_then_padding_requests_drafting_from_their_first_row():
    inputs = DecodeInputs(8, 4, PADDING_SLOT, torch.device("cpu"), max_tokens_per_request=3)
    rng = random.Random(1)
    for key, num_requests in [(GraphKey(3, 8, 4), 7), (GraphKey(3, 2, 1), 1), (GraphKey(1, 4, 4), 3)]:
        n = key.tokens_per_request
        next_ids = [rng.randrange(1, 1000) for _ in range(num_requests * n)]
        last_rows = [r * n + rng.randrange(n) for r in range(num_requests)]
        inputs.load_draft(key, next_ids, last_rows)
        got_ids, got_rows = inputs.draft_view(key)
        assert got_ids.dtype == got_rows.dtype == torch.long
        assert got_ids.tolist() == next_ids + [0] * (key.size - num_requests) * n
        assert got_rows.tolist() == last_rows + [r * n for r in range(num_requests, key.size)]
