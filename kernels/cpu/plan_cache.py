"""Moved: the kernel-plan cache is `ringserve.kernels.linear_plan.cache`, the host's facts and side-by-side
timing `ringserve.kernels.cpu.host`. These names stay here only for the compiled-graph modules
(actors/engine/runner/graphs/graph_store.py, graph_compiler.py) until they import from `host`."""

from ringserve.kernels.cpu.host import cpu_info, time_interleaved

__all__ = ["cpu_info", "time_interleaved"]
