"""The engine's sans-I/O core: jobs and the job core, the CPU tier's bookkeeping, the
scheduler-side interface it implements, eviction policies."""
