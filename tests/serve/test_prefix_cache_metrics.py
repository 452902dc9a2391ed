"""/metrics exports the prefix cache's pages, hit rate and evictions from the engine's stats."""

from ds4.engine.engine import EngineStats
from ds4.serve.metrics import ServerMetrics


def test_prefix_cache_metrics_carry_the_engine_stats():
    stats = EngineStats(
        num_running=1,
        num_waiting=0,
        num_preemptions=0,
        num_pages=10,
        num_free_pages=7,
        capacity_tokens=160,
        prompt_tokens=300,
        generation_tokens=20,
        num_steps=9,
        num_finished=3,
        num_cached_pages=5,
        prefix_cache_queried_tokens=400,
        prefix_cache_hit_tokens=100,
        prefix_cache_evicted_pages=2,
    )
    lines = ServerMetrics(lambda: stats).render().decode().splitlines()
    values = {line.split()[0]: float(line.split()[1]) for line in lines if line and not line.startswith("#")}
    assert values["ds4_prefix_cache_pages"] == 5
    assert values["ds4_prefix_cache_hit_rate"] == 0.25
    assert values["ds4_prefix_cache_queries_total"] == 400
    assert values["ds4_prefix_cache_hits_total"] == 100
    assert values["ds4_prefix_cache_evictions_total"] == 2
