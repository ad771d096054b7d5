"""Predictors, the passive estimator and predictor evaluation (pure)."""

import math

import pytest

from robot_offload import bandwidth as bw
from robot_offload.testbed import traces

pytestmark = pytest.mark.robot_side


def feed(p, values):
    for i, v in enumerate(values):
        p.update(0.1 * i, v)
    return p.predict()


def test_predictors_before_any_sample_return_none():
    for p in bw.default_predictors():
        assert p.predict() is None, p.name


def test_last_value():
    assert feed(bw.LastValue(), [1e6, 5e6, 3e6]) == 3e6


def test_ewma_hand_computed():
    # 10 -> 10 + .5 * (20 - 10) = 15 -> 15 + .5 * (40 - 15) = 27.5
    assert feed(bw.Ewma(0.5), [10, 20, 40]) == pytest.approx(27.5)
    with pytest.raises(ValueError):
        bw.Ewma(0)


def test_harmonic_mean_window():
    # last 3 of [100, 10, 20, 40]: 3 / (1/10 + 1/20 + 1/40) = 17.142857
    assert feed(bw.HarmonicMean(3), [100e3, 10e3, 20e3, 40e3]) == pytest.approx(
        3 / (1 / 10e3 + 1 / 20e3 + 1 / 40e3))


def test_harmonic_mean_survives_zero():
    assert feed(bw.HarmonicMean(2), [0.0, 1e6]) == pytest.approx(
        2 / (1 / bw.RATE_FLOOR_BPS + 1 / 1e6))


def test_median_and_log_ewma():
    assert feed(bw.MedianOfN(3), [5, 100, 1, 7]) == 7
    # log-EWMA with alpha 1/2 of 1e6 and 4e6 is their geometric mean
    assert feed(bw.LogEwma(0.5), [1e6, 4e6]) == pytest.approx(2e6)


def test_ar1_recovers_mean_reversion():
    # noise-free AR(1): x[k+1] = 10 + .8 x[k]; the fit must find a = 10, b = .8
    x, seq = 100.0, []
    for _ in range(30):
        seq.append(x)
        x = 10 + 0.8 * x
    p = bw.Ar1(n=30)
    assert feed(p, seq) == pytest.approx(10 + 0.8 * seq[-1], rel=1e-6)
    assert feed(bw.Ar1(n=30, min_fit=10), [5.0] * 20) == 5.0  # flat window


def test_reset_forgets():
    p = bw.HarmonicMean(3)
    feed(p, [1, 2, 3])
    p.reset()
    assert p.predict() is None


def test_passive_estimator_ignores_small_and_corrects_rtt():
    est = bw.PassiveEstimator(bw.LastValue())
    assert est.add(bw.TransferSample(1.0, 1000, 0.01)) is None  # < 16 KB
    assert est.ignored == 1
    # 1 MB in 0.1 s with no RTT known: 80 Mbit/s
    assert est.add(bw.TransferSample(2.0, 1_000_000, 0.1)) == pytest.approx(80e6)
    # same transfer with a 20 ms RTT taken off: 1e6 * 8 / 0.08 = 100 Mbit/s
    assert est.add(bw.TransferSample(3.0, 1_000_000, 0.1), rtt_s=0.02) == pytest.approx(100e6)
    assert est.predict_bps() == pytest.approx(100e6)
    # latency-bound: the RTT eats more than 90 % of the duration
    assert est.add(bw.TransferSample(4.0, 100_000, 0.01), rtt_s=0.0095) is None
    e = est.estimate(4.0)
    assert e.measured_bps == pytest.approx(100e6) and e.source == "passive"
    assert e.predictor == "last"


