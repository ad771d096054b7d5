"""One robot of the fleet benchmark (:mod:`robot_offload.bench.fleet`): a ROS node with an
:class:`~robot_offload.client.OffloadClient` over every server under ``--fleet-ns``, fed
frames by a camera clock at ``--rate-hz`` from a shared start time. A frame due while the
previous one still runs is dropped, as the client node's newest-frame queue would, so
every frame the camera offered is either processed or counted as dropped. Each robot's
camera starts at a random phase within its first period (seeded by its id): robots'
cameras are not synchronised, and frames arriving at exactly the same instants would
make each server's queue order, not its load, decide who waits. Writes one JSON
file: each processed frame's start, latency, executed mode, servers and hedges."""

import argparse
import json
import time
import zlib

import numpy as np
import rospy

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.pool import FIGURE_KEYS
from robot_offload.ros.fleet import master_directory


def main(argv=None):
    ap = argparse.ArgumentParser(prog="fleet_robot")
    ap.add_argument("--fleet-ns", required=True)
    ap.add_argument("--client-id", required=True)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--mode", default="full_offload")
    ap.add_argument("--input-size", default="")
    ap.add_argument("--rate-hz", type=float, default=5.0)
    ap.add_argument("--start-at", type=float, required=True, help="wall-clock start (s since the epoch)")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--balance", default="least_predicted_latency")
    ap.add_argument("--hedge", type=int, default=1)
    ap.add_argument("--hedge-budget", type=float, default=0.1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    rospy.init_node(args.client_id, disable_signals=True)
    size = [int(s) for s in args.input_size.split(",")] if args.input_size else []
    config = ClientConfig(model=args.model, mode=args.mode, input_size=size, timeout_s=args.timeout_s,
                          client_id=args.client_id, balance=args.balance, hedge=bool(args.hedge),
                          hedge_budget=args.hedge_budget, num_threads=1)
    client = OffloadClient(config, master_directory(args.fleet_ns))
    client.link.rediscover_s = 1.0
    if not client.connect(120.0):
        raise SystemExit(f"{args.client_id}: no offload server: {client.link.last_error}")
    rng = np.random.default_rng(zlib.crc32(args.client_id.encode()))
    h, w = (size or client.input_size)[:2]
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(8)]
    for frame in frames[:3]:                    # warm both sides up, not recorded
        client.process(frame)
    before = client.link.figures()              # counters keep running: the report subtracts these
    print("READY", flush=True)

    period_s = 1.0 / args.rate_hz
    # cameras are not synchronised: each starts at its own phase within the first period
    phase_s = float(rng.uniform(0.0, period_s))
    start_wall = args.start_at + phase_s
    remaining_s = start_wall - time.time()
    while remaining_s > 0:                      # read the clock once per step: it moves between reads
        time.sleep(min(0.05, remaining_s))
        remaining_s = start_wall - time.time()
    t_start = time.monotonic()
    due = 0.0
    offered = dropped = 0
    records = []
    while True:
        now = time.monotonic() - t_start
        if phase_s + due >= args.duration_s:    # every robot's camera stops at the shared end
            break
        if now < due:
            time.sleep(due - now)
            now = due
        # frames the camera produced while the last one ran: all but the newest dropped
        late = int((now - due) // period_s)
        offered += late + 1
        dropped += late
        due += (late + 1) * period_s
        frame = frames[offered % len(frames)]
        t0 = time.monotonic() - t_start
        _, stats = client.process(frame)
        pool = stats.extra.get("pool", {})
        # t: from the fleet's shared start, as the slow and kill events are
        records.append({"t": round(phase_s + t0, 4), "latency_s": round(stats.processing_s, 5),
                        "mode": stats.executed_mode, "fallback": stats.fallback_reason[:120],
                        "servers": pool.get("servers", []), "hedged": pool.get("hedged", 0),
                        "hedge_won": pool.get("hedge_won", 0), "failovers": pool.get("failovers", 0),
                        "bytes_up": stats.bytes_up})
    after = client.link.figures()
    pool = {k: after.get(k, 0) - before.get(k, 0) for k in FIGURE_KEYS}
    with open(args.out, "w") as f:
        json.dump({"client_id": args.client_id, "rate_hz": args.rate_hz, "duration_s": args.duration_s,
                   "offered": offered, "dropped": dropped, "frames": records, "pool": pool,
                   "servers": after.get("servers", {})}, f)
    # Shut down only once every robot's last frame has had its deadline: a robot's exit
    # costs CPU that would otherwise land on another robot's last frame.
    time.sleep(max(0.0, args.start_at + args.duration_s + args.timeout_s - time.time()))
    client.close()
    rospy.signal_shutdown("done")


if __name__ == "__main__":
    main()
