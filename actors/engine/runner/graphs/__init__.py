"""Compiled decode graphs: the CPU graph stack (tracing with Inductor, the on-disk graph store, the thread
tuner that picks threads per batch size) and the runner that replays a graph per batch size."""