def test_passive_estimator_ignores_a_burst_shorter_than_min_duration():
    """A token bucket passes its burst at line rate: 200 KB through a 100 Mbit/s shaper
    holding 20 ms of the rate (250 KB) arrives in ~2 ms and would read 800 Mbit/s. A burst
    only raises an estimate that is below its floor (its bytes in min_duration_s)."""
    est = bw.PassiveEstimator(bw.LastValue())
    assert est.min_duration_s == bw.MIN_TRANSFER_S == 0.005
    # A transfer that outlasts the burst shows the rate: 2.5 MB in 100 ms = 200 Mbit/s.
    assert est.add(bw.TransferSample(1.0, 2_500_000, 0.100)) == pytest.approx(200e6)
    # 100 KB in 2 ms reads 400 Mbit/s, a burst; its floor (160 Mbit/s) is below: ignored.
    assert est.add(bw.TransferSample(2.0, 100_000, 0.002)) is None
    # The RTT is taken off first: 10 ms less 6 ms of RTT is 4 ms on the link, a burst too.
    assert est.add(bw.TransferSample(3.0, 100_000, 0.010), rtt_s=0.006) is None
    assert est.predict_bps() == pytest.approx(200e6) and est.ignored == 2
    # A burst whose floor is above the estimate raises it to the floor: 200 KB -> 320 Mbit/s.
    assert est.add(bw.TransferSample(4.0, 200_000, 0.002)) == pytest.approx(320e6)
    # The estimate of a slower link before: a 150 KB camera image in 3 ms lifts 5 Mbit/s.
    slow = bw.PassiveEstimator(bw.LastValue())
    assert slow.add(bw.TransferSample(1.0, 1_250_000, 2.0)) == pytest.approx(5e6)
    assert slow.add(bw.TransferSample(2.0, 150_000, 0.003)) == pytest.approx(240e6)
    # 0 turns the check off (the 16 KB and latency-bound checks stay).
    assert bw.PassiveEstimator(min_duration_s=0).measure(
        bw.TransferSample(0, 200_000, 0.002)) == pytest.approx(800e6)
    with pytest.raises(ValueError):
        bw.PassiveEstimator(min_duration_s=-1)


def test_passive_estimator_uses_base_rtt_not_queue_inflated_rtt():
    est = bw.PassiveEstimator()
    est.observe_rtt(0.02)
    est.observe_rtt(0.10)  # 0.02 + (0.10 - 0.02) / 8 = 0.03
    assert est.srtt_s == pytest.approx(0.03)
    assert est.min_rtt_s == pytest.approx(0.02)
    # 100 kB in 0.12 s, less the base RTT of 0.02 s: 800 kbit / 0.1 s
    assert est.measure(bw.TransferSample(0, 100_000, 0.12)) == pytest.approx(8e6)
    with pytest.raises(ValueError):
        est.observe_rtt(-1)
    assert bw.PassiveEstimator().estimate(0).source == "none"


def test_evaluate_predictors_exact_on_a_step():
    t = traces.Trace([10e6] * 5 + [20e6] * 5, 0.1, "step")
    rows = {r["predictor"]: r for r in bw.evaluate_predictors(t, [bw.LastValue()])}
    r = rows["last"]
    # 9 forecasts one step ahead; only the one made at sample 4 (10 -> 20) is wrong
    assert r["n"] == 9
    assert r["mae_bps"] == pytest.approx(10e6 / 9)
    assert r["rmse_bps"] == pytest.approx(math.sqrt((10e6) ** 2 / 9))
    assert r["mape_pct"] == pytest.approx(100 * 0.5 / 9)
    assert r["bias_bps"] == pytest.approx(-10e6 / 9)


def test_evaluate_horizon_and_mape_floor():
    t = traces.Trace([0.0, 0.0, 5e6, 5e6], 0.1)
    (r,) = bw.evaluate_predictors(t, [bw.LastValue()], horizon_s=0.2)
    assert r["n"] == 2 and r["mape_n"] == 2
    (r,) = bw.evaluate_predictors(t, [bw.LastValue()], horizon_s=0.1)
    assert r["mape_n"] == 2  # the instant whose actual is 0 is left out of MAPE
    with pytest.raises(ValueError):
        bw.evaluate_predictors(t, [bw.LastValue()], horizon_s=1.0)


def test_best_predictor_on_the_synthetic_traces():
    trs = [traces.indoor(), traces.outdoor()]
    scored, rows = bw.score_predictors(trs, metric="mae_bps")
    assert len(rows) == 2 * len(bw.default_predictors())
    best = bw.best_predictor(trs)
    assert best.name == scored[0][1].name and best.predict() is None
    by_name = {p.name: s for s, p in scored}
    # heavy smoothing lags the outdoor fades: the winner beats it
    assert by_name[best.name] < by_name["harmonic(5)"]
    assert by_name[best.name] < by_name["ewma(0.3)"]
    with pytest.raises(ValueError):
        bw.score_predictors(trs, metric="nope")


