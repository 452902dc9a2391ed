"""Requests sharing one flat step (prefill chunks, decode tokens, multi-token verification) are independent."""

import torch
from dsv4_tiny import (
    ds4_model,
    max_rel_err,
    official_tensors,
    run_in_chunks,
    step_batch,
    tiny_config,
    transformers_model,
)


def test_mixed_steps_match_each_request_alone():
    cfg = tiny_config("mixed_hca8")
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (37, 26, 19)]
    alone = [
        run_in_chunks(model, model.new_cache(1, 3, 16), p, [len(p)], slot=0, table=torch.arange(3)) for p in prompts
    ]

    # Three requests in slots 2, 0, 1 with interleaved pages of one shared pool.
    slots = [2, 0, 1]
    tables = [torch.tensor([4, 0, 7]), torch.tensor([1, 6, 3]), torch.tensor([8, 2, 5])]
    cache = model.new_cache(3, 9, 16)
    # Per step: tokens each request contributes (0 = not scheduled). Request 0 prefills then decodes; request 1
    # arrives later in chunks; request 2 verifies several tokens at once, as for MTP.
    schedule = [(20, 9, 0), (1, 9, 5), (1, 8, 4), (12, 0, 4), (1, 0, 4), (2, 0, 2)]
    done = [0, 0, 0]
    logits = [[], [], []]
    for step in schedule:
        reqs = [r for r in range(3) if step[r]]
        batch = step_batch([(prompts[r][done[r] : done[r] + step[r]], done[r], slots[r], tables[r]) for r in reqs])
        out = model.compute_logits(model(batch, cache))
        for r, rows in zip(reqs, out.split([step[r] for r in reqs])):
            logits[r].append(rows)
            done[r] += step[r]
    assert done == [len(p) for p in prompts]
    for r in range(3):
        assert max_rel_err(torch.cat(logits[r]), alone[r]) <= 1e-5, f"request {r}"
