"""Spatial schedules of ``lop`` made to order, for tests that need one of each kind."""

import torch

from robot_offload import backends
from robot_offload.partition.cost import predict_schedule
from robot_offload.partition.loss import Loss, _lop_plan


def lop_schedules(client, backend=None):
    """A lop backend of ``client`` (``backend``, or a new one), an input, its local
    outputs, and a spatial schedule of each joining side at half share, without a robot
    tail (``until``): ``(backend, x, ref, {robot_joins: plan})``."""
    if backend is None:
        backend = backends.make_backend("lop", backends.BackendContext(
            client.spec, client.model, client.link, client.config))
    backend.calibration_inputs, backend.profile_repeats = 1, 1
    x = client.spec.example_input(client.input_size, seed=7)
    with torch.inference_mode():
        ref = client.model(x)
    ls, st = backend.lop_state(x), backend.state(x)
    loss = Loss(backend.graph, ls.spatial, st.profile, backend.share_steps)
    plans = {}
    for i, rc in enumerate(loss.regions):
        if rc.until is None and rc.robot_joins not in plans:
            cand = loss.candidate(i, backend.share_steps // 2)
            plans[rc.robot_joins] = _lop_plan(cand, "raw/none", predict_schedule(
                st.profile, cand, "raw/none", 20e6, st.cfg), 20e6)
    assert set(plans) == {True, False}, "no region of each joining side"
    return backend, x, ref, plans
