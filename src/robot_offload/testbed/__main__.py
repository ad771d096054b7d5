"""Command line for the testbed.

    python -m robot_offload.testbed selfcheck [--rates 10,50,100] [--duration-s 2.5]
                                              [--qdisc htb|tbf] [--gso-max-bytes N]
                                              [--traces indoor,outdoor] [--delay-ms D]
    python -m robot_offload.testbed cleanup [--all]
    python -m robot_offload.testbed traces --out DIR [--duration-s 60]

selfcheck builds the namespaces, prints the TCP round-trip time, and for each rate runs a
bounded TCP bulk transfer in each direction and checks the goodput is within the tolerance
of the rate set; it exits 1 on a failure and 2 when no shaped testbed can be built here (the
reason is printed). ``--delay-ms`` adds a one-way delay with the TUN relay (no netem needed)
and checks the RTT is at least twice that.
"""

import argparse
import os
import sys

from robot_offload.testbed import bulk, cleanup, traces
from robot_offload.testbed.netns import Testbed, TraceReplayer


def _rates(text):
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--rates: {e}") from e
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("--rates: positive Mbit/s values, comma separated")
    return rates


def _trace_names(text):
    names = [t for t in text.split(",") if t]
    unknown = [t for t in names if t not in traces.SYNTHETIC]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--traces: unknown {unknown}; known: {', '.join(traces.SYNTHETIC)}")
    return names


def selfcheck(rates_mbps, *, duration_s=2.5, tolerance=0.10, directions=("up", "down"),
              qdisc="htb", gso_max_bytes=None, trace_names=(), trace_duration_s=10.0,
              delay_ms=0.0, out=sys.stdout):
    kwargs = {} if gso_max_bytes is None else {"gso_max_bytes": gso_max_bytes}
    if delay_ms:
        kwargs.update(link="tun", delay_s=delay_ms / 1e3)
    with Testbed(qdisc=qdisc, **kwargs) as tb:
        print(f"testbed: {tb.reason}", file=out)
        if not tb.shaped:
            print("selfcheck: cannot check shaping on an unshaped testbed", file=out)
            return 2
        tb.set_rate(rates_mbps[0] * 1e6)
        rtt = bulk.measure_rtt(tb)
        rtt_ok = rtt["median_s"] >= 2 * delay_ms / 1e3
        print(f"TCP round trip (1-byte messages, {rtt['samples']} samples): median "
              f"{1e3 * rtt['median_s']:.3f} ms, min {1e3 * rtt['min_s']:.3f} ms"
              + (f" for {delay_ms:g} ms each way {'PASS' if rtt_ok else 'FAIL'}"
                 if delay_ms else ""), file=out, flush=True)
        print(f"robot {tb.robot_ip} ({tb.robot_ns}) <-> server {tb.server_ip} "
              f"({tb.server_ns}); rates are TCP goodput, qdisc = rate x "
              f"{tb.wire_rate_bps(1e6) / 1e6:.4f}", file=out)
        header = (f"{'set Mbit/s':>10}  {'dir':<4}  {'measured Mbit/s':>15}  "
                  f"{'error %':>7}  {'qdisc Mbit/s':>12}  result")
        print(header, file=out)
        print("-" * len(header), file=out)
        failures = 0 if rtt_ok else 1
        for rate in rates_mbps:
            tb.set_rate(rate * 1e6)
            qdisc_mbps = (tb.qdisc_rate_bps("robot") or 0.0) / 1e6
            for direction in directions:
                try:
                    got = bulk.measure(tb, direction, duration_s=duration_s)["bps"] / 1e6
                except (RuntimeError, OSError, ValueError) as e:
                    print(f"{rate:>10g}  {direction:<4}  {'-':>15}  {'-':>7}  "
                          f"{qdisc_mbps:>12.2f}  FAIL ({e})", file=out)
                    failures += 1
                    continue
                err = (got - rate) / rate
                ok = abs(err) <= tolerance
                failures += not ok
                print(f"{rate:>10g}  {direction:<4}  {got:>15.2f}  {100 * err:>+7.1f}  "
                      f"{qdisc_mbps:>12.2f}  {'PASS' if ok else 'FAIL'}", file=out,
                      flush=True)
        for name in trace_names:
            failures += not _check_replay(tb, name, trace_duration_s, tolerance, out)
        print(f"selfcheck: {'PASS' if not failures else f'{failures} FAIL'} "
              f"(tolerance +-{100 * tolerance:g} %)", file=out)
        return 1 if failures else 0


