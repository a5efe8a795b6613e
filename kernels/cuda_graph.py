"""A captured CUDA graph of a decode step (`CudaOps.capture` makes them)."""
from __future__ import annotations

import cupy


class CudaGraph:
    """A captured sequence of launches; `replay()` reruns it on the current stream and returns the outputs the
    captured function returned (the same arrays every time: replay overwrites them).

    Replays alternate between two executable instances of the one captured graph: a launch of an instance whose
    previous launch is still running holds the host until that launch ends (the device then idles in every
    pipelined decode step while the host waits inside cudaGraphLaunch), so back-to-back steps take turns. Both
    instances have the same nodes and buffers and run in stream order, so results are the same. The second is
    made from the captured cudaGraph_t with the first (no new capture; instantiating it at its first replay left
    the device idle for milliseconds); where CuPy keeps no cudaGraph_t, replays stay on the one instance. Figures:
    docs/PERFORMANCE.md, "Measurements behind code comments"."""

    def __init__(self, graph, outputs, pool):
        self.graph = graph
        self.outputs = outputs
        self._pool = pool  # the graph's private memory: alive (and never handed out again) as long as the graph
        self._second = self._instantiate_again()  # the other cudaGraphExec_t (int), 0 when none can be made
        self._turn = 0

    def replay(self):
        stream = cupy.cuda.get_current_stream()
        if self._turn and self._second:
            cupy.cuda.runtime.graphLaunch(self._second, stream.ptr)
        else:
            self.graph.launch(stream)
        self._turn ^= 1
        return self.outputs

    def _instantiate_again(self) -> int:
        captured = getattr(self.graph, "graph", 0)
        if not captured:
            return 0
        try:
            return cupy.cuda.runtime.graphInstantiate(captured)
        except Exception:  # an older CuPy without the runtime call: one instance
            return 0

    def __del__(self):
        if getattr(self, "_second", 0):
            try:
                cupy.cuda.runtime.graphExecDestroy(self._second)
            except Exception:
                pass

    __call__ = replay
