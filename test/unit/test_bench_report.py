"""The benchmark report's comparison, prediction and compute-ratio tables, on rows whose
medians are known."""

from robot_offload.bench.report import comparison_table, compute_ratio_table, prediction_table


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


def test_prediction_error_and_plans():
    table = prediction_table(_rows())
    lop = [line for line in table.splitlines() if "| lop |" in line][0]
    cells = [c.strip() for c in lop.strip("|").split("|")]
    assert cells[2] == "3" and cells[5] == "10" and "lop-plan (3)" in cells[6]
    assert "| local |" not in table       # no prediction, no row


def test_compute_ratio():
    table = compute_ratio_table(_rows())
    assert "| m | 1100 | 250 | 4.40 |" in table
