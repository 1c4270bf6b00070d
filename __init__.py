"""Belayer: a fault-tolerance layer for agentic RL training.

`services/` holds one folder per kind of process; `shared/` holds the wire contract and the thin
layers every process uses (bus, config, client, CLI).
"""