def test_make_predictor_from_names():
    assert isinstance(bw.make_predictor(), bw.LastValue)
    assert isinstance(bw.make_predictor("default"), bw.LastValue)
    assert isinstance(bw.PassiveEstimator().predictor, bw.LastValue)
    # the MPC convention and the burst-discounting Kalman level are selectable by name
    assert isinstance(bw.make_predictor("kalman"), bw.KalmanLevel)
    assert bw.make_predictor("harmonic(5)").name == "harmonic(5)"
    assert bw.make_predictor("kalman(0.3)").q == 0.3
    assert bw.make_predictor("kalman(0.1)").name == "kalman"
    assert bw.make_predictor("ewma(0.3)").alpha == 0.3
    assert bw.make_predictor("harmonic( 4 )").n == 4
    assert bw.make_predictor("log-ewma").name == "log-ewma(0.5)"
    # every default predictor's printed name builds the same predictor
    for p in bw.default_predictors():
        assert bw.make_predictor(p.name).name == p.name
    with pytest.raises(ValueError, match="known: default, ar1, ewma"):
        bw.make_predictor("lstm")
    with pytest.raises(ValueError, match="takes no argument"):
        bw.make_predictor("last(3)")
    with pytest.raises(ValueError, match="bad predictor"):
        bw.make_predictor("ewma(2)")
    with pytest.raises(ValueError, match="bad predictor"):
        bw.make_predictor("harmonic(x)")


def test_a_frame_gives_a_transfer_only_when_its_one_call_finished():
    from robot_offload.stats import FrameStats
    s = FrameStats()
    s.add_call(0.0, 0.2, 0.05, 100_000, 4_000)
    s.executed_mode = "full_offload"
    sample = bw.frame_transfer(s, 10.0)
    assert sample == bw.TransferSample(t_s=10.0, bytes=104_000, duration_s=s.transfer_s)
    s.executed_mode = "local"            # a hedge the robot answered: the call never finished
    assert bw.frame_transfer(s, 10.0) is None
    s.executed_mode = "lop"
    s.add_call(0.2, 0.3, 0.01, 1_000, 1_000)    # two requests overlapping the robot's work
    assert bw.frame_transfer(s, 10.0) is None


