"""Robot tensors on the server: the upload cache and what says an upload is still valid.

A robot tensor an operator needs is uploaded once and used again while it is known to be
unchanged: weights (and the session's private copies) by identity, version counter,
storage, the writes the session saw and ``.data`` assignments; any other robot tensor
only while its bytes equal those uploaded (a copy or a digest of them is kept). Big
weights are offered by content digest first (see ``RemoteCallsMixin._send``).

Weights are also known by content: a weight whose bytes equal those of a weight already on
the server -- a model built again every loop, the same checkpoint loaded twice -- uses that
server tensor (and so does its view, ``weight.t()``) without an upload. The program's
operator sequence then reads the same server tensors every loop and is recognised and
replayed. The server copy of a weight the program has dropped stays until
DROPPED_WEIGHTS_KEEP_BYTES of newer dropped weights push it out.
"""

import weakref
from typing import Optional

import numpy
import torch

from robot_offload.codec import byte_view
from robot_offload.transparent.proxy import RemoteTensor, in_module_forward
from robot_offload.transparent.wire import content_digest

#: Robot tensors at least this large are offered by content digest before their bytes.
DIGEST_MIN_BYTES = 64 * 1024
#: A robot tensor other than a weight is used again on the server only while its bytes are
#: those uploaded: up to this size a copy of them is kept and compared, beyond it a digest.
SNAPSHOT_MAX_BYTES = 16 * 1024 * 1024
#: Bytes of dropped weights whose server copies are kept for a model built again.
DROPPED_WEIGHTS_KEEP_BYTES = 256 * 1024 * 1024


class UploadsMixin:
    """The upload cache of a :class:`~robot_offload.transparent.session.RemoteSession`."""

    #: DROPPED_WEIGHTS_KEEP_BYTES, read through the class: a weight's death callback can run
    #: at interpreter exit, after module globals are cleared (a program that raised holds
    #: its model in the traceback until then)
    dropped_weights_keep_bytes = DROPPED_WEIGHTS_KEEP_BYTES

    @staticmethod
    def _cache_key(t: torch.Tensor):
        """(key, owner) of a robot tensor in the upload cache. A view of a contiguous robot
        tensor (``weight.t()`` in every Linear call, ``bias.view(...)``) is keyed by its base
        and its view geometry, so a fresh view object of the same weight hits the cache."""
        base = t._base
        if base is not None and base.dtype == t.dtype and base.is_contiguous() and base._base is None:
            return (id(base), tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset()), base
        return (id(t),), t

    def _same_view(self, a, b) -> bool:
        """Two robot tensors that are the same view of the same base (``widths[:, None]``
        written twice): one upload in the record, one input of the sequence."""
        if isinstance(a, RemoteTensor) or isinstance(b, RemoteTensor):
            return False
        (key_a, base_a), (key_b, base_b) = self._cache_key(a), self._cache_key(b)
        return base_a is base_b and base_a is not a and key_a == key_b

    def _stamp(self, t: torch.Tensor) -> tuple:
        """What says a robot tensor is unchanged without reading its bytes: its version
        counter (-1 for inference tensors, which have none), its storage (``.data =``
        swaps it and keeps the version), the writes this session saw robot-side
        operators make into that storage, and how often ``.data`` was assigned."""
        ptr = _storage_ptr(t)
        return (_version_of(t), ptr, self._writes.get(ptr, 0), getattr(t, "_ro_data_epoch", 0))

    def _cached_handle(self, t: torch.Tensor):
        """The server handle of ``t``'s upload while its content is known to be the same,
        else None.

        Weights (``nn.Parameter``) and the session's own private copies are trusted by
        :meth:`_stamp`: the program changes them with torch operators, which the session
        sees. Any other robot tensor may be written behind torch's back (numpy writes into
        ``torch.from_numpy`` memory, a camera driver's buffer, an inference tensor): its
        upload is used again only while its bytes are still those uploaded
        (:func:`_content_check`)."""
        key, owner = self._cache_key(t)
        entry = self._uploaded.get(key)
        if entry is None or entry[0]() is not owner or entry[1] != self._stamp(owner):
            return None
        if entry[3] is not None and not _content_same(owner, entry[3]):
            return None               # written since its upload
        return entry[2]

    def _upload_ref(self, t: torch.Tensor, uploads: list) -> dict:
        h = self._known_handle(t)
        if h is not None:
            return {"h": h}
        for i, (u, _) in enumerate(uploads):
            if u is t:
                return {"u": i}
        key, owner = self._cache_key(t)
        if owner is not t:
            # Upload the base once; the server makes the view (as_strided) without a copy.
            base_ref = self._upload_ref(owner, uploads)
            h = self._weight_handle(t) if "h" in base_ref else None
            if h is not None:
                return {"h": h}
            uploads.append((t, {"of": base_ref, "view": [list(t.shape), list(t.stride()), key[3]]}))
        else:
            uploads.append((t, {}))
        return {"u": len(uploads) - 1}

    def _known_handle(self, t: torch.Tensor) -> Optional[int]:
        """The server handle that holds ``t``'s content without an upload: its own cached
        upload, or, for a weight, one of the same content (:meth:`_weight_handle`)."""
        h = self._cached_handle(t)
        return h if h is not None else self._weight_handle(t)

    def _weight_handle(self, t: torch.Tensor) -> Optional[int]:
        """The handle of a server tensor holding what weight ``t`` holds (another robot
        weight of the same bytes, alive or dropped and kept), now cached for ``t`` too;
        None when there is none."""
        shared_key = self._shared_key(t)
        h = self._weight_handles.get(shared_key) if shared_key is not None else None
        if h is None:
            return None
        self._dropped_weights.pop(h, None)    # used again
        self._remember_upload(t, h, shared=True)
        return h

    def _shared_key(self, t: torch.Tensor) -> Optional[tuple]:
        """What makes two robot weights one server tensor: a weight's content digest; for
        a view of a weight (``weight.t()``), the handle of its base and its geometry. None
        for anything else (not a weight, or a view of a weight not on the server)."""
        key, owner = self._cache_key(t)
        if not _trusted(owner):
            return None
        if owner is t:
            return ("sha", self._digest(t))
        base_h = self._cached_handle(owner)       # the base's upload, if still its content
        if base_h is None:
            base_h = self._weight_handles.get(("sha", self._digest(owner)))
            if base_h is None:
                return None
        return ("view", base_h) + key[1:]

    def _drop_weight(self, h: int, nbytes: int) -> None:
        """The last robot weight using handle ``h`` is gone: keep its server copy for a model
        built again, releasing the oldest dropped ones beyond DROPPED_WEIGHTS_KEEP_BYTES."""
        self._dropped_weights[h] = nbytes
        kept = sum(self._dropped_weights.values())
        while kept > self.dropped_weights_keep_bytes or len(self._dropped_weights) > 4096:
            old, old_bytes = self._dropped_weights.popitem(last=False)
            kept -= old_bytes
            self._weight_handles = {k: v for k, v in self._weight_handles.items() if v != old}
            self._releases.append(old)

    def _digest(self, t: torch.Tensor) -> str:
        """The content digest of ``t``: remembered for trusted tensors (see
        :meth:`_cached_handle`), computed each time for any other."""
        if not _trusted(t):
            return content_digest(t)
        entry = self._digests.get(id(t))
        stamp = self._stamp(t)
        if entry is not None and entry[0]() is t and entry[1] == stamp:
            return entry[2]
        sha = content_digest(t)
        self._digests[id(t)] = (weakref.ref(t), stamp, sha)
        return sha

    def _remember_upload(self, t: torch.Tensor, h: int, checks: Optional[dict] = None,
                         shared: bool = False) -> None:
        """Cache the upload of ``t`` under handle ``h``; ``checks``: the content checks
        taken as the bytes were encoded (a view's is its base's). ``shared``: ``h`` is
        another weight's upload of the same content (nothing was sent). A weight's handle
        is given up when the last robot weight using it is gone (:meth:`_drop_weight`)."""
        key, owner = self._cache_key(t)
        sess_gen = self._generation
        shared_key = self._shared_key(t)
        if shared_key is not None:
            self._handle_users[h] = self._handle_users.get(h, 0) + 1
            self._weight_handles.setdefault(shared_key, h)
        nbytes = owner.numel() * owner.element_size() if owner is t else 0   # a view: no storage of its own

        def dead(_, key=key, h=h, nbytes=nbytes):
            if self._generation != sess_gen:
                return
            self._uploaded.pop(key, None)
            users = self._handle_users.get(h)
            if users is None:
                self._releases.append(h)
            elif users > 1:
                self._handle_users[h] = users - 1
            else:
                del self._handle_users[h]
                self._drop_weight(h, nbytes)
        check = None
        if not _trusted(owner):
            check = (checks or {}).get(id(owner))
            if check is None:      # a view of a base uploaded before: the server has its bytes
                base = self._uploaded.get((id(owner),))
                check = base[3] if base is not None and base[0]() is owner else _content_check(owner)
        self._uploaded[key] = (weakref.ref(owner, dead), self._stamp(owner), h, check)
        if not shared:
            self.recorder.note_upload(h)

    def _note_writes(self, func, args, kwargs) -> None:
        """Count the writes of a robot-side operator into robot tensors (see _stamp). A
        write into a weight inside a module's forward sets
        :attr:`weights_written_in_forward`: the program's forwards are then never run
        without interception, where such writes would go unseen."""
        for t in self._written_tensors(func, args, kwargs):
            if not isinstance(t, RemoteTensor):
                ptr = _storage_ptr(t)
                self._writes[ptr] = self._writes.get(ptr, 0) + 1
                if (_trusted(t) or (t._base is not None and _trusted(t._base))) and in_module_forward():
                    self.weights_written_in_forward = True


