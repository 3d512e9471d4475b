"""scripts/bench_overlap.py's wall-clock summary, which the CPU wall-clock figures are read from."""
import statistics

from tests.scripts import load_script


def test_wall_takes_the_slowest_rank_and_pairs_neighbouring_steps():
    bench = load_script("bench_overlap")
    results = [  # two ranks, four timed steps each
        {"times": {"plain": [1.0, 2.0, 1.0, 1.0], "ours": [1.1, 1.9, 0.9, 1.0]}},
        {"times": {"plain": [1.2, 1.0, 1.0, 1.0], "ours": [1.0, 2.2, 1.0, 0.8]}},
    ]
    wall = bench._wall(results, ("plain", "ours"))
    assert wall["timed_steps"] == 4
    assert wall["step_times_s"] == {"plain": [1.2, 2.0, 1.0, 1.0], "ours": [1.1, 2.2, 1.0, 1.0]}
    ratios = [1.1 / 1.2, 2.2 / 2.0, 1.0, 1.0]
    assert wall["step_time_ratio_per_step"] == ratios
    assert wall["step_time_ratio_paired_median"] == statistics.median(ratios) == 1.0
    q1, q3 = wall["step_time_ratio_paired_quartiles"]
    assert 1.1 / 1.2 < q1 < 1.0 < q3 < 2.2 / 2.0


def test_wall_with_one_step_has_its_ratio_as_quartiles():
    wall = load_script("bench_overlap")._wall([{"times": {"plain": [2.0], "ours": [1.0]}}], ("plain", "ours"))
    assert wall["step_time_ratio_paired_median"] == 0.5
    assert wall["step_time_ratio_paired_quartiles"] == [0.5, 0.5]