def test_a_hedge_started_by_a_stalled_upload_measures_the_upload_so_far():
    """The robot answered because the link had faded under the upload: the bytes
    acknowledged by then, over that time, are a sample of the link (so the estimate
    follows the fade), from a ``FrameStats`` and from a message's ``detail_json`` alike."""
    import json
    from types import SimpleNamespace

    from robot_offload.stats import FrameStats
    s = FrameStats()
    s.add_call(0.0, 0.4, 0.0, 150_000, 0)
    s.executed_mode = "local"
    upload = {"acked_bytes": 5_000, "of_bytes": 150_000, "after_ms": 400.0, "rate_bps": 80_000}
    s.extra["hedge"] = {"robot_started_after_ms": 400.0, "won": "local", "upload": upload}
    assert bw.frame_transfer(s, 10.0) == bw.TransferSample(t_s=10.0, bytes=5_000, duration_s=0.4, acked=True)
    row = SimpleNamespace(round_trips=1, transfer_s=0.4, executed_mode="local", bytes_up=150_000,
                          bytes_down=0, detail_json=json.dumps({"hedge": s.extra["hedge"]}))
    assert bw.frame_transfer(row, 10.0).bytes == 5_000
    for bad in ({"acked_bytes": 0, "after_ms": 400.0}, {"acked_bytes": 5_000}, "x",
                {"acked_bytes": "many", "after_ms": 1}):
        s.extra["hedge"] = {"won": "local", "upload": bad}
        assert bw.frame_transfer(s, 10.0) is None, bad
    # an estimator fed such frames follows the fade once a second one agrees: counted by
    # TCP acknowledgements, they show a rate under MIN_TRANSFER_BYTES too (a call's
    # per-call costs are not in them), where a finished transfer that small is ignored
    est = bw.PassiveEstimator(bw.LastValue())
    assert est.add(bw.TransferSample(t_s=1.0, bytes=1_500_000, duration_s=0.12)) == pytest.approx(100e6)
    faded = dict(upload, acked_bytes=20_000, after_ms=200.0)   # 0.8 Mbit/s
    s.extra["hedge"] = {"won": "local", "upload": faded}
    est.add(bw.frame_transfer(s, 2.0))
    assert est.predict_bps() == pytest.approx(100e6)           # one is held
    est.add(bw.frame_transfer(s, 3.0))
    assert est.predict_bps() == pytest.approx(0.8e6)
    assert est.add(bw.TransferSample(t_s=4.0, bytes=20_000, duration_s=0.2)) is None   # not by acks
    # a stalled answer: the bytes received since its first, over that time
    answer = {"received_bytes": 30_000, "of_bytes": 2_000_000, "after_ms": 900.0, "for_ms": 300.0,
              "rate_bps": 800_000}
    s.extra["hedge"] = {"won": "local", "download": answer}
    assert bw.frame_transfer(s, 5.0) == bw.TransferSample(t_s=5.0, bytes=30_000, duration_s=0.3, acked=True)
    s.extra["hedge"] = {"won": "local", "download": dict(answer, for_ms=None)}
    assert bw.frame_transfer(s, 5.0) is None
    # the late rule started the robot while the upload was still under way: its bytes so far
    s.extra["hedge"] = {"won": "local", "upload_under_way": dict(upload, acked_bytes=50_000, after_ms=80.0)}
    assert bw.frame_transfer(s, 6.0) == bw.TransferSample(t_s=6.0, bytes=50_000, duration_s=0.08, acked=True)


def test_a_frame_beside_background_work_gives_only_a_floor_of_the_rate():
    from types import SimpleNamespace

    from robot_offload.stats import FrameStats
    s = FrameStats()
    s.add_call(0.0, 0.2, 0.05, 100_000, 4_000)
    s.executed_mode = "full_offload"
    assert not bw.frame_transfer(s, 10.0).floor_only
    s.extra["background"] = True          # the client marks such frames (client._run)
    assert bw.frame_transfer(s, 10.0).floor_only

    def msg(detail_json):                  # an InferenceStats message, a bench row
        return SimpleNamespace(round_trips=1, transfer_s=0.1, executed_mode="auto", bytes_up=150_528,
                               bytes_down=4_000, detail_json=detail_json)
    assert bw.frame_transfer(msg('{"auto": {"x": 1}, "background": true}'), 1.0).floor_only
    for text in ("{}", "", '{"background": false}', '{"note": "\\"background\\""}', '{"background": tr',
                 '["background"]', None):
        assert not bw.frame_transfer(msg(text), 1.0).floor_only, text


def test_a_floor_only_transfer_raises_the_estimate_but_never_lowers_it():
    est = bw.PassiveEstimator(bw.LastValue(), min_duration_s=0.0)
    # the first transfer of all: nothing to compare with, its rate is the best there is
    assert est.add(bw.TransferSample(1.0, 1_000_000, 0.8, floor_only=True)) == pytest.approx(1e7)
    assert est.add(bw.TransferSample(2.0, 1_000_000, 0.2)) == pytest.approx(4e7)
    # stalled on the robot: 1 MB in 0.8 s says the link does at least 10 Mbit/s
    assert est.add(bw.TransferSample(3.0, 1_000_000, 0.8, floor_only=True)) is None
    assert est.predict_bps() == pytest.approx(4e7)
    assert est.ignored == 1
    # ... and one of 0.1 s, that it does at least 80: more than the estimate
    assert est.add(bw.TransferSample(4.0, 1_000_000, 0.1, floor_only=True)) == pytest.approx(8e7)
    assert est.predict_bps() == pytest.approx(8e7)
    # a clean transfer lowers it at once, by up to half
    assert est.add(bw.TransferSample(5.0, 1_000_000, 0.2)) == pytest.approx(4e7)


