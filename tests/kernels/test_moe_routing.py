"""MoE routing: the reference against a per-token oracle, the routing kernel (interpreted) against the reference
under hash and score routing, each score function, expert parallelism, with the sort in the routing kernel, in the
group kernel and by torch; the group kernel against torch's stable sort; the slot sum with the shared expert and
the shared expert's SwiGLU against their torch references."""

import pytest
import torch
import torch.nn.functional as F
from interpreted import interpreted

import ds4.kernels.moe as moe_module
import ds4.kernels.moe_routing as routing_module
import ds4.kernels.swiglu as swiglu_module
from ds4.kernels.moe import combine_reference
from ds4.kernels.moe_routing import SCORE_FUNCS, group_by_expert, route_reference
from ds4.kernels.swiglu import swiglu

E, K, VOCAB = 12, 3, 40


def _case(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=gen) * 3
    logits[0, :2] = torch.tensor([25.0, -30.0])  # softplus's linear branch and a near-zero score
    bias = torch.randn(E, generator=gen) * 0.3
    tid2eid = torch.randint(0, E, (VOCAB, K), generator=gen)
    tid2eid[3] = 5  # a hash row that repeats an expert
    ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    ids[0] = 3
    return logits, bias, tid2eid, ids


def _oracle(logits, bias, hashed, score_func, scale, local):
    """Token by token, slot by slot: the highest score + bias not yet taken (or the hash row), weights from the
    scores, normalised unless softmax, then renumbered to this rank's experts."""
    weights, indices = [], []
    for t, row in enumerate(logits.tolist()):
        row = torch.tensor(row, dtype=torch.float32)
        scores = {"softmax": row.softmax(0), "sigmoid": row.sigmoid(), "sqrtsoftplus": F.softplus(row).sqrt()}
        s = scores[score_func]
        if hashed is None:
            free, chosen = (s + bias).tolist(), []
            for _ in range(K):
                chosen.append(max(range(E), key=lambda e: (free[e], -e)))
                free[chosen[-1]] = float("-inf")
        else:
            chosen = hashed[t].tolist()
        w = s[chosen]
        w = (w if score_func == "softmax" else w / w.sum()) * scale
        first, count = local or (0, E)
        own = [first <= e < first + count for e in chosen]
        weights.append([float(v) if o else 0.0 for v, o in zip(w, own)])
        indices.append([e - first if o else 0 for e, o in zip(chosen, own)])
    return torch.tensor(weights), torch.tensor(indices)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_reference_equals_the_per_token_oracle(score_func):
    logits, bias, tid2eid, ids = _case(7, 0)
    for hashed, local in ((None, None), (tid2eid[ids], None), (None, (4, 4))):
        routes = route_reference(logits, bias, hashed, K, score_func, 1.5, local)
        weights, indices = _oracle(logits, bias, hashed, score_func, 1.5, local)
        assert torch.equal(routes.indices, indices)
        torch.testing.assert_close(routes.weights, weights, rtol=1e-6, atol=1e-7)
        experts = routes.indices.reshape(-1)[routes.order]
        assert torch.equal(experts, experts.sort(stable=True).values)
        counts = torch.bincount(routes.indices.reshape(-1), minlength=(local or (0, E))[1])
        assert torch.equal(routes.bounds.diff(), counts.int()) and routes.bounds[0] == 0


@pytest.fixture(scope="module")
def kernels():
    return interpreted(routing_module, "_route_kernel")


@pytest.mark.parametrize(
    ("score_func", "hashed", "local", "tokens"),
    [
        ("sqrtsoftplus", False, None, 1),
        ("sqrtsoftplus", False, None, 9),
        ("sqrtsoftplus", True, None, 9),
        ("sqrtsoftplus", False, (4, 4), 9),
        ("sqrtsoftplus", True, (8, 4), 5),
        ("sigmoid", False, None, 6),
        ("softmax", True, None, 6),
    ],
)
@pytest.mark.parametrize("grouping", ["routing_kernel", "group_kernel", "torch"])
def test_interpreted_routing_equals_the_reference(kernels, monkeypatch, score_func, hashed, local, tokens, grouping):
    logits, bias, tid2eid, ids = _case(tokens, tokens)
    # the reference first: it groups through the module's group_by_expert, which counts torch's sorts below
    want = route_reference(
        logits, None if hashed else bias, tid2eid[ids] if hashed else None, K, score_func, 2.5, local
    )
    if grouping != "routing_kernel":  # tiles too small for the batch: token blocks, then a sort of their slots
        monkeypatch.setattr(kernels, "ROUTE_TILE", 16)
    if grouping == "torch":
        monkeypatch.setattr(kernels, "GROUP_MAX_SLOTS", tokens * K - 1)
    torch_sorts = []
    monkeypatch.setattr(kernels, "group_by_expert", lambda *args: torch_sorts.append(args) or group_by_expert(*args))
    got = kernels.route_triton(
        logits, None if hashed else bias, tid2eid if hashed else None, ids, K, score_func, 2.5, local
    )
    assert bool(torch_sorts) == (grouping == "torch" and tokens > 1)  # one token: one program whatever the tile
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(got.order.long(), want.order) and torch.equal(got.bounds, want.bounds)


@pytest.mark.parametrize(("tokens", "topk", "experts"), [(13, 3, (0, 4, 5, 11)), (16, 2, (7,)), (50, 6, (2, 3, 9))])
def test_interpreted_group_kernel_equals_torchs_stable_sort(kernels, tokens, topk, experts):
    """Many slots an expert, experts without slots (the first and the last too), slots a power of two or not."""
    gen = torch.Generator().manual_seed(tokens)
    indices = torch.tensor(experts)[torch.randint(0, len(experts), (tokens, topk), generator=gen)]
    order, bounds = kernels.group_by_expert_triton(indices, E)
    want_order, want_bounds = group_by_expert(indices, E)
    assert order.dtype == torch.int32 and torch.equal(order.long(), want_order)
    assert torch.equal(bounds, want_bounds)


@pytest.fixture(scope="module")
def moe_kernels():
    return interpreted(moe_module, "_combine_kernel", swiglu_module)


def test_interpreted_combine_and_swiglu_equal_their_references(moe_kernels):
    gen = torch.Generator().manual_seed(1)
    slots = torch.randn(5 * K, 40, generator=gen).bfloat16()
    shared = torch.randn(5, 40, generator=gen).bfloat16()
    for extra in (None, shared):  # fp32 out: the interpreter's bf16 stores truncate
        got = moe_kernels._combine(slots, K, extra, torch.float32)
        assert torch.equal(got, combine_reference(slots, K, extra, torch.float32))
    assert moe_kernels._combine(slots, K, shared, torch.bfloat16).dtype == torch.bfloat16
    gate, up = (torch.randn(4, 40, generator=gen) * 8).bfloat16(), (torch.randn(4, 40, generator=gen) * 8).bfloat16()
    for limit in (0.0, 7.0):
        got = interpreted(swiglu_module, "_swiglu_kernel").swiglu_triton(gate, up, limit, torch.float32)
        torch.testing.assert_close(got, swiglu(gate, up, limit), rtol=1e-6, atol=1e-6)
