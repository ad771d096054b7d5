"""The fleet benchmark's arithmetic: per-robot and aggregate figures, fairness, accounting."""

import numpy as np
import pytest

from robot_offload.bench.fleet import percentile_ci, report_markdown, summarise


def _robot(name, latencies, offered, dropped, rate=4.0, local=0, pool=None):
    frames = [{"t": i * 0.25, "latency_s": s, "mode": "local" if i < local else "full_offload",
               "servers": ["/fleet/s0"], "hedged": 0, "hedge_won": 0, "failovers": 0, "bytes_up": 1}
              for i, s in enumerate(latencies)]
    return {"client_id": name, "rate_hz": rate, "offered": offered, "dropped": dropped, "frames": frames,
            "pool": pool or {"calls": len(latencies), "hedges": 0, "hedges_won": 0,
                             "hedge_bytes_up": 0, "failovers": 0}}


def test_percentile_interval_brackets_the_quantile():
    values = np.arange(1, 101) / 100.0
    q, lo, hi = percentile_ci(values, 0.5)
    assert lo <= q <= hi and 0.35 < lo < 0.5 < hi < 0.65
    assert all(np.isnan(percentile_ci([], 0.5)))


def test_summary_fairness_throughput_and_accounting():
    a = _robot("robot0", [0.1] * 40, offered=40, dropped=0, pool={"calls": 40, "hedges": 4, "hedges_won": 3,
                                                                  "hedge_bytes_up": 2_000_000, "failovers": 1})
    b = _robot("robot1", [0.2] * 30, offered=35, dropped=5, local=3)
    s = summarise([a, b], duration_s=10.0)
    t = s["total"]
    assert t["fps"] == pytest.approx(7.0) and t["offloaded_fps"] == pytest.approx(6.7)
    assert t["fairness"] == pytest.approx(2.0)
    assert t["accounted"] and t["local"] == 3
    assert t["hedge_share"] == pytest.approx(4 / 70) and t["hedge_mb_up"] == pytest.approx(2.0)
    # a robot whose frames do not add up is reported as such
    c = _robot("robot2", [0.1] * 10, offered=12, dropped=1)
    assert not summarise([a, c], 10.0)["total"]["accounted"]
    text = report_markdown(s, {"robots": 2, "servers": 1})
    assert "| robot1 | 4 | 35 | 30 | 5 | 3 |" in text and "fairness" in text