def test_a_clean_transfer_far_below_the_estimate_lowers_it_only_when_the_next_agrees():
    est = bw.PassiveEstimator(bw.LastValue(), min_duration_s=0.0)
    est.add(bw.TransferSample(1.0, 1_000_000, 0.08))                      # 100 Mbit/s
    # one transfer stalled (a GC pause, a radio's retries): 20 Mbit/s, alone
    assert est.add(bw.TransferSample(2.0, 1_000_000, 0.4)) is None
    assert est.predict_bps() == pytest.approx(1e8)
    assert est.last_measured_bps == pytest.approx(2e7)       # measured all the same
    assert est.add(bw.TransferSample(3.0, 1_000_000, 0.09)) == pytest.approx(8e6 / 0.09)
    # a real drop: the second transfer far below confirms it, and the latest is fed (the
    # first, 20 Mbit/s, straddled the change)
    assert est.add(bw.TransferSample(4.0, 1_000_000, 0.4)) is None
    assert est.add(bw.TransferSample(5.0, 1_000_000, 2.0)) == pytest.approx(4e6)
    assert est.predict_bps() == pytest.approx(4e6)
    # with drops_to_lower=1 every clean transfer counts at once, as with no rule
    est = bw.PassiveEstimator(bw.LastValue(), min_duration_s=0.0, drops_to_lower=1)
    est.add(bw.TransferSample(1.0, 1_000_000, 0.08))
    assert est.add(bw.TransferSample(2.0, 1_000_000, 0.4)) == pytest.approx(2e7)
    with pytest.raises(ValueError, match="drop_fraction"):
        bw.PassiveEstimator(drop_fraction=0)


def test_a_floor_only_transfer_teaches_no_burst():
    est = bw.PassiveEstimator(bw.LastValue(), burst="learn")
    for i in range(8):     # pairs of different sizes close in time: what the burst learns from
        est.add(bw.TransferSample(0.1 * i + 0.05, 600_000 if i % 2 else 150_000,
                                  0.2 if i % 2 else 0.06, floor_only=True))
    assert est.burst._prev is None and not est.burst._pairs and not est.burst._sized
    est.add(bw.TransferSample(1.0, 150_000, 0.06))
    assert est.burst._prev is not None      # a clean one would have


def test_floor_only_transfers_below_the_estimate_lower_it_to_their_highest_once_three_agree():
    est = bw.PassiveEstimator(bw.LastValue(), min_duration_s=0.0)
    est.add(bw.TransferSample(1.0, 1_000_000, 0.08))                      # 100 Mbit/s
    # the link fell to ~5 Mbit/s while the robot planned: every frame is floor-only
    assert est.add(bw.TransferSample(2.0, 1_000_000, 1.6, floor_only=True)) is None
    assert est.add(bw.TransferSample(3.0, 1_000_000, 2.0, floor_only=True)) is None
    assert est.predict_bps() == pytest.approx(1e8)
    assert est.add(bw.TransferSample(4.0, 1_000_000, 1.7, floor_only=True)) == pytest.approx(5e6)
    assert est.predict_bps() == pytest.approx(5e6)            # the highest of the three
    # a rate fed in between starts the count again
    est.add(bw.TransferSample(5.0, 1_000_000, 0.08))
    for t in (6.0, 7.0):
        assert est.add(bw.TransferSample(t, 1_000_000, 1.6, floor_only=True)) is None
    est.add(bw.TransferSample(7.5, 1_000_000, 0.05, floor_only=True))     # above: fed (160)
    assert est.add(bw.TransferSample(8.0, 1_000_000, 1.6, floor_only=True)) is None
    assert est.predict_bps() == pytest.approx(1.6e8)
    with pytest.raises(ValueError, match="floors_to_lower"):
        bw.PassiveEstimator(floors_to_lower=0)
    # a clean transfer far below the estimate among floor-only ones: two lower it
    est = bw.PassiveEstimator(bw.LastValue(), min_duration_s=0.0)
    est.add(bw.TransferSample(1.0, 1_000_000, 0.08))
    assert est.add(bw.TransferSample(2.0, 1_000_000, 1.6, floor_only=True)) is None
    assert est.add(bw.TransferSample(3.0, 1_000_000, 2.0)) == pytest.approx(4e6)
