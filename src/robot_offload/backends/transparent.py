"""``transparent`` and ``record_replay``: the registry model runs unmodified on the robot
under operator interception (:mod:`robot_offload.transparent`), so its operators execute on
the server -- one request per operator (the Cricket-style baseline), or, once the
inference's operator sequence is identified, one replay request per inference (RRTO).

The model's weights are offered by content digest; the server finds them in its own copy
of the registry model (loaded through the link as for every mode), so they never cross
the link. A failure leaves the session's server-side state unknown, so the session is
reset (new handles, recording again) and the client computes the frame locally.

An operator whose schema differs between the robot's and the server's torch
(:mod:`robot_offload.compat`, :attr:`ServerLink.refused_ops`) is never sent: the frame
that reaches it raises :class:`~robot_offload.errors.Incompatible` naming the operator and
both versions, and so does every later frame of this mode until the link connects to
another server.
"""

import time

import torch

from robot_offload.backends.base import Backend, register_backend
from robot_offload.errors import Incompatible, OffloadError, RemoteError, TransportError
from robot_offload.protocol import StatusCode, method_of
from robot_offload.transparent.session import RemoteSession


class _OperatorBackend(Backend):
    needs_server = True
    session_mode = ""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.session = RemoteSession(self._call, mode=self.session_mode,
                                     client_id=ctx.link.client_id + "-" + self.name,
                                     output_codec=ctx.config.output_codec,
                                     early_replay=ctx.config.early_replay)
        self._refusal = None       # (the server's versions, the Incompatible text)

    def _call(self, request, timeout_s):
        return self.ctx.link.transport.call(method_of(request), request, timeout_s)

    def infer(self, x, stats, timeout_s):
        sess = self.session
        server = self.ctx.link.server_versions
        if self._refusal is not None and self._refusal[0] is server:
            raise Incompatible(StatusCode.INCOMPATIBLE, self._refusal[1])
        sess.refused_ops = self.ctx.link.refused_ops
        t0 = time.perf_counter()
        sess.deadline = t0 + timeout_s
        sess.frame_stats = stats
        calls_before = stats.transfer_s + stats.server_compute_s
        with sess.frame(stats):
            try:
                with torch.inference_mode(), sess:
                    y = self.ctx.model(x)
                y = sess.materialize_tree(y)
            except Incompatible as e:
                sess.reset()
                self._refusal = (server, e.text)
                raise
            except (TransportError, RemoteError):
                sess.reset()
                raise
            except OffloadError as e:
                sess.reset()
                raise RemoteError(StatusCode.INTERNAL, str(e)) from e
            finally:
                sess.deadline = None
                sess.frame_stats = None
            t1 = time.perf_counter()
            in_calls = stats.transfer_s + stats.server_compute_s - calls_before
            stats.add_compute(t0, t0 + max(0.0, (t1 - t0) - in_calls))
        stats.plan = f"{self.name}:{stats.phase}"
        return y

    def close(self):
        self.session.reset()


@register_backend
class TransparentBackend(_OperatorBackend):
    name = "transparent"
    session_mode = "transparent"


@register_backend
class RecordReplayBackend(_OperatorBackend):
    name = "record_replay"
    session_mode = "record_replay"
