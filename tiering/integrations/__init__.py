"""kv-tiering's tiers inside serving frameworks (each integration is an optional extra)."""
