"""Conversions between ROS messages and the pure core's types (no logic of their own)."""

import json
import math

import numpy as np
from sensor_msgs.msg import PointCloud2, PointField

from robot_offload.codec import EncodedTensor
from robot_offload.msg import InferenceStats, Status, Tensor
from robot_offload.protocol import (ComputeRequest, ComputeResponse, LoadModelRequest,
                                    LoadModelResponse, PingRequest, PingResponse)
from robot_offload.srv import (ComputeRequest as ComputeSrvReq, ComputeResponse as ComputeSrvResp,
                               LoadModelRequest as LoadSrvReq, LoadModelResponse as LoadSrvResp,
                               PingRequest as PingSrvReq, PingResponse as PingSrvResp)


def tensor_to_msg(t: EncodedTensor) -> Tensor:
    return Tensor(name=t.name, dtype=t.dtype, shape=list(t.shape), codec=t.codec,
                  compression=t.compression, scale=t.scale, zero_point=t.zero_point,
                  raw_size=t.raw_size, data=t.data)


def tensor_from_msg(m: Tensor) -> EncodedTensor:
    return EncodedTensor(name=m.name, dtype=m.dtype, shape=list(m.shape), codec=m.codec,
                         compression=m.compression, scale=m.scale, zero_point=m.zero_point,
                         raw_size=m.raw_size, data=bytes(m.data))


def _status(r) -> Status:
    return Status(code=int(r.status), text=r.status_text)


# requests: pure -> srv (client side) and srv -> pure (server side)
def load_req_to_srv(r: LoadModelRequest) -> LoadSrvReq:
    return LoadSrvReq(client_id=r.client_id, model=r.model, weights_hash=r.weights_hash, auth=r.auth)


def load_req_from_srv(m) -> LoadModelRequest:
    return LoadModelRequest(client_id=m.client_id, model=m.model, weights_hash=m.weights_hash, auth=m.auth)


def load_resp_to_srv(r: LoadModelResponse) -> LoadSrvResp:
    return LoadSrvResp(status=_status(r), weights_hash=r.weights_hash, device=r.device,
                       load_time_s=r.load_time_s)


def load_resp_from_srv(m) -> LoadModelResponse:
    return LoadModelResponse(status=m.status.code, status_text=m.status.text,
                             weights_hash=m.weights_hash, device=m.device, load_time_s=m.load_time_s)


def compute_req_to_srv(r: ComputeRequest) -> ComputeSrvReq:
    return ComputeSrvReq(client_id=r.client_id, model=r.model, entry=r.entry, args_json=r.args_json,
                         session=r.session, tensors=[tensor_to_msg(t) for t in r.tensors],
                         output_codec=r.output_codec, output_compression=r.output_compression,
                         auth=r.auth, deadline_s=r.deadline_s, request_id=r.request_id)


def compute_req_from_srv(m) -> ComputeRequest:
    return ComputeRequest(client_id=m.client_id, model=m.model, entry=m.entry, args_json=m.args_json,
                          session=m.session, tensors=[tensor_from_msg(t) for t in m.tensors],
                          output_codec=m.output_codec, output_compression=m.output_compression,
                          auth=m.auth, deadline_s=m.deadline_s, request_id=m.request_id)


def compute_resp_to_srv(r: ComputeResponse) -> ComputeSrvResp:
    return ComputeSrvResp(status=_status(r), tensors=[tensor_to_msg(t) for t in r.tensors],
                          structure_json=r.structure_json, result_json=r.result_json,
                          server_compute_s=r.server_compute_s, server_total_s=r.server_total_s,
                          server_queue_s=r.server_queue_s, server_backlog_s=r.server_backlog_s)


def compute_resp_from_srv(m) -> ComputeResponse:
    return ComputeResponse(status=m.status.code, status_text=m.status.text,
                           tensors=[tensor_from_msg(t) for t in m.tensors],
                           structure_json=m.structure_json, result_json=m.result_json,
                           server_compute_s=m.server_compute_s, server_total_s=m.server_total_s,
                           server_queue_s=m.server_queue_s, server_backlog_s=m.server_backlog_s)


def ping_req_to_srv(r: PingRequest) -> PingSrvReq:
    return PingSrvReq(client_id=r.client_id, payload=r.payload, auth=r.auth,
                      versions_json=r.versions_json)


def ping_req_from_srv(m) -> PingRequest:
    return PingRequest(client_id=m.client_id, payload=bytes(m.payload), auth=m.auth,
                       versions_json=m.versions_json)


def ping_resp_to_srv(r: PingResponse) -> PingSrvResp:
    return PingSrvResp(status=_status(r), server_id=r.server_id, loaded_models=r.loaded_models,
                       device=r.device, payload=r.payload, versions_json=r.versions_json,
                       server_backlog_s=r.server_backlog_s)


