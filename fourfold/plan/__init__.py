"""Planning a run before it starts: what a config and layout will cost each rank, and which layout to run.

memory (with layout, activations): bytes per rank; steptime: seconds per step on a cluster; hardware: devices,
links and efficiencies as data; predict: both for one layout; search: every valid layout, ranked; report:
tables, overrides, TOML; inference: KV capacity and decode speed; calibrate: measure this machine.
"""