def _content_check(t: torch.Tensor):
    """What :func:`_content_same` compares later to know that ``t``'s bytes are still the
    ones uploaded now: a copy of them up to :data:`SNAPSHOT_MAX_BYTES` (a copy and a
    comparison cost about 0.1 ms each for a 1x3x224x224 float frame), else their sha256
    (about 1 ms for the same frame, 1-2 ms a megabyte)."""
    if t.numel() * t.element_size() <= SNAPSHOT_MAX_BYTES:
        return _bytes_of(t).copy()
    return content_digest(t)


def _content_same(t: torch.Tensor, check) -> bool:
    if isinstance(check, str):
        return content_digest(t) == check
    return numpy.array_equal(_bytes_of(t), check)


def _bytes_of(t: torch.Tensor):
    """A tensor's bytes as a flat uint8 numpy array (no copy when it is contiguous)."""
    if not t.requires_grad and t.is_contiguous():
        try:     # the short way (a few microseconds less for the many small buffers)
            return t.numpy().reshape(-1).view(numpy.uint8)
        except (TypeError, RuntimeError):
            pass     # no numpy dtype (bfloat16), a conjugate view: through torch
    return byte_view(t)


def _trusted(t: torch.Tensor) -> bool:
    """Weights and the session's private copies: changed only through torch operators."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_ro_private", False)


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (shared by its views); its id where it has none
    (sparse and other layouts, which are not uploaded)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


def _version_of(t: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors have none (-1): they can
    only be modified inside inference mode, where the change is not seen."""
    try:
        return t._version
    except RuntimeError:
        return -1
