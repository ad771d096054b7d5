"""The ``replay`` requests of record_replay: sending the matched calls of a speculation
(at a sync point, when the program reads a value, at the end of the sequence, or early),
handing the reply's handles and values to the proxies, and the sequence inputs whose
content repeats, kept on the server so that an early replay can name them.

Early replay (``early_replay=True``, the default): in a sequence without sync points the
whole replay is sent as soon as the last fresh input has been seen, as the paper's robot
does. It asks the server to keep the outputs the program held when the previous replay
of the sequence ended, and to send back the ones it read during recording. The robot then
checks the rest of the calls against the record while the request crosses the link and
the server runs it. On 0.5 CPU those checks took 20-150 ms per frame, which was on the
critical path when the request waited for the end of the sequence. The early reply is
used only when every call matched and the program holds no other output of the
sequence. Otherwise (a divergence, a value wanted mid-sequence, an intermediate tensor
kept) it is dropped, its handles released, and the usual replay is sent, so the fallback
costs one round trip more and never a wrong result.
"""

import concurrent.futures
import logging
from typing import List, Optional

import torch

from robot_offload import codec
from robot_offload.errors import RemoteError
from robot_offload.protocol import StatusCode
from robot_offload.transparent import wire
from robot_offload.transparent.proxy import RemoteTensor

log = logging.getLogger(__name__)

#: Fresh inputs of a sequence up to this size are compared by content digest between
#: replays; one whose content repeats (anchors, constants the program builds each frame)
#: is kept on the server and predicted (see ReplayRequestsMixin._input_ref).
STABLE_MAX_BYTES = 4 * 1024 * 1024
#: At most this many such inputs are kept per session (oldest dropped first).
STABLE_MAX_INPUTS = 64
#: An input whose content changed in this many replays in a row is taken for a fresh
#: frame each time and digested only every VOLATILE_RECHECK replays (see _input_ref).
VOLATILE_AFTER = 3
VOLATILE_RECHECK = 16


