"""Which extra brings a module the toolkit imports only when a run needs it, so that a missing
one is said with the `pip install` that mends it (not a traceback, not another extra's name)."""

from __future__ import annotations

EXTRA_OF = {
    "opacus": "privacy",
    "ray": "ray", "psutil": "ray",
    "mnist1d": "sim", "sklearn": "sim", "scipy": "sim", "matplotlib": "sim", "PIL": "sim",
    "onnx": "export", "onnxruntime": "export", "onnxscript": "export",
}


def missing_module_message(exc: ImportError) -> str:
    """One line for an ImportError: the extra that brings the missing module, where it is one of
    ours; the toolkit's own ImportErrors already say what to install."""
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return str(exc) if exc.name is None else f"{exc} (pip install 'fedal-edge[all]' brings what the toolkit uses)"
    return f"{exc}: it comes with the `{extra}` extra (pip install 'fedal-edge[{extra}]')"
