"""Server-side cost of a record_replay frame against full_offload's eager forward, in one
process with no link: ``python -m robot_offload.bench.replay_cost --device cuda resnet101``.

On a GPU server both are bound by Python per operator, not by the kernels (ConvNeXt-T at
224x224: 4-7 ms a frame on an H100, of which its kernels take 1.4 ms by the profiler), so
what a replay does per operator decides whether record_replay can keep up with
full_offload there; the testbed's CPU server cannot show it. Per model: the median server
time of the replay requests (``server_total_s``: decoding the inputs, the replay, encoding
the outputs; early replay off, so the robot's checks do not share the process's time with
it) and of full_offload's forward requests (the same span), over the same frames, after
each mode's warm-up. The ratio is what matters; the machine and its load set the
absolute times.
"""

import argparse
import statistics
import sys
from typing import Dict, List

from robot_offload.client import ClientConfig, OffloadClient
from robot_offload.models import get_spec
from robot_offload.server import OffloadServer, ServerConfig
from robot_offload.transport.inproc import InProcessTransport


def measure(model: str, device: str, frames: int = 14, warmup: int = 6,
            input_size=(224, 224)) -> Dict[str, float]:
    """Median server seconds per frame of record_replay (replayed frames only) and of
    full_offload for ``model``, and the round trips of the replayed frames."""
    server = OffloadServer(ServerConfig(ops_sandbox=False, device=device))
    cfg = ClientConfig(model=model, mode="record_replay", input_size=tuple(input_size),
                       load_timeout_s=600, timeout_s=600, early_replay=False)
    client = OffloadClient(cfg, InProcessTransport(server))
    if not client.connect():
        raise RuntimeError(f"{model}: the in-process server refused: {client.link.last_error}")
    try:
        xs = [client.spec.example_input(client.input_size, seed=i) for i in range(frames)]
        for x in xs[:warmup]:
            client.infer(x)
        replay: List[float] = []
        trips: List[int] = []
        for x in xs:
            _, st = client.infer(x)
            if st.phase == "replaying":
                replay.append(st.server_compute_s)
                trips.append(st.round_trips)
        if not replay:
            raise RuntimeError(f"{model}: no frame was replayed (operator sequence not static?)")
        client.set_mode("full_offload")
        for x in xs[:warmup]:
            client.infer(x)
        forward = [client.infer(x)[1].server_compute_s for x in xs]
    finally:
        client.close()
    return {"replay_s": statistics.median(replay), "full_offload_s": statistics.median(forward),
            "replayed": len(replay), "round_trips": statistics.median(trips)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="replay_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default="cpu", help="the server's device: cpu, cuda, cuda:N")
    ap.add_argument("--frames", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--input-size", type=int, nargs=2, default=(224, 224), metavar=("H", "W"))
    args = ap.parse_args(argv)
    for m in args.models:
        get_spec(m)                       # unknown names fail before anything is loaded
    print("| model | server | replay ms | full_offload ms | replay / full_offload | "
          "replayed frames | round trips |\n|---|---|---|---|---|---|---|")
    for m in args.models:
        r = measure(m, args.device, args.frames, args.warmup, args.input_size)
        print(f"| {m} | {args.device} | {1e3 * r['replay_s']:.2f} | {1e3 * r['full_offload_s']:.2f} | "
              f"{r['replay_s'] / r['full_offload_s']:.2f} | {r['replayed']} | {r['round_trips']:g} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