def _check_replay(tb, name, duration_s, tolerance, out):
    """Replay a synthetic trace while one bulk upload runs; compare mean goodput."""
    trace = traces.SYNTHETIC[name](duration_s=duration_s + 1.0)
    tb.set_rate(trace.rates_bps[0])
    transfer_s = duration_s - 0.5
    with TraceReplayer(tb, trace) as rp:
        got = bulk.measure(tb, "up", duration_s=transfer_s, warmup_s=0.0)["bps"]
    expected = float(trace.rates_bps[:int(round(transfer_s / trace.step_s))].mean())
    err = (got - expected) / expected
    ok = abs(err) <= tolerance and rp.error is None
    print(f"replay {name}: {len(rp.applied)} steps ({rp.late_steps} late), trace mean "
          f"{expected / 1e6:.1f} Mbit/s, measured {got / 1e6:.1f} ({100 * err:+.1f} %) "
          f"{'PASS' if ok else 'FAIL'}", file=out, flush=True)
    return ok


def write_traces(out_dir, duration_s=60.0, out=sys.stdout):
    os.makedirs(out_dir, exist_ok=True)
    for name, make in traces.SYNTHETIC.items():
        trace = make(duration_s=duration_s)
        path = traces.to_csv(trace, os.path.join(out_dir, f"{name}.csv"))
        st = trace.stats()
        print(f"{path}: {st['samples']} samples, mean {st['mean_mbps']:.1f} Mbit/s, "
              f"sd {st['std_mbps']:.1f}, p5 {st['p5_mbps']:.1f}, "
              f"<5 Mbit/s {100 * st['frac_below_5mbps']:.1f} %", file=out)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m robot_offload.testbed",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("selfcheck", help="measure the shaped link at a few rates")
    sc.add_argument("--rates", type=_rates, default=[10.0, 50.0, 100.0],
                    help="Mbit/s, comma separated (default 10,50,100)")
    sc.add_argument("--duration-s", type=float, default=2.5)
    sc.add_argument("--tolerance", type=float, default=0.10)
    sc.add_argument("--direction", choices=("up", "down", "both"), default="both")
    sc.add_argument("--qdisc", choices=("htb", "tbf"), default="htb")
    sc.add_argument("--traces", type=_trace_names, default=[],
                    help="also replay these synthetic traces under a bulk upload "
                         "(e.g. indoor,outdoor) and compare mean goodput")
    sc.add_argument("--trace-duration-s", type=float, default=10.0)
    sc.add_argument("--gso-max-bytes", type=int, default=None,
                    help="largest GSO packet (default 8192; 0 = none, 65536 = kernel's)")
    sc.add_argument("--delay-ms", type=float, default=0.0,
                    help="one-way delay each direction (TUN devices and a user-space relay)")
    cl = sub.add_parser("cleanup", help="remove stale testbed namespaces and cgroups")
    cl.add_argument("--all", action="store_true",
                    help="also those of running processes (default: dead owners only)")
    tr = sub.add_parser("traces", help="write the synthetic traces as CSV")
    tr.add_argument("--out", required=True)
    tr.add_argument("--duration-s", type=float, default=60.0)
    args = ap.parse_args(argv)

    if args.cmd == "selfcheck":
        dirs = ("up", "down") if args.direction == "both" else (args.direction,)
        return selfcheck(args.rates, duration_s=args.duration_s, tolerance=args.tolerance,
                         directions=dirs, qdisc=args.qdisc,
                         gso_max_bytes=args.gso_max_bytes,
                         trace_names=args.traces,
                         trace_duration_s=args.trace_duration_s, delay_ms=args.delay_ms)
    if args.cmd == "cleanup":
        removed = cleanup(include_live=args.all)
        restored = removed.pop("slice", None)
        for kind, names in removed.items():
            for name in names:
                print(f"removed {kind[:-1]} {name}")
        if restored is not None:
            print(f"put the CFS bandwidth slice back to {restored} us")
        if not any(removed.values()) and restored is None:
            print("nothing to clean up")
        return 0
    return write_traces(args.out, args.duration_s)


if __name__ == "__main__":
    sys.exit(main())
