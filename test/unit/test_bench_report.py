"""The benchmark report's comparison, prediction and compute-ratio tables, on rows whose
medians are known."""

import os
import time

import pytest

from robot_offload.bench.report import (comparison_table, compute_ratio_table, deadline_table,
                                        prediction_table, same_work_table)


def _rows():
    rows = []
    lat = {"local": [1.0, 1.2, 1.1], "full_offload": [0.5, 0.7, 0.6], "layer_partition": [0.4, 0.5, 0.45],
           "lop": [0.3, 0.36, 0.33]}
    for mode, values in lat.items():
        for i, v in enumerate(values):
            rows.append(dict(model="m", trace="const10M", mode_asked=mode, executed_mode=mode, lost=False,
                             latency_s=v, predicted_latency_s=(0.9 * v if mode in ("lop", "layer_partition")
                                                               else float("nan")),
                             plan=f"{mode}-plan", robot_compute_s=(v if mode == "local" else 0.01),
                             server_compute_s=(0.25 if mode == "full_offload" else 0.0)))
    rows.append(dict(model="m", trace="const10M", mode_asked="lop", lost=True))
    return rows


def test_comparison_ratios():
    table = comparison_table(_rows())
    row = [line for line in table.splitlines() if line.startswith("| m |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # modes sorted: full_offload, layer_partition, local, lop
    assert cells[2:6] == ["600", "450", "1100", "330"]
    assert cells[6] == "0.75"          # 450 / min(1100, 600)
    assert cells[7] == "0.73"          # 330 / 450
    assert cells[8] == "0.73"          # 330 / min(600, 450, 1100)
    assert cells[9] == "n/a"           # 3 frames: too few for an interval


def test_the_ratio_interval_pairs_frames_and_says_when_a_ratio_is_noise():
    import numpy as np
    from robot_offload.bench.report import paired_ratio_ci
    rng = np.random.default_rng(1)
    base = 0.030 * (1 + 0.4 * rng.random(40))       # a drifting machine: 30-42 ms frames

    def rows(values):
        return [dict(frame=i, latency_s=float(v)) for i, v in enumerate(values)]
    # 0.9x of the same frames: a tight interval around 0.9 (the pairing removes the drift)
    lo, hi = paired_ratio_ci(rows(0.9 * base), rows(base))
    assert 0.89 <= lo <= 0.9 <= hi <= 0.91, (lo, hi)
    # the same distribution, independent noise: the interval holds 1.0 and is wide
    lo, hi = paired_ratio_ci(rows(base), rows(0.030 * (1 + 0.4 * rng.random(40))))
    assert lo < 1.0 < hi and hi - lo > 0.05, (lo, hi)
    # only frames both modes ran count; fewer than 5: no interval
    assert all(np.isnan(paired_ratio_ci(rows(base[:4]), rows(base))))
    table = comparison_table([dict(model="m", trace="t", mode_asked=m, lost=False, frame=i,
                                   latency_s=float(v * (0.9 if m == "lop" else 1.0)))
                              for m in ("lop", "layer_partition") for i, v in enumerate(base)])
    row = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    lo, hi = map(float, row[-1].split("-"))
    assert row[-2] == "0.90" and lo <= 0.90 <= hi and hi - lo < 0.03, row


def test_prediction_error_and_plans():
    table = prediction_table(_rows())
    lop = [line for line in table.splitlines() if "| lop |" in line][0]
    cells = [c.strip() for c in lop.strip("|").split("|")]
    assert cells[2] == "3" and cells[5] == "10" and "lop-plan (3)" in cells[6]
    assert "| local |" not in table       # no prediction, no row


def test_same_work_table_compares_only_frames_that_ran_all_on_the_robot():
    rows = []
    for i in range(6):
        rows.append(dict(model="m", trace="t", mode_asked="local", executed_mode="local", lost=False,
                         latency_s=0.020, plan=""))
        rows.append(dict(model="m", trace="t", mode_asked="lop", executed_mode="lop", lost=False,
                         latency_s=0.022, plan="lop:cut=output (all on robot)"))
        rows.append(dict(model="m", trace="t", mode_asked="lop", executed_mode="lop", lost=False,
                         latency_s=0.090, plan="lop:cut=input (all on server) enc=raw/none"))
        rows.append(dict(model="m", trace="t", mode_asked="full_offload", executed_mode="full_offload",
                         lost=False, latency_s=0.300, plan="codec=raw/none"))
    # a fallback frame computed locally counts; two such frames are too few for a median
    rows += [dict(model="m", trace="t", mode_asked="full_offload", executed_mode="local", lost=False,
                  latency_s=0.5, plan="")] * 2
    table = same_work_table(rows)
    assert "| m | t | (2) | 20.0 (6) | 22.0 (6) | 1.10 |" in table, table
    assert same_work_table([r for r in rows if r["mode_asked"] != "lop"]).count("| m |") == 0


def test_compute_ratio():
    table = compute_ratio_table(_rows())
    assert "| m | 1100 | 250 | 4.40 |" in table


def test_side_cpus_split_robot_from_server():
    from robot_offload.bench.runner import side_cpus
    from robot_offload.errors import ConfigError
    assert side_cpus({3, 1, 2}) == {"robot": "1", "server": "2,3"}
    with pytest.raises(ConfigError):
        side_cpus({0})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_pinned_runner_starts_each_side_on_its_cpus(tmp_path):
    """--pin-cpus: the processes the benchmark starts on each side run under taskset on
    that side's CPUs (read back from the kernel)."""
    from robot_offload.bench.runner import BenchConfig, BenchRunner, side_cpus
    from robot_offload.testbed import Testbed
    runner = BenchRunner(BenchConfig(models=["resnet18"], modes=["local"], traces=["const:10"],
                                     out_dir=str(tmp_path), pin_cpus=True))
    runner._pins = side_cpus(os.sched_getaffinity(0))
    with Testbed(fallback=True) as tb:
        procs = {side: runner._run(tb, side, ["sleep", "30"]) for side in ("robot", "server")}
        try:
            for side, proc in procs.items():
                want = {int(c) for c in runner._pins[side].split(",")}
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:   # taskset and ip netns exec exec into sleep
                    with open(f"/proc/{proc.pid}/comm") as f:
                        if f.read().strip() == "sleep":
                            break
                    time.sleep(0.05)
                assert os.sched_getaffinity(proc.pid) == want, side
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()


def test_partition_report_agreement_inputs():
    """--inputs: noise is the registry's example input, natural the preprocessed
    natural_image of the same seed; a point-cloud model keeps its own input."""
    import torch
    from robot_offload.bench.partition_report import agreement_input
    from robot_offload.camera import natural_image
    from robot_offload.models import get_spec
    spec = get_spec("resnet18")
    noise = agreement_input(spec, (32, 32), 3, "noise")
    assert torch.equal(noise, spec.example_input((32, 32), seed=50_003))
    nat = agreement_input(spec, (32, 32), 3, "natural")
    assert nat.shape == noise.shape and not torch.equal(nat, noise)
    assert torch.equal(nat, spec.preprocess(natural_image(32, 32, seed=50_003), (32, 32)))
    agr = get_spec("agrnav")
    assert torch.equal(agreement_input(agr, agr.input_size, 1, "natural"),
                       agr.example_input(agr.input_size, seed=50_001))
    with pytest.raises(ValueError):
        agreement_input(spec, (32, 32), 0, "photos")


def test_replay_cost_measures_replayed_frames_against_full_offload():
    from robot_offload.bench import replay_cost
    r = replay_cost.measure("resnet18", "cpu", frames=5, warmup=4, input_size=(32, 32))
    assert r["replayed"] == 5 and r["round_trips"] <= 2
    assert r["replay_s"] > 0 and r["full_offload_s"] > 0


def test_replay_cost_refuses_an_unknown_model():
    from robot_offload.bench import replay_cost
    from robot_offload.errors import ConfigError
    with pytest.raises(ConfigError):
        replay_cost.main(["no_such_model"])


def test_the_oracle_picks_the_best_fixed_mode_per_window_of_the_trace():
    """Two fixed modes swap places after 2 s of the trace; auto follows one frame late.
    The per-window oracle takes each window's faster mode, the best fixed mode the faster
    one over the cell, and the ratios are the means' over the same frames."""
    from robot_offload.bench.report import oracle_latencies, oracle_table
    rows = []
    for i in range(40):
        t = 0.1 * i                                   # 10 frames per 1 s window
        fast_a = t < 2.0
        a, b = (0.010, 0.030) if fast_a else (0.050, 0.020)
        auto = (0.010 if i < 20 else 0.020) if i not in (20,) else 0.050   # one late frame
        for mode, v in (("local", a), ("full_offload", b), ("auto", auto)):
            rows.append(dict(model="m", trace="steps", mode_asked=mode, lost=False, frame=i,
                             trace_s=t, latency_s=v))
    rows.append(dict(model="m", trace="steps", mode_asked="auto", lost=True, frame=40))
    o = oracle_latencies([r for r in rows if not r.get("lost")])
    assert o["best_fixed_mode"] == "full_offload"     # mean 25 ms against local's 30
    assert [o["oracle"][i] for i in (0, 19, 20, 39)] == [0.010, 0.010, 0.020, 0.020]
    assert o["frame_min"] == o["oracle"]              # no noise: the two coincide here
    table = oracle_table(rows)
    row = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert row[:3] == ["m", "steps", "40"]
    mean_auto = (20 * 10 + 1 * 50 + 19 * 20) / 40   # ms
    assert row[3].startswith(f"{mean_auto:.1f} /")
    assert row[4] == "full_offload (25.0)" and row[5] == "15.0" and row[6] == "15.0"
    ratio, ci = row[8].split(" ", 1)
    assert ratio == f"{mean_auto / 15.0:.3f}"
    lo, hi = map(float, ci.strip("()").split("-"))
    assert lo <= float(ratio) <= hi
    # no auto in the cell, or no fixed mode: no row
    assert oracle_table([r for r in rows if r["mode_asked"] != "auto"]) == ""
    # by joules per inference: local costs 10x its latency in mJ, full offload 1x, so
    # the references follow the energy, not the latency
    for r in rows:
        if not r.get("lost"):
            r["energy_j"] = r["latency_s"] * (10.0 if r["mode_asked"] == "local" else 1.0)
    e = oracle_latencies([r for r in rows if not r.get("lost")], metric="energy_j")
    assert e["best_fixed_mode"] == "full_offload"
    assert [e["oracle"][i] for i in (0, 20)] == [0.030, 0.020]     # full offload in both windows
    energy_row = oracle_table(rows, metric="energy_j").splitlines()
    assert "mJ" in energy_row[0] and energy_row[2].split("|")[5].strip() == "full_offload (25.0)"


def test_auto_frames_have_a_prediction_row_per_candidate():
    rows = [dict(model="m", trace="t", mode_asked="auto", executed_mode="auto", lost=False, latency_s=0.1,
                 predicted_latency_s=0.08, plan="auto:lop lop:cut=x enc=raw/none"),
            dict(model="m", trace="t", mode_asked="auto", executed_mode="auto", lost=False, latency_s=0.05,
                 predicted_latency_s=0.05, plan="auto:full_offload_image input=frame uint8/none")]
    table = prediction_table(rows)
    lop = [c.strip() for c in next(line for line in table.splitlines() if "| auto:lop |" in line).strip("|").split("|")]
    img = [c.strip() for c in next(line for line in table.splitlines()
                                   if "| auto:full_offload_image |" in line).strip("|").split("|")]
    assert lop[2:6] == ["1", "80", "100", "20"] and img[2:6] == ["1", "50", "50", "0"]


def test_physical_limit_of_full_offload_frames():
    """Input and output at the trace's rate (less the shaper's bucket, 20 ms of the rate,
    which an idle link passes at line rate), the server's compute and one round trip: the
    frame's limit, and its latency over it, on constant-rate traces only."""
    from robot_offload.bench.report import add_physical_limits, physical_limit_check
    from robot_offload.testbed import traces as tr
    traces = {"const10M": tr.constant(10e6, 60.0), "outdoor": tr.outdoor(60.0)}
    rows = [dict(model="m", trace=trace, mode_asked="full_offload", executed_mode="full_offload", lost=False,
                 latency_s=lat, bytes_up=150_528, bytes_down=4000, server_compute_s=0.010, request_rtt_ms=2.0)
            for trace in traces for lat in (0.150, 0.200, 0.300)]
    rows.append(dict(model="m", trace="const10M", mode_asked="full_offload", executed_mode="local", lost=False,
                     latency_s=0.5, bytes_up=0, bytes_down=0, server_compute_s=0.0, request_rtt_ms=2.0))
    add_physical_limits(rows, traces)
    # 150528 bytes less the 25000-byte bucket at 10 Mbit/s = 100.4224 ms (the 4000 bytes
    # down fit in the bucket), + 10 ms server + 2 ms RTT
    limit = 0.1004224 + 0.010 + 0.002
    assert [r.get("physical_limit_s") for r in rows[:3]] == [pytest.approx(limit)] * 3
    assert rows[1]["latency_over_limit"] == pytest.approx(0.200 / limit)
    assert all("physical_limit_s" not in r for r in rows[3:])     # a varying rate; a local frame
    (line,) = physical_limit_check(rows, traces)
    assert line.startswith("ok: m @ const10M: 3 full_offload frames, min latency 150.0 ms >= input transfer 100.4 ms")
    assert "limit 112.4 ms (input 100.4 + server 10.0 + output 0.0 + RTT 2.0 ms)" in line
    assert "latency / limit 1.78 (min 1.33)" in line
    rows[0]["latency_s"] = 0.100                      # faster than its input can travel
    assert physical_limit_check(rows, traces)[0].startswith("FAIL")


def test_the_runs_client_settings_reach_the_client_as_a_parameter_file(tmp_path):
    """--objective, --no-hedge and --input-jpeg-quality become a client parameter file the
    client validates; a run with the defaults passes none."""
    import yaml
    from robot_offload.bench.runner import BenchConfig, BenchRunner
    from robot_offload.client import ClientConfig
    base = dict(models=["resnet18"], modes=["full_offload"], traces=["const:10"], out_dir=str(tmp_path))
    assert BenchRunner(BenchConfig(**base))._client_config() is None
    path = BenchRunner(BenchConfig(**base, objective="energy", hedge=False,
                                   input_jpeg_quality=90))._client_config()
    with open(path) as f:
        params = yaml.safe_load(f)
    assert params == {"objective": "energy", "hedge": False, "input_jpeg_quality": 90}
    ClientConfig(model="resnet18", **params).validate()
    with open(BenchRunner(BenchConfig(**base, objective="deadline", deadline_s=0.25))._client_config()) as f:
        params = yaml.safe_load(f)
    assert params == {"objective": "deadline", "deadline_s": 0.25}
    ClientConfig(model="resnet18", **params).validate()


def test_the_deadline_table_counts_the_frames_that_met_it():
    rows = [dict(model="m", trace="const10M", mode_asked=mode, latency_s=t, energy_j=e)
            for mode, t, e in (("local", 0.05, 1.0), ("local", 0.15, 1.0), ("auto", 0.08, 0.2),
                               ("auto", 0.09, 0.4), ("auto", 0.5, 0.0), ("auto", 0.07, 0.2))]
    rows.append(dict(rows[0], lost=True, latency_s=9.0))       # a lost frame is no sample
    table = deadline_table(rows, 0.1)
    assert table.splitlines()[0] == "| model | trace | auto met % / mJ | local met % / mJ |"
    assert table.splitlines()[2] == "| m | const10M | 75 / 200 | 50 / 1000 |"


def test_the_lossy_input_table_measures_bytes_and_output_error():
    """bench.lossy_input: JPEG frames smaller than the frame, with an output error above
    0 that grows as the quality falls."""
    from robot_offload.bench.lossy_input import measure, table
    rows = measure("resnet18", [50, 95], frames=3, width=48, height=48, input_size=(32, 32))
    low, high = rows
    assert low["ratio"] > high["ratio"] > 1
    assert low["error_median"] > high["error_median"] > 0
    assert 0 <= low["top1"] <= 3
    assert "| resnet18 | 95 |" in table(rows)
