"""FedAL Edge core: strategies, models, data, protocol and the in-process simulator.

The core never imports network or web libraries; `edge_agent` and `coordinator` build on it.
"""

__version__ = "0.1.0"
