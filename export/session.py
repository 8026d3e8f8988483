"""`OrtModel`: one onnxruntime session, configured for a small ARM board, reused for every call.

Why these settings: a Raspberry Pi-class agent has 4 slow cores and also runs the MQTT client,
so the session uses `intra_op_num_threads` for the (few, small) kernels, a single inter-op
thread with sequential execution (zoo graphs are chains; a parallel executor only adds
scheduling overhead), full graph optimisation (constant folding, Conv+BN/activation fusion)
and only the CPU provider. The session is built once: creating it costs milliseconds, more
than running a small model on a batch.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

import numpy as np
import onnx
import onnxruntime as ort

__all__ = ["OrtModel", "node_times", "session_options"]


def session_options(threads: int) -> ort.SessionOptions:
    """The settings above; shared by `OrtModel` and `node_times` so profiles show what runs."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3  # errors only
    return options


class OrtModel:
    """Callable ONNX model: `OrtModel(path)(x) -> float32 logits`, evaluated in batches."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None) -> None:
        self.path = os.fspath(path)
        self.threads = int(threads) if threads else (os.cpu_count() or 1)
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.session = ort.InferenceSession(self.path, sess_options=session_options(self.threads),
                                            providers=["CPUExecutionProvider"])
        (feed,) = self.session.get_inputs()
        self.input_name = feed.name
        # Per-sample dims; symbolic ones (strings/None) accept any size.
        self.input_shape = tuple(d if isinstance(d, int) else None for d in feed.shape[1:])
        self.output_name = self.session.get_outputs()[0].name

    def __call__(self, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        """Logits [n, classes] (float32) for samples `x` [n, *input_shape], `batch_size` at a time."""
        x = np.asarray(x)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if x.ndim != len(self.input_shape) + 1 or any(
            want is not None and got != want for got, want in zip(x.shape[1:], self.input_shape)
        ):
            want = "x".join("?" if d is None else str(d) for d in self.input_shape)
            raise ValueError(f"input has shape {tuple(x.shape)}, but {os.path.basename(self.path)} "
                             f"expects [n, {want}] (per-sample {self.input_shape})")
        x = np.ascontiguousarray(x, dtype=np.float32)
        outs = [self.session.run([self.output_name], {self.input_name: x[i:i + batch_size]})[0]
                for i in range(0, len(x), batch_size)]
        if not outs:
            n_out = self.session.get_outputs()[0].shape[-1]
            return np.zeros((0, n_out if isinstance(n_out, int) else 0), dtype=np.float32)
        return np.concatenate(outs).astype(np.float32, copy=False)


def node_times(path: str | os.PathLike[str], x: np.ndarray, threads: int = 1, runs: int = 10) -> list[dict]:
    """Where one `session.run` on `x` spends its time, from onnxruntime's own per-node profile.

    Builds the session as `OrtModel` does, so the rows are the nodes of the *optimised* graph as
    they execute (fused convolutions, NCHWc nodes in the "com.microsoft.nchwc" domain, layout
    reorders). One warm-up run, then `runs` profiled ones. One dict per node, slowest first:
    node, op, domain, mean kernel ms per run, share of the summed node time, input shapes.
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    options = session_options(threads)
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = os.path.join(tmp, "optimised.onnx")
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "ort_profile")
        session = ort.InferenceSession(os.fspath(path), sess_options=options,
                                       providers=["CPUExecutionProvider"])
        feed = {session.get_inputs()[0].name: np.ascontiguousarray(x, dtype=np.float32)}
        for _ in range(runs + 1):
            session.run(None, feed)
        with open(session.end_profiling()) as fh:
            events = json.load(fh)
        domains = {n.name: n.domain for n in onnx.load(options.optimized_model_filepath).graph.node}
    starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    first = starts[-runs] if len(starts) >= runs else 0  # drop the warm-up run
    total: dict[str, float] = defaultdict(float)
    info: dict[str, dict] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first:
            node = e["name"][: -len("_kernel_time")]
            total[node] += e["dur"]
            info[node] = {"op": e["args"].get("op_name", "?"),
                          "inputs": [list(t.values())[0] for t in e["args"].get("input_type_shape", [])]}
    whole = sum(total.values()) or 1.0
    rows = [{"node": node, "op": info[node]["op"], "domain": domains.get(node, ""),
             "ms": round(us / runs / 1000, 4), "share": round(us / whole, 4),
             "inputs": info[node]["inputs"]} for node, us in total.items()]
    return sorted(rows, key=lambda r: -r["ms"])
