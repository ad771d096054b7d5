"""torch.fx tracing that leaves the rest of the process alone.

``torch.fx.Tracer.trace`` patches ``nn.Module.__call__`` and ``nn.Module.__getattr__`` on
the class, for the whole process, while it traces. A model another thread runs
meanwhile goes through those patches: its layers are recorded into the graph being
traced, and they return proxies instead of tensors (on a server, another client's
forward while a model is captured for layer partitioning; on a robot, its frames while a
background thread prepares a partition). Two traces at once also break torch's own
bookkeeping of its patches (``CURRENT_PATCHER``), which left a server's model with no
graph for good.

:class:`ThisThreadTracer` records only the calls of the thread that traces: any other
thread's module calls and attribute reads go through the patches untouched, as if there
were none. Traces take turns on one process-wide lock.
"""

import threading

import torch

#: one trace at a time: torch keeps the patches of the trace in progress in a global
_TRACING = threading.Lock()


class ThisThreadTracer(torch.fx.Tracer):
    """A ``torch.fx.Tracer`` that records only its own thread's calls (see the module)."""

    _tracing_thread = None

    def trace(self, root, concrete_args=None):
        with _TRACING:
            self._tracing_thread = threading.get_ident()
            try:
                return super().trace(root, concrete_args)
            finally:
                self._tracing_thread = None

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self._tracing_thread:
            return forward(*args, **kwargs)       # another thread's model: run it as it is
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self._tracing_thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)
