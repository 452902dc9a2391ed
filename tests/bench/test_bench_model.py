"""`ds4 bench model` end to end on the CPU with the tiny config and tiny lengths (a smoke test: no timings checked),
and how its device profile assigns kernel time to families."""

import json
import os
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch

from ds4.bench.profile import FAMILIES, family_ranges, profile_families, summarise
from ds4.cli import main


def test_bench_model_runs_end_to_end_on_dummy_weights(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    argv = ["bench", "model", "--load-format", "dummy", "--device", "cpu", "--context", "24"]
    argv += ["--batch-sizes", "1,3", "--prefill-lengths", "20,40", "--prefill-chunk", "16", "--decode-steps", "1"]
    argv += ["--json", str(out), "--plot", str(tmp_path / "decode.svg"), "--compare-transformers"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert [r["batch"] for r in result["decode"]] == [1, 3]
    assert [r["tokens"] for r in result["prefill"]] == [20, 40]
    for row in result["decode"]:
        assert row["context"] >= 24 and row["roofline_ms"] > 0 and row["ratio"] > 0
    weights = result["weights"]
    assert len(weights["resident_per_layer_gb"]) == len(weights["checkpoint_per_layer_gb"]) == 4
    for row in (result["decode"][-1], result["prefill"][0]):
        profile = row["profile"]
        assert set(profile) == {*FAMILIES, "total"}
        for family, kernels in row["profile_kernels"].items():  # each family's launches, by kernel
            assert sum(k["launches"] for k in kernels.values()) == profile[family]["kernels"]
        assert sum(profile[f]["ms"] for f in FAMILIES) == pytest.approx(profile["total"]["ms"])
        assert profile["GEMMs"]["ms"] > 0 and profile["MoE"]["ms"] > 0 and profile["attention"]["ms"] > 0
    routing = result["prefill"][0]["routing"]  # the tiny model: 2 score layers of 8 experts, 2 a token
    assert routing["score_layers"] == 2 and routing["rows_per_expert"] == pytest.approx(20 * 2 / 8)
    assert routing["max_over_mean"] >= 1 and routing["spread_over_balanced"] >= 0
    assert "rows an expert" in printed
    touched = [r["routing"]["experts_touched"] for r in result["decode"]]  # one token picks 2 distinct experts
    assert touched[0] == 2 and 2 <= touched[1] <= 6 and "touched in one decode step" in printed
    assert [r["batch"] for r in result["transformers"]["decode"]] == [1, 3]
    assert "ms/step" in printed and "x roofline" in printed and "transformers DeepseekV4" in printed
    assert (tmp_path / "decode.svg").read_text().startswith("<svg")


def test_bench_model_names_published_figures_for_the_shipped_configs():
    from ds4.bench.model import PUBLISHED

    sources = [entry[-1] for entries in PUBLISHED.values() for entry in entries]
    assert "SGLang DSv4 benchmark docs" in sources and "LMSYS blog, 2026-04-25" in sources


def test_device_profile_counts_each_kernel_once_and_unclaimed_triton_kernels_by_module():
    """Kernels an op launched go to the op's family; kernels no op claims (Triton's driver-API launches) go to
    the family of the ds4.kernels module defining a Triton kernel of that name, others to "other"."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def kernel(name, us):
        return SimpleNamespace(name=name, duration=us)

    def device(name, us):
        return SimpleNamespace(name=name, device_type=cuda, time_range=SimpleNamespace(elapsed_us=lambda: us))

    attention = SimpleNamespace(name="ds4::attention", cpu_parent=None, kernels=[])
    bmm = SimpleNamespace(name="aten::bmm", device_type=cpu, cpu_parent=attention, kernels=[kernel("gemm", 30.0)])
    # What torch.profiler records on an H200: the first launch of a kernel lists it again under a loading
    # event inside the op, and each family range also spans the device timeline.
    loading = SimpleNamespace(name="Lazy Function Loading", device_type=cpu, cpu_parent=bmm, kernels=bmm.kernels)
    events = [
        SimpleNamespace(name="ds4::attention", device_type=cpu, cpu_parent=None, kernels=[]),
        bmm,
        loading,
        device("ds4::attention", 5000.0),
        device("gemm", 30.0),
        device("_grouped_gemm_kernel", 500.0),
        device("_act_quant_kernel", 20.0),
        device("some_library_kernel", 7.0),
        device("_grouped_gemm_kernel", 300.0),
    ]
    by_kernel, launches, kernel_launches = defaultdict(Counter), Counter(), defaultdict(Counter)
    times = summarise(events, True, by_kernel, launches, kernel_launches)
    assert by_kernel == {
        "attention": {"gemm": pytest.approx(0.030)},
        "MoE": {"_grouped_gemm_kernel": pytest.approx(0.800)},
        "GEMMs": {"_act_quant_kernel": pytest.approx(0.020)},
        "other": {"some_library_kernel": pytest.approx(0.007)},
    }
    assert launches == {"attention": 1, "MoE": 2, "GEMMs": 1, "other": 1}
    assert kernel_launches == {
        "attention": {"gemm": 1},
        "MoE": {"_grouped_gemm_kernel": 2},
        "GEMMs": {"_act_quant_kernel": 1},
        "other": {"some_library_kernel": 1},
    }
    assert times["attention"] == pytest.approx(0.030)
    assert times["MoE"] == pytest.approx(0.800)
    assert times["GEMMs"] == pytest.approx(0.020)
    assert times["other"] == pytest.approx(0.007)
    assert times["total"] == pytest.approx(0.857)


def test_bench_model_on_two_ranks_reports_collective_bytes_per_step(tmp_path, capsys):
    from ds4.checkpoint.tiny import make_tiny
    from ds4.config import load_config
    from ds4.distributed.parallel import ParallelConfig
    from ds4.distributed.traffic import decode_step_traffic, forward_traffic

    config = make_tiny(tmp_path / "tiny", config_overrides={"o_groups": 4})
    out = tmp_path / "bench.json"
    argv = ["bench", "model", "--load-format", "dummy", "--config", str(config), "--device", "cpu", "--context", "24"]
    argv += ["--batch-sizes", "2", "--prefill-lengths", "20", "--prefill-chunk", "16", "--decode-steps", "2"]
    argv += ["--tensor-parallel-size", "2", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["tensor_parallel_size"] == 2
    decode, prefill = result["decode"][0], result["prefill"][0]
    assert prefill["steps"] == 2  # 20 tokens in chunks of 16
    for row in (decode, prefill):
        assert set(row["collective_bytes_per_step"]) == {"all_reduce", "all_gather", "reduce_scatter"}
        assert row["step_message_bytes_per_step"] > 0
    # Against the byte count from the config (ds4.distributed.traffic; fp32 activations on the CPU): a decode step
    # of 2 tokens with 2 logit rows; the prefill's chunks of 16 tokens (no logits: mid-prompt) and 4 (1 row).
    cfg, two = load_config(config), ParallelConfig(2)
    assert decode["collective_bytes_per_step"] == decode_step_traffic(cfg, two, 2, act_bytes=4).payload
    prefill_total = forward_traffic(cfg, two, 16, 0, act_bytes=4) + forward_traffic(cfg, two, 4, 1, act_bytes=4)
    assert prefill["collective_bytes_per_step"] == {k: n / 2 for k, n in prefill_total.payload.items()}
    assert "KB per step" in capsys.readouterr().out


def test_collectives_run_in_the_communication_range_and_are_restored_after():
    from torch.profiler import ProfilerActivity, profile

    from ds4.distributed.parallel import Parallel

    model = torch.nn.Linear(2, 2)
    model.compute_logits = lambda hidden: hidden
    original = Parallel.all_reduce
    with family_ranges(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        Parallel.single().all_reduce(torch.ones(4))
    assert "ds4::communication" in {event.name for event in prof.events()}
    assert Parallel.all_reduce is original


@pytest.mark.parametrize(
    "flag,module,setting,variable,key",
    [
        ("--serial", "ds4.model.side_stream", "OVERLAP", "DS4_SIDE_STREAM", "side_stream"),
        ("--no-pdl", "ds4.kernels._device", "DEPENDENT_LAUNCH", "DS4_PDL", "dependent_launch"),
    ],
)
def test_bench_model_times_the_step_without_an_overlap(tmp_path, monkeypatch, flag, module, setting, variable, key):
    """--serial: the side stream's work runs on the main stream; --no-pdl: no launch starts before the one before it
    ends. Each in this process and in the ranks' processes (which inherit the variable), and the report says so."""
    import importlib

    holder = importlib.import_module(module)
    monkeypatch.setattr(holder, setting, True)
    monkeypatch.setenv(variable, "1")
    out = tmp_path / "bench.json"
    argv = ["bench", "model", "--load-format", "dummy", "--device", "cpu", "--context", "8", "--no-profile"]
    argv += ["--batch-sizes", "1", "--prefill-lengths", "8", "--decode-steps", "1", flag, "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())[key] is False
    assert os.environ[variable] == "0" and getattr(holder, setting) is False
    if flag == "--serial":
        assert holder.SideStream(torch.device("cuda")).stream is None  # no CUDA stream is made for it


def test_profiles_launch_in_order_and_restore_the_setting(monkeypatch):
    """A profiled run sees dependent launch off (a kernel launched early would count its wait as its own time);
    the setting is back as it was afterwards, also when the run raises."""
    from ds4.kernels import _device

    monkeypatch.setattr(_device, "DEPENDENT_LAUNCH", True)
    model = torch.nn.Linear(2, 2)
    model.compute_logits = lambda hidden: hidden
    seen = []
    profile_families(model, lambda: seen.append(_device.DEPENDENT_LAUNCH), torch.device("cpu"))
    assert seen == [False] and _device.DEPENDENT_LAUNCH is True

    def failing():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError):
        profile_families(model, failing, torch.device("cpu"))
    assert _device.DEPENDENT_LAUNCH is True


def test_routing_balance_counts_the_rows_each_expert_gets():
    """A router that sends every token to experts 0 and 1 of 8 (a bias that dwarfs its zero logits): rows an
    expert T / 4 on average, the largest 4x that, spread the std of [T, T, 0 x 6] over a balanced draw's; a rank
    holding only some experts (expert parallel) gets None."""
    from ds4.bench.model import routing_balance
    from ds4.checkpoint.tiny import tiny_config
    from ds4.model.moe import Gate

    cfg = tiny_config()
    gate = Gate(cfg, hashed=False, device=torch.device("cpu"), dtype=torch.float32)
    gate.weight.zero_()
    gate.bias.copy_(torch.tensor([5.0, 4.0] + [0.0] * 6))
    model = torch.nn.ModuleDict({"gate": gate})
    t = 100
    x, ids = torch.randn(t, cfg.hidden_size), torch.zeros(t, dtype=torch.long)
    got = routing_balance(model, lambda: gate(x, ids))
    rows = torch.tensor([t, t] + [0] * 6, dtype=torch.float64)
    assert got["score_layers"] == 1 and got["rows_per_expert"] == pytest.approx(t / 4)
    assert got["max_over_mean"] == pytest.approx(4.0) and got["experts_touched"] == 2
    assert got["spread_over_balanced"] == pytest.approx(rows.std().item() / (2 * t / 8 * 7 / 8) ** 0.5)
    assert routing_balance(model, lambda: gate(x, ids, slice(0, 4))) is None


def test_finite_logits_flag_ands_every_unpaused_step():
    from ds4.bench.model import _FiniteLogits

    logits = {"value": torch.zeros(2, 5)}
    model = SimpleNamespace(embed=SimpleNamespace(weight=torch.zeros(1)), compute_logits=lambda h: logits["value"])
    finite = _FiniteLogits(model)
    model.compute_logits(None)
    assert finite.ok()
    logits["value"] = torch.tensor([[0.0, float("inf")]])
    with finite.paused():  # the timed decode steps: not checked
        model.compute_logits(None)
    assert finite.ok()
    model.compute_logits(None)
    assert not finite.ok()
    logits["value"] = torch.zeros(1, 3)
    model.compute_logits(None)
    assert not finite.ok()  # a non-finite step stays reported
    logits["value"] = torch.tensor([[float("nan")]])
    nan_check = _FiniteLogits(model)
    model.compute_logits(None)
    assert not nan_check.ok()


def test_the_moe_s_dense_products_count_as_gemms_and_are_restored_after():
    """The router's product and the shared expert's down projection (Linear.gated: no forward hook) read dense
    weights, whose bytes the GEMMs' roofline counts: their ops run in the GEMMs range inside the MoE's, whatever
    kernel serves them (cuBLAS at 64 tokens put them in the MoE's before); the routed experts stay MoE."""
    from torch.profiler import ProfilerActivity, profile

    import ds4.model.moe as moe_module
    from ds4.checkpoint.tiny import tiny_config
    from ds4.model.linear import Linear
    from ds4.model.moe import MoE

    cfg = tiny_config()
    layer = MoE(cfg, hashed=False, dtype=torch.float32, device=torch.device("cpu"))
    for p in layer.parameters():
        p.normal_(0, p.shape[-1] ** -0.5)
    layer.compute_logits = lambda hidden: hidden
    product, gated = moe_module.fp32_product, Linear.gated
    x, ids = torch.randn(3, cfg.hidden_size), torch.zeros(3, dtype=torch.long)
    with family_ranges(layer), profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x, ids)
    by_kernel = defaultdict(Counter)
    summarise(prof.events(), False, by_kernel)
    parents = Counter()
    for event in prof.events():
        if event.name == "ds4::GEMMs":
            parents[event.cpu_parent.name if event.cpu_parent else None] += 1
    # w13 (a module call), w2.gated and the router's product, each a GEMMs range inside the MoE's (on the CPU
    # gated calls the layer itself, a GEMMs range inside its own)
    assert parents["ds4::MoE"] == 3
    assert by_kernel["GEMMs"] and by_kernel["MoE"]
    assert moe_module.fp32_product is product and Linear.gated is gated
