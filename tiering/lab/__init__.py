"""Offline tools over the engine: trace replay, policy sweeps, fleets, workloads and the
workload suite."""