def ping_resp_from_srv(m) -> PingResponse:
    return PingResponse(status=m.status.code, status_text=m.status.text, server_id=m.server_id,
                        loaded_models=list(m.loaded_models), device=m.device, payload=bytes(m.payload),
                        versions_json=m.versions_json, server_backlog_s=m.server_backlog_s)


#: the most ``InferenceStats.detail_json`` carries (bytes); longer details are cut to
#: a JSON object that says so
DETAIL_JSON_MAX = 8192


def detail_json(extra: dict) -> str:
    """``FrameStats.extra`` as JSON for ``InferenceStats.detail_json``: what a backend
    measured beyond the common fields (lop's stripe and tail times, for one), so that a
    bag or a benchmark's rows can say where a frame's time went. Values JSON does not know
    are written as strings."""
    text = json.dumps(extra, default=str, sort_keys=True, allow_nan=True)
    if len(text) > DETAIL_JSON_MAX:
        text = json.dumps({"truncated": True, "bytes": len(text), "keys": sorted(extra)})
    return text


def stats_to_msg(stats, header, latency_s: float, counters) -> InferenceStats:
    """``counters``: (received, processed, dropped, fallbacks) since the client started."""
    received, processed, dropped, fallbacks = counters
    return InferenceStats(
        header=header, mode=stats.mode, executed_mode=stats.executed_mode, model=stats.model,
        plan=stats.plan, phase=stats.phase, fallback_reason=stats.fallback_reason[:500],
        latency_s=latency_s, queue_s=stats.queue_s, robot_compute_s=stats.robot_compute_s,
        transfer_s=stats.transfer_s, server_compute_s=stats.server_compute_s,
        predicted_latency_s=stats.predicted_latency_s, bytes_up=stats.bytes_up,
        bytes_down=stats.bytes_down, round_trips=stats.round_trips,
        energy_j=stats.energy_j if stats.energy_j is not None else math.nan,
        energy_modelled=stats.energy_modelled, predicted_bandwidth_bps=stats.predicted_bandwidth_bps,
        frames_received=received, frames_processed=processed, frames_dropped=dropped,
        fallbacks=fallbacks,
        replay_divergences=int(stats.extra.get("transparent", {}).get("divergences_total", 0)),
        detail_json=detail_json(stats.extra))


_PF_DTYPES = {PointField.INT8: "i1", PointField.UINT8: "u1", PointField.INT16: "i2",
              PointField.UINT16: "u2", PointField.INT32: "i4", PointField.UINT32: "u4",
              PointField.FLOAT32: "f4", PointField.FLOAT64: "f8"}


def pointcloud2_to_xyzi(msg: PointCloud2) -> np.ndarray:
    """N x 4 float32 (x, y, z, intensity; intensity 0 when absent) from a PointCloud2,
    reading the buffer with a numpy structured dtype (no per-point Python loop)."""
    fields = {f.name: f for f in msg.fields}
    for axis in ("x", "y", "z"):
        if axis not in fields:
            raise ValueError(f"PointCloud2 has no {axis!r} field (fields: {sorted(fields)})")
    endian = ">" if msg.is_bigendian else "<"
    names, formats, offsets = [], [], []
    for name in ("x", "y", "z", "intensity"):
        f = fields.get(name)
        if f is not None:
            names.append(name)
            formats.append(endian + _PF_DTYPES[f.datatype])
            offsets.append(f.offset)
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": msg.point_step})
    n = msg.width * msg.height
    if len(msg.data) < n * msg.point_step:
        raise ValueError(f"PointCloud2 data holds {len(msg.data)} bytes, {n} points need {n * msg.point_step}")
    arr = np.frombuffer(bytes(msg.data), dtype=dtype, count=n)
    out = np.zeros((n, 4), dtype=np.float32)
    for i, name in enumerate(("x", "y", "z", "intensity")):
        if name in names:
            out[:, i] = arr[name]
    return out


def columns_to_pointcloud2(header, columns) -> PointCloud2:
    """PointCloud2 with one float32 field per ``(name, N-array)`` column, in order."""
    n = len(columns[0][1])
    arr = np.zeros(n, dtype=[(name, "<f4") for name, _ in columns])
    for name, values in columns:
        arr[name] = values
    step = 4 * len(columns)
    fields = [PointField(name=name, offset=4 * i, datatype=PointField.FLOAT32, count=1)
              for i, (name, _) in enumerate(columns)]
    return PointCloud2(header=header, height=1, width=n, fields=fields, is_bigendian=False,
                       point_step=step, row_step=step * n, data=arr.tobytes(), is_dense=True)


def xyzi_to_pointcloud2(points: np.ndarray, header, extra_fields=()) -> PointCloud2:
    """N x 4 float32 points (plus optional (name, N-array float32) fields) -> PointCloud2."""
    cols = [("x", points[:, 0]), ("y", points[:, 1]), ("z", points[:, 2]),
            ("intensity", points[:, 3] if points.shape[1] > 3 else np.zeros(len(points)))]
    return columns_to_pointcloud2(header, cols + list(extra_fields))
