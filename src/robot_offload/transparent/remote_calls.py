"""Requests to the server and their replies: one operator per request (``transparent``
mode, and record_replay while recording), the round trip itself with its accounting,
proxies built from a reply, and downloads of a proxy's values.
"""

import time
from typing import List

import torch
from torch.utils._pytree import tree_map

from robot_offload import codec
from robot_offload.errors import OffloadError, RemoteError, TransportError
from robot_offload.protocol import ComputeRequest, raise_for_status
from robot_offload.transparent import wire
from robot_offload.transparent.proxy import RemoteTensor
from robot_offload.transparent.uploads import DIGEST_MIN_BYTES, _content_check, _trusted
from robot_offload.transparent.wire import ENTRY


class RemoteCallsMixin:
    """Requests and replies of a :class:`~robot_offload.transparent.session.RemoteSession`."""

    # -- transparent: one request per operator -------------------------------------------
    def _transparent(self, func, args, kwargs, record: bool = False):
        uploads: List[tuple] = []          # (tensor, spec dict)

        def ref(t):
            if isinstance(t, RemoteTensor):
                if t._pending is not None:
                    self._flush("an operator outside the recorded sequence")
                if t.handle is None:
                    raise OffloadError("a remote tensor of a failed or reset session was used")
                return {"h": t.handle}
            return self._upload_ref(t, uploads)

        try:
            a_tree = wire.encode(list(args), ref)
            k_tree = {k: wire.encode(v, ref) for k, v in kwargs.items()}
        except wire.Unsupported:
            return self._run_locally(func, args, kwargs)
        name = wire.op_name(func)
        req_args = {"ops": [{"op": name, "a": a_tree, "k": k_tree}]}
        result, _ = self._send(req_args, uploads)
        self.stats.ops_remote += 1
        ret = result["ops"][0]
        out = self._decode_return(func, args, kwargs, ret)
        if self.local_fallback:
            self._attach_recipe(func, args, kwargs, out)
        if record:
            self._record(func, name, a_tree, k_tree, ret, out, args, kwargs)
        return out

    def _send(self, req_args: dict, uploads: list, take_releases: bool = True):
        """One round trip. Uploads go by digest first (big robot tensors), then by value.
        ``take_releases=False``: the caller put the pending releases in ``req_args`` itself
        (a worker thread must not swap the list the program's thread appends to)."""
        # Weights (nn.Parameter) of some size are offered by digest: the server may hold
        # them already. Frames and other tensors go by value at once.
        by_digest = [isinstance(t, torch.nn.Parameter) and t.numel() * t.element_size() >= DIGEST_MIN_BYTES
                     for t, _ in uploads]
        while True:
            specs, tensors = [], []
            checks = {}     # id(owner) -> content check of the bytes sent (see _cached_handle)
            for (t, extra), dig in zip(uploads, by_digest):
                if extra:
                    specs.append(extra)
                    continue
                digest = self._digest(t) if isinstance(t, torch.nn.Parameter) and \
                    t.numel() * t.element_size() >= DIGEST_MIN_BYTES else ""
                if dig:
                    specs.append({"sha": digest})
                else:
                    specs.append({"n": len(tensors), "sha": digest})
                    if not _trusted(t):     # taken with the bytes, not after the reply
                        checks[id(t)] = _content_check(t)
                    tensors.append(codec.encode(t.detach().contiguous(), f"u{len(tensors)}"))
            body = dict(req_args)
            if specs:
                body["uploads"] = specs
            if take_releases and self._releases:
                body["release"], self._releases = self._releases, []
            response = self._roundtrip(body, tensors)
            result = wire.reply_json(response.result_json)
            if "missing" in result:
                for i in result["missing"]:
                    by_digest[i] = False
                continue
            for (t, _), h in zip(uploads, result.get("uploaded", [])):
                self._remember_upload(t, h, checks)
            return result, response

    def _roundtrip(self, body: dict, tensors: list):
        # Within a frame (a backend's), the time left to its deadline is the only bound: a
        # replay of a large model on a slow server is one long call. Otherwise (the
        # launcher, kapao_repo) the session's per-call timeout_s.
        if self.deadline is not None:
            timeout = self.deadline - time.perf_counter()
        else:
            timeout = self.timeout_s
        req = ComputeRequest(client_id=self.client_id, model="", entry=ENTRY, tensors=tensors,
                             args_json=wire.request_json(body), session=self.session_id,
                             output_codec=self.output_codec)
        t0 = time.perf_counter()
        response = self._call(req, timeout)
        t1 = time.perf_counter()
        raise_for_status(response.status, response.status_text)
        if not self.session_id:
            self.session_id = wire.reply_json(response.result_json).get("session", "")
        up, down = req.payload_bytes + len(req.args_json), response.payload_bytes + len(response.result_json)
        self.stats.round_trips += 1
        self.stats.bytes_up += up
        self.stats.bytes_down += down
        if self.stats.inferences:
            cur = self.stats.inferences[-1]
            cur.round_trips += 1
            cur.bytes_up += up
            cur.bytes_down += down
        if self.frame_stats is not None:
            self.frame_stats.add_call(t0, t1, response.server_total_s or response.server_compute_s, up, down)
        return response

    def _decode_return(self, func, args, kwargs, ret, from_record: bool = False):
        """Proxies for the tensors of a server return tree; in-place returns give back the
        argument object itself."""
        _, returns_alias, _, n_returns, _ = self._schema(func)
        inputs = None

        def build(node, top_index=None):
            nonlocal inputs
            if isinstance(node, dict) and len(node) == 1 and "t" in node:
                meta = node["t"]
                if "a" in meta:       # the operator returned one of its inputs
                    if inputs is None:
                        inputs = wire.tensor_leaves(args, kwargs)
                    obj = inputs[meta["a"]]
                    if isinstance(obj, RemoteTensor) and top_index is not None \
                            and top_index < len(returns_alias) and returns_alias[top_index] is not None:
                        obj._value = None     # written in place: cached values are stale
                    return obj
                return RemoteTensor(self, meta, None if from_record else meta.get("h"))
            if isinstance(node, dict) and len(node) == 1 and "l" in node:
                return [build(v) for v in node["l"]]
            if isinstance(node, dict) and len(node) == 1 and "f" in node:
                return float(node["f"])
            return node
        try:
            if n_returns > 1 and isinstance(ret, dict) and "l" in ret:
                return tuple(build(v, i) for i, v in enumerate(ret["l"]))
            return build(ret, 0)
        finally:
            # A recursive closure is a reference cycle (function -> cell -> function) that
            # would keep this operator's arguments alive until the garbage collector runs:
            # proxies the program has dropped would still count as held (replay keeps,
            # early replay's coverage check) and server tensors would be released late.
            build = None

    # -- materialising ---------------------------------------------------------------------
    def materialize(self, t):
        """The values of a proxy as a robot tensor (downloaded once, then cached)."""
        if not isinstance(t, RemoteTensor):
            return t
        with self._lock:
            if t._value is not None:
                return t._value
            if self.local_fallback and (self.down.is_set() or t._cell[1] != self._generation):
                t._value = self._recompute(t)
                return t._value
            try:
                return self._download(t)
            except (TransportError, RemoteError) as e:
                if not self.local_fallback:
                    raise
                self._server_lost(e)
                t._value = self._recompute(t)
                return t._value

    def _download(self, t):
        if t._pending is not None:
            self._flush("the program reads a value", want=t)
            if t._value is not None:
                return t._value
        if t.handle is None:
            raise OffloadError("a remote tensor of a failed or reset session was read")
        _, response = self._send({"fetch": [t.handle]}, [])
        if self.mode != "transparent":
            self.recorder.note_fetch(t.handle)
            if t._origin is not None:   # read after a replay: prefetch it next time
                seq = t._origin[0].seq
                if tuple(t._origin[1:]) not in set(map(tuple, seq.prefetch)):
                    seq.prefetch.append(tuple(t._origin[1:]))
        t._value = self._to_robot(codec.decode(response.tensors[0]), t)
        return t._value

    @staticmethod
    def _to_robot(value: torch.Tensor, proxy: RemoteTensor) -> torch.Tensor:
        value = value.reshape(proxy.shape)
        if tuple(proxy.stride()) != tuple(value.stride()) and value.numel() > 0:
            try:
                value = torch.empty_strided(proxy.shape, proxy.stride(), dtype=value.dtype).copy_(value)
            except RuntimeError:
                pass
        return value

    # -- whole results ----------------------------------------------------------------------
    def materialize_tree(self, tree):
        return tree_map(lambda a: self.materialize(a) if isinstance(a, RemoteTensor) else a, tree)


def _status_of(response):
    return response.status, response.status_text
