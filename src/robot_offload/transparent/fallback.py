"""Operators that run on the robot, and what keeps them faithful to a plain run.

Random operators draw from the program's generator; an operator that writes a robot
tensor (declared in its schema or hidden, as batch norm's running statistics in training
mode) runs on the robot, its writes counted for the upload cache. With
``local_fallback``, each proxy remembers how it was computed (a recipe), so that its
values can be recomputed on the robot once the server is lost.
"""

from typing import Dict

import torch
from torch.utils._pytree import tree_flatten, tree_map

from robot_offload.errors import OffloadError
from robot_offload.transparent import wire
from robot_offload.transparent.proxy import RemoteTensor


class FallbackMixin:
    """Robot-side execution of a :class:`~robot_offload.transparent.session.RemoteSession`."""

    def _run_locally(self, func, args, kwargs):
        self._end_speculation_before_local()
        self.stats.ops_local += 1
        args, kwargs = tree_map(lambda a: self.materialize(a) if isinstance(a, RemoteTensor) else a,
                                (args, kwargs))
        self._note_writes(func, args, kwargs)
        return func(*args, **kwargs)

    def _run_random(self, func, args, kwargs):
        """A random operator runs on the robot, on the program's generator, so that
        ``torch.manual_seed`` and generator objects mean what they mean in a plain run.
        Its remote arguments are downloaded (a ``*_like`` factory and a fill such as
        ``bernoulli_`` read only their shape); a remote tensor it fills in place gets the
        robot's values by a ``copy_`` on the server."""
        self.stats.ops_local += 1
        name = _short_name(func)
        written = {i for i, _ in self._schema(func)[0]}
        shape_only = name.endswith("_like") or name in _RANDOM_FILLS
        remote_out = []

        def local(a, i=None):
            if not isinstance(a, RemoteTensor):
                return a
            if i is not None and i in written:
                value = (torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) if shape_only
                         else self.materialize(a).clone())
                remote_out.append((a, value))
                return value
            if shape_only:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
            return self.materialize(a)
        l_args = [local(a, i) if isinstance(a, RemoteTensor) else tree_map(local, a)
                  for i, a in enumerate(args)]
        l_kwargs = tree_map(local, kwargs)
        if any(isinstance(a, torch.Tensor) and not isinstance(a, RemoteTensor)
               for a in wire.leaves((args, kwargs))):
            self._note_writes(func, args, kwargs)
        out = func(*l_args, **l_kwargs)
        for proxy, value in remote_out:
            self.dispatch(torch.ops.aten.copy_.default, (proxy, value), {})
            if out is value:
                out = proxy
        return out

    def _end_speculation_before_local(self):
        if self._spec is not None:
            self._diverge("a robot-side write")

    def _keep_written_inputs(self, func, args, kwargs) -> None:
        """A robot-side operator is about to write into a robot tensor the replay has
        bound as an input (``x.mul_(2)`` between two reads of ``x``): the replay sends
        inputs when it is sent (and again after a dropped early reply), and it must send
        what the program passed, so it keeps a copy of that. (Recording uploaded the
        tensor at the read, before the write; the read after it is another input.)"""
        spec = self._spec
        for pn in self._schema(func)[0]:
            v = self._arg(args, kwargs, pn)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if not isinstance(t, torch.Tensor) or isinstance(t, RemoteTensor):
                    continue
                ptr = t.untyped_storage().data_ptr()
                for idx, bound in list(spec.inputs.items()):
                    if (not isinstance(bound, RemoteTensor)
                            and bound.untyped_storage().data_ptr() == ptr):
                        spec.inputs[idx] = bound.clone()

    def _writes_robot_tensor(self, func, args, kwargs) -> bool:
        """Whether ``func`` writes a robot tensor (declared or hidden write): it then runs
        on the robot, so the program's own tensor (a module's running statistics) changes
        exactly as in a plain run."""
        return any(not isinstance(t, RemoteTensor) for t in self._written_tensors(func, args, kwargs))

    def _written_tensors(self, func, args, kwargs) -> list:
        """The tensors ``func`` writes: those its schema marks ``(a!)`` and those it writes
        without saying so (:data:`HIDDEN_WRITES`: batch norm's running statistics in
        training mode)."""
        out = []
        for pn in self._schema(func)[0] + _hidden_writes(func, args, kwargs):
            v = self._arg(args, kwargs, pn)
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor):
                    out.append(t)
        return out

    def _attach_recipe(self, func, args, kwargs, out) -> None:
        """Remember how each output proxy was computed (the call, with proxy arguments
        replaced by their own recipes -- never by the proxies, which must stay free to be
        released), so its values can be recomputed on the robot if the server is lost. A
        proxy argument with neither a recipe nor downloaded values leaves the outputs
        without one (recomputing them then fails with a clear error)."""
        if not kwargs and type(out) is RemoteTensor:
            # The usual call, flat positional arguments and one output: no tree walks
            # (two maps and two flattens cost about a tenth of the robot's time per
            # replayed call).
            r_args = []
            for a in args:
                if type(a) in (list, tuple, dict):
                    break
                a = _ingredient(a)
                if type(a) is RemoteTensor:
                    return
                r_args.append(a)
            else:
                out._recipe = (_Recipe(func, r_args, {}), 0)
                return
        r_args, r_kwargs = tree_map(_ingredient, (list(args), kwargs))
        if any(isinstance(a, RemoteTensor) for a in tree_flatten((r_args, r_kwargs))[0]):
            return
        recipe = _Recipe(func, r_args, r_kwargs)
        for k, t in enumerate(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            if isinstance(t, RemoteTensor):
                t._recipe = (recipe, k)

    def _recompute(self, t: "RemoteTensor") -> torch.Tensor:
        if t._recipe is None:
            raise OffloadError("a remote tensor whose server is gone cannot be recomputed "
                               "(no recipe; was local_fallback off?)")
        recipe, k = t._recipe
        memo = {}
        return self._to_robot(recipe.evaluate(memo)[k].clone(), t)


#: Operators that write arguments their schema does not mark ``(a!)``: name -> (the flag
#: argument under which they write, the arguments written). Batch norm in training mode
#: updates ``running_mean`` and ``running_var`` in place (test-time adaptation).
HIDDEN_WRITES = {
    name: ((5, flag), [(3, "running_mean"), (4, "running_var")])
    for name, flag in (("native_batch_norm", "training"), ("batch_norm", "training"),
                       ("_batch_norm_impl_index", "training"), ("cudnn_batch_norm", "training"),
                       ("miopen_batch_norm", "training"), ("instance_norm", "use_input_stats"))
}

#: Random operators that overwrite their first argument without reading its values.
_RANDOM_FILLS = frozenset({"bernoulli_", "normal_", "uniform_", "random_", "exponential_",
                           "geometric_", "cauchy_", "log_normal_"})


_short_names: Dict[object, str] = {}


def _short_name(func) -> str:
    """``native_batch_norm`` for ``aten.native_batch_norm.default``."""
    name = _short_names.get(func)
    if name is None:
        name = _short_names[func] = func._schema.name.split("::")[-1]
    return name


def _hidden_writes(func, args, kwargs) -> list:
    """The (position, name) of arguments ``func`` writes without its schema saying so."""
    spec = HIDDEN_WRITES.get(_short_name(func))
    if spec is None:
        return []
    (i, flag), written = spec
    on = args[i] if i < len(args) else kwargs.get(flag)
    return list(written) if on else []


#: Random operators that draw nothing when a flag is off (dropout in eval mode): name ->
#: (position, name) of the flag.
_RANDOM_ONLY_IF = {"dropout": (2, "train"), "feature_dropout": (2, "train"),
                   "alpha_dropout": (2, "train"), "feature_alpha_dropout": (2, "train"),
                   "native_dropout": (2, "train"), "rrelu": (3, "training"),
                   "rrelu_with_noise": (4, "training")}


_random_cache: Dict[object, bool] = {}


def _is_random(func, args, kwargs) -> bool:
    """Whether this call of ``func`` draws random numbers (a ``Generator?`` argument, or
    the ``nondeterministic_seeded`` tag; dropout only in training): it must draw from the
    program's generator."""
    random = _random_cache.get(func)
    if random is None:
        random = _random_cache[func] = (
            torch.Tag.nondeterministic_seeded in func.tags
            or any(str(a.type).startswith("Generator") for a in func._schema.arguments))
    if random:
        flag = _RANDOM_ONLY_IF.get(_short_name(func))
        if flag is not None:
            i, name = flag
            on = args[i] if i < len(args) else kwargs.get(name, False)
            return bool(on)
    return random


def _ingredient(a):
    """A call argument as a recipe holds it: a proxy becomes its own recipe's output, or
    its downloaded values; a proxy with neither stays a proxy (then no recipe is made)."""
    if type(a) is RemoteTensor:
        if a._recipe is not None:
            return _Ingredient(a._recipe)
        return a if a._value is None else a._value
    return a


class _Ingredient:
    """A recipe argument: output ``k`` of another recipe."""
    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


class _Recipe:
    """One intercepted call, replayable on the robot (see ``_attach_recipe``)."""
    __slots__ = ("func", "args", "kwargs", "__weakref__")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs

    def evaluate(self, memo: dict) -> list:
        """The call's tensor outputs, recomputed on the robot (shared ancestors once)."""
        hit = memo.get(id(self))
        if hit is not None:
            return hit[1]

        def value(a):
            if isinstance(a, _Ingredient):
                recipe, k = a.ref
                return recipe.evaluate(memo)[k]
            return a
        # an _Ingredient is a leaf of the tree (a plain class; torch 2.1's tree_map has no
        # is_leaf)
        args, kwargs = tree_map(value, (self.args, self.kwargs))
        out = self.func(*args, **kwargs)
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        memo[id(self)] = (self, tensors)
        return tensors
