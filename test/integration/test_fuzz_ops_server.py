"""The ``ops`` entry of a real offload_server node (server.launch, its own sandbox
processes) under generated adversarial requests (robot_offload.server.fuzz) over the
ROS compute service.

Asserted: every request is answered with a known status, never INTERNAL and never an
exception; the node is the same process at the end and answers ping throughout; a valid
client interleaved every 25 requests gets outputs equal to local torch's; memory stays
bounded: the node's RSS grows by at most :data:`SERVER_GROWTH_MIB`, and each sandbox's RSS
stays within its baseline (a sandbox that imported torch and served the valid client)
plus ``max_client_mib`` (what one client's sessions may hold) plus
:data:`SANDBOX_SLACK_MIB` (operators' temporary buffers, allocator caches), their sum
within that times the sandboxes there were.

The fuzz is mostly shape-aware (robot_offload.server.fuzz.shapes), with one concurrent
fuzzing client and resnet18 loaded so that uploads name its weights by digest: asserted
too, that a good share of the requests ran (OK), that writes into those weights were
refused, and that the limits were reached (refusals past max_request_gflop, bytes and
compute budgets).

``ROBOT_OFFLOAD_FUZZ_REQUESTS`` sets the number of requests (default 3000, about two
minutes on a loaded two-core machine; the full run is ``python -m
robot_offload.server.fuzz --requests 10000``) and ``ROBOT_OFFLOAD_FUZZ_SEED`` the seed.
"""

import os
import time
import xmlrpc.client

import pytest

from robot_offload.protocol import StatusCode
from robot_offload.server import fuzz as fuzz_ops

N_REQUESTS = int(os.environ.get("ROBOT_OFFLOAD_FUZZ_REQUESTS", "3000"))
SEED = int(os.environ.get("ROBOT_OFFLOAD_FUZZ_SEED", "0"))
SERVER_GROWTH_MIB = 150
SANDBOX_SLACK_MIB = 512


def _node_pid(name="/offload_server"):
    import rosgraph
    import rosnode
    uri = rosnode.get_api_uri(rosgraph.Master("/pytest"), name, skip_cache=True)
    return xmlrpc.client.ServerProxy(uri).getPid("/pytest")[2]


@pytest.fixture
def fuzz_server(launch, tmp_path):
    import rospy
    from robot_offload.ros.transport import RosServiceTransport
    config = tmp_path / "fuzz_server.yaml"
    config.write_text("".join(f"{k}: {v}\n" for k, v in fuzz_ops.FUZZ_CONFIG.items()))
    proc = launch.start("server.launch", "device:=cpu", "respawn:=false", f"server_config:={config}")
    rospy.wait_for_service("/offload_server/compute", timeout=120)
    transport = RosServiceTransport("/offload_server")
    yield proc, transport
    transport.close()


def test_fuzzed_ops_requests_never_break_the_server(fuzz_server):
    proc, transport = fuzz_server
    cfg = fuzz_ops.FUZZ_CONFIG
    pid = _node_pid()
    watch = fuzz_ops.ProcessWatch(pid)

    send, ping, load = fuzz_ops.report.transport_calls(transport, cfg["max_request_s"] + 40)

    # Baselines: the node after start and after loading the model whose weights uploads
    # name (its build imports torchvision), a sandbox after importing torch and serving a client.
    from robot_offload.server.fuzz import shapes as fuzz_shapes
    assert load(fuzz_shapes.WEIGHTS_MODEL)
    warm = fuzz_ops.ValidClient(send, client_id="warm-up")
    assert warm.check(), warm.failures
    time.sleep(1.0)
    base = watch.sample()
    assert base["alive"] and base["sandboxes"] >= 1, base
    t0 = time.monotonic()
    report = fuzz_ops.run_fuzz(send, N_REQUESTS, seed=SEED, valid_every=25, ping=ping, watch=watch,
                               watch_every=10, load=load, threads=1)
    print("\n" + report.table())
    assert N_REQUESTS <= report.requests <= N_REQUESTS + 4     # repeats and a concurrent request in flight
    assert report.problems() == [], report.problems()
    assert not report.internal and not report.errors
    assert report.valid_checks >= N_REQUESTS // 50 and report.valid_passed == report.valid_checks
    assert watch.alive() and _node_pid() == pid and proc.poll() is None
    assert report.restarts == 0
    # The fuzz reached past the request checks into operators, sessions and sequences.
    assert report.by_status[int(StatusCode.OK)] > report.requests * 0.3, report.by_status
    assert report.by_kind["define"] and report.by_kind["replay"] and report.by_kind["ops"]
    assert report.ok_by_kind["fit-ops"] and report.ok_by_kind["fit-define"], report.ok_by_kind
    assert report.weight_writes_refused and not report.weight_writes_allowed
    assert report.by_reason["max_request_gflop"] and report.by_reason["allow-list"] >= 0, report.by_reason
    per_sandbox = base["sandbox_max_mb"] + cfg["max_client_mib"] + SANDBOX_SLACK_MIB
    assert report.server_rss_mb[1] <= base["server_rss_mb"] + SERVER_GROWTH_MIB, (report.server_rss_mb, base)
    assert report.sandbox_max_mb <= per_sandbox, (report.sandbox_max_mb, base)
    assert report.sandbox_rss_mb[1] <= per_sandbox * report.max_sandboxes, (report.sandbox_rss_mb, base)
    assert time.monotonic() - t0 < 600
