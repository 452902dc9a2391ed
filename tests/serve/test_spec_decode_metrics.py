"""Speculative decoding counters in /metrics, checked against hand counts."""

from prometheus_client.parser import text_string_to_metric_families

from ds4.engine.engine import EngineStats
from ds4.engine.speculative import SpecDecodeStats
from ds4.serve.metrics import ServerMetrics


def _stats(spec):
    return EngineStats(1, 0, 0, 10, 5, 160, 100, 20, 7, 3, spec_decode=spec)


def _samples(metrics):
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_spec_decode_metrics_follow_the_counts():
    spec = SpecDecodeStats(3)
    for drafted, accepted in [(3, 2), (3, 0), (3, 3), (2, 1)]:
        spec.record(drafted, accepted)
    got = _samples(ServerMetrics(lambda: _stats(spec)))
    assert got[("ds4_spec_decode_num_drafts_total", ())] == 4
    assert got[("ds4_spec_decode_num_draft_tokens_total", ())] == 11
    assert got[("ds4_spec_decode_num_accepted_tokens_total", ())] == 6
    assert got[("ds4_spec_decode_mean_acceptance_length", ())] == 1 + 6 / 4
    per_position = [
        got[("ds4_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))] for j in range(3)
    ]
    assert per_position == [3, 2, 1]
    rates = [got[("ds4_spec_decode_acceptance_rate", (("position", str(j)),))] for j in range(3)]
    assert rates == [3 / 4, 2 / 4, 1 / 4]


def test_no_spec_decode_metrics_without_speculation():
    got = _samples(ServerMetrics(lambda: _stats(None)))
    assert not any(name.startswith("ds4_spec_decode") for name, _ in got)
    assert got[("ds4_generation_tokens_total", ())] == 20
