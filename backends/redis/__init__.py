"""The remote tier on Redis / Valkey (standalone or Cluster, TLS, ACL): payloads on the
tier's own RESP connections, control calls through redis-py."""

from backends.redis.tier import RedisOptions, RedisTier

__all__ = ["RedisOptions", "RedisTier"]
