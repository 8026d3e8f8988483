"""The device runtime: one agent per Raspberry Pi, speaking MQTT to the coordinator.

It trains a private model on private data with a strategy's client half, uploads only what the
strategy allows (logits, or weights for parameter-sharing strategies), applies the server's
feedback, and checkpoints after every phase. Needs only the `agent` extra (no web stack).
"""
