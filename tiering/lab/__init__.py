"""Offline tools over the engine: trace replay, policy sweeps, fleets and workloads."""