class ReplayRequestsMixin:
    """The replay requests of a :class:`~robot_offload.transparent.session.RemoteSession`."""

    def _flush(self, why: str, want: Optional[RemoteTensor] = None, sync_op: Optional[int] = None):
        """Send the matched but unsent operators of the speculation as one replay (or use
        the early replay's reply, when it covers what the program holds)."""
        spec = self._spec
        if spec is None:
            return None
        seq = spec.seq
        if want is not None and want._pending is not None and want._pending[0] is spec:
            # The program reads an output before the sequence ends (post-processing that
            # takes values out, as KAPAO's NMS does): the next early replay fetches it too.
            key = tuple(want._pending[1:])
            if key not in set(map(tuple, seq.prefetch)):
                seq.prefetch.append(key)
            if spec.early is not None and self._early_value(spec, want, key):
                return None
        if spec.early is not None and self._settle_early(spec, want, sync_op):
            return None
        if spec.pos == spec.sent:
            return None
        alive = self._alive_proxies(spec)
        keep = sorted(alive)
        prefetch = set(map(tuple, seq.prefetch))
        fetch = [key for key in keep if key in prefetch or (want is not None and alive[key] is want)]
        body, uploads = self._replay_body(spec, spec.pos, keep, fetch,
                                          [sync_op] if sync_op is not None else [])
        result, response = self._send(body, uploads)
        self._apply_replay(spec, result, response, alive, fetch)
        if spec.pos == seq.n_ops and sync_op is None and want is None and spec.sent == spec.pos:
            # What the program holds at the end, including outputs handed over at a sync
            # point before: what the next early replay keeps.
            held = {key for key, r in spec.proxies.items() if r() is not None}
            seq.early_keep = sorted(set(keep) | held | prefetch)
        if sync_op is not None:
            return result["replay"]["rets"].get(str(sync_op))
        return None

    @staticmethod
    def _alive_proxies(spec) -> dict:
        """(j, k) -> proxy of the sequence's outputs the program still holds, unsent."""
        alive = {key: r() for key, r in spec.proxies.items()}
        return {key: p for key, p in alive.items() if p is not None and p._pending is not None}

    def _replay_body(self, spec, upto: int, keep, fetch, sync_ops=()):
        """The ``replay`` request for operators ``spec.sent`` .. ``upto``-1 (and its uploads:
        the fresh inputs not sent yet); ``sync_ops``: the operators whose return values the
        reply must carry."""
        seq = spec.seq
        uploads: List[tuple] = []
        inputs = []
        for idx, t in sorted(spec.inputs.items()):
            if idx in spec.inputs_sent:
                continue
            if isinstance(t, RemoteTensor):
                inputs.append([idx, {"h": t.handle}])
            else:
                inputs.append([idx, self._input_ref(seq, idx, t, uploads)])
            spec.inputs_sent.add(idx)
        if upto == seq.n_ops:
            # Inputs the program has not produced yet: an early replay predicts those whose
            # content repeated (the server still has it); the robot checks them when they come.
            for idx in range(len(seq.input_metas)):
                if idx not in spec.inputs and idx not in spec.inputs_sent:
                    h = self._stable_handle(seq, idx)
                    if h is not None:
                        inputs.append([idx, {"h": h}])
                        spec.inputs_sent.add(idx)
                        spec.predicted[idx] = seq.input_digests[idx]
        body = {"replay": {"id": seq.seq_id, "from": spec.sent, "n": upto, "inputs": inputs,
                           "keep": [list(k) for k in keep], "fetch": [list(k) for k in fetch],
                           "sync": list(sync_ops)}}
        if seq.seq_id not in self._defined:
            body["define"] = {"id": seq.seq_id, "ops": seq.ops, "n_inputs": len(seq.input_metas)}
            self._defined.add(seq.seq_id)
        return body, uploads

    def _apply_replay(self, spec, result, response, alive: dict, fetch) -> None:
        """Hand the reply's handles and values to the proxies the program holds."""
        self.stats.replays += 1
        spec.sent = spec.pos
        for j, k, h in result["replay"]["kept"]:
            p = alive.get((j, k))
            if p is not None:
                p._cell[0] = h
                p._pending = None
            else:  # kept for a proxy the program has dropped meanwhile
                self._releases.append(h)
        for key, enc in zip(fetch, response.tensors):
            p = alive.get(key)
            if p is not None:
                value = codec.decode(enc)
                if value.numel() == p.numel():
                    p._value = self._to_robot(value, p)
                else:   # a stand-in of a sized operator: the proxy that replaces it takes it
                    p._fetched = value

    def _send_early(self, spec) -> None:
        """Send the whole sequence now, on the worker thread (see the module docstring)."""
        seq = spec.seq
        spec.early_fetch = sorted(set(map(tuple, seq.prefetch)))
        spec.early_keep = sorted(set(map(tuple, seq.early_keep or ())) | set(spec.early_fetch))
        body, uploads = self._replay_body(spec, seq.n_ops, spec.early_keep, spec.early_fetch,
                                          [j for j in seq.answered_ops if j >= spec.pos])
        if self._early_sender is None:
            self._early_sender = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="rr-early-replay")
        if self._releases:
            body["release"], self._releases = self._releases, []
        spec.early = self._early_sender.submit(self._send, body, uploads, take_releases=False)
        if self.stats.inferences:
            cur = self.stats.inferences[-1]
            cur.mark("early_sent_ms")
            spec.early.add_done_callback(lambda _f, cur=cur: cur.mark("reply_ms"))

    def _settle_early(self, spec, want=None, sync_op=None) -> bool:
        """Wait for the early replay's reply. True when it answers the flush: the whole
        sequence matched, no value or sync result is asked for, and the program holds only
        outputs the reply kept. Otherwise release what it kept and make the next replay
        start from the first operator again (False)."""
        if self.stats.inferences and spec.pos == spec.seq.n_ops:   # not a value asked mid-way
            self.stats.inferences[-1].mark("checks_end_ms")
        result, response = self._early_reply(spec)
        if result is None:
            return False
        alive = self._alive_proxies(spec)
        at_end = spec.pos == spec.seq.n_ops and want is None and sync_op is None
        if at_end and set(alive) <= set(spec.early_keep) and not spec.early_stale:
            spec.early = None
            self._apply_replay(spec, result, response, alive, spec.early_fetch)
            self.stats.early_replays += 1
            spec.seq.early_misses = 0
            return True
        self._drop_early(spec, result)
        return False

    def _early_value(self, spec, want, key) -> bool:
        """Give ``want`` (output ``key`` of an operator the program has passed) its value
        from the early reply, which fetched it; the reply stays pending for the rest of the
        sequence. Every call up to here matched the record, so this output is what the
        server computed. False when the reply did not fetch it or was refused."""
        if key not in spec.early_fetch or key[0] >= spec.pos or spec.early_stale:
            return False
        result, response = self._early_reply(spec)
        if result is None:
            return False
        value = codec.decode(response.tensors[spec.early_fetch.index(key)])
        if value.numel() != want.numel():   # a stand-in of a sized operator
            return False
        want._value = self._to_robot(value, want)
        return True

    def _early_reply(self, spec):
        """The early replay's (result, response); (None, None) when the server refused it
        (the early request is then dropped). A request refused with BAD_REQUEST ran past a
        sync point into operators the data made invalid (an index beyond a size the record
        did not foresee); anything else (a lost server, a stale session) is the program's
        error as for any other request."""
        try:
            return spec.early.result()  # _send's own deadline bounds the wait
        except RemoteError as e:
            if e.code != StatusCode.BAD_REQUEST:
                spec.early = None
                raise
            log.info("early replay refused (%s); replaying as the program goes", e)
            self.stats.early_refused += 1
            self._drop_early(spec, None)
            return None, None

    def _drop_early(self, spec, result) -> None:
        """Give up the early reply: release what it kept; the next replay starts from the
        first operator again. (At the end of the sequence, the replay _flush sends next
        records what the program holds as the sequence's early_keep.)"""
        spec.early = None
        spec.seq.early_misses += 1
        if result is not None:
            self._releases.extend(h for _, _, h in result["replay"]["kept"])
        spec.sent = 0
        spec.inputs_sent.clear()
        spec.predicted.clear()
        spec.early_stale = False
        self.stats.early_dropped += 1

    def _early_sync_result(self, spec, j: int, ret):
        """The return value of sync operator ``j`` from the early replay's reply, when its
        shapes are the recorded ones; else None, with the early reply dropped (the caller
        replays up to ``j`` as without early replay). The early request ran the whole
        sequence with the record's arguments; while every later call and sync result
        matches the record, the program is exactly what the server ran."""
        result, _ = self._early_reply(spec)
        if result is None:
            return None
        if spec.early_stale:
            self._drop_early(spec, result)
            return None
        actual = result["replay"]["rets"].get(str(j))
        if actual is not None and wire.same_shapes(actual, ret):
            self.stats.early_sync_answers += 1
            return actual
        self._drop_early(spec, result)
        return None

    def _stable_digest(self, t) -> Optional[str]:
        if isinstance(t, RemoteTensor) or t.numel() * t.element_size() > STABLE_MAX_BYTES:
            return None
        return self._digest(t)

    def _input_ref(self, seq, idx: int, t: torch.Tensor, uploads: list) -> dict:
        """The reference of fresh input ``idx`` of ``seq`` in a replay request. Its content
        digest is compared with the previous replay's: content that repeats (RetinaNet's
        anchors and box-coder constants are rebuilt by the program every frame, after the
        first sync point) is kept on the server under one robot tensor of that content,
        uploaded once, so that the next early replay can name it before the program has
        built it again (:meth:`_stable_handle`).

        An input that changed in :data:`VOLATILE_AFTER` replays in a row (a camera frame)
        is digested only every :data:`VOLATILE_RECHECK` replays: the digest (a sha256 of
        the frame, 1-2 ms a megabyte on the robot) sits before the early replay can leave,
        and a frame never repeats."""
        changes = seq.input_changes.get(idx, 0)
        if changes >= VOLATILE_AFTER and changes % VOLATILE_RECHECK:
            seq.input_changes[idx] = changes + 1
            seq.input_digests[idx] = None
            return self._upload_ref(t, uploads)
        d = self._stable_digest(t)
        stable = d is not None and seq.input_digests.get(idx) == d
        seq.input_digests[idx] = d
        seq.input_changes[idx] = 0 if stable else changes + 1
        if not stable:
            return self._upload_ref(t, uploads)
        keeper = self._stable.get(d)
        if keeper is None:
            # a private copy: the program may write into its own tensor behind torch's back
            keeper = t.detach().clone()
            keeper._ro_private = True
            self._stable[d] = keeper
            while len(self._stable) > STABLE_MAX_INPUTS:
                self._stable.popitem(last=False)   # its upload is released when it dies
        self._stable.move_to_end(d)
        return self._upload_ref(keeper, uploads)

    def _stable_handle(self, seq, idx: int) -> Optional[int]:
        """The server handle of input ``idx``'s content when it repeated in the last two
        replays and is still kept; else None."""
        d = seq.input_digests.get(idx)
        keeper = self._stable.get(d) if d is not None else None
        return self._cached_handle(keeper) if keeper is not None else None
