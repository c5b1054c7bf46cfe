"""benchmarks/bench_isolated.py's per-round ratios (the torch-per-round
column pairs each peer's round median with ours from the same round) and
its peak (the highest of the FMA probe's runs)."""
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench_isolated():
    path = os.path.join(ROOT, "benchmarks", "bench_isolated.py")
    spec = importlib.util.spec_from_file_location("bench_isolated", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_round_ratios_pair_the_same_round(bench_isolated):
    rounds = {"mha_ext": [1.0, 2.0, 4.0], "torch": [1.5, 2.0, 2.0]}
    assert bench_isolated.round_ratios(rounds, "torch") == [1.5, 1.0, 0.5]


def test_round_ratios_skip_a_failed_round_without_shifting(bench_isolated):
    # a failed worker keeps its round's place: the rounds after it stay paired
    rounds = {"mha_ext": [1.0, None, 4.0], "torch": [None, 3.0, 2.0]}
    assert bench_isolated.round_ratios(rounds, "torch") == [0.5]


def test_round_ratios_of_a_peer_that_never_ran(bench_isolated):
    assert bench_isolated.round_ratios({"mha_ext": [1.0]}, "ort") == []


def test_best_probe_takes_each_precision_highest(bench_isolated):
    # a probe run under load (the second) must not set the peak; f32 and
    # f64 each take their own highest run
    assert bench_isolated.best_probe([(180.0, 88.0), (94.9, 47.7), (176.0, 90.5)]) == (180.0, 90.5)
    assert bench_isolated.best_probe([]) is None


@pytest.fixture(scope="module")
def ort_bound():
    # it imports bench.py, which puts benchmarks/ and the root first on
    # sys.path: put it back as it was for the tests after these
    path = os.path.join(ROOT, "benchmarks", "ort_bound.py")
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("ort_bound", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = before
    return mod


def test_ort_bound_runs_the_cases_ort_runs(ort_bound, bench_isolated):
    # float32 forward without weights: every such case, nothing else
    assert ort_bound.cases() == ["tiny", "medium", "causal medium", "BERT", "large", "long"]


def test_ort_bound_counts_each_parts_work(ort_bound):
    # BERT: B 16, S 384, E 768, H 12; multiply-adds count 2
    rows, E = 16 * 384, 768
    assert ort_bound.part_flops("BERT", "qkv") == 2 * rows * E * 3 * E
    assert ort_bound.part_flops("BERT", "out") == 2 * rows * E * E
    # the whole call: four projections and the two products of attention
    assert ort_bound.part_flops("BERT", "call") == 8 * rows * E * E + 4 * rows * 384 * E


def test_ort_bound_names_the_cases_it_knows(ort_bound, capsys):
    with pytest.raises(SystemExit) as e:
        ort_bound.main(["--cases", "tiny,medium weights"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case 'medium weights'" in err and "causal medium" in err
