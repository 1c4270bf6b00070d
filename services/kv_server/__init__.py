"""The kv-server: each engine's KV-cache arena in shared memory, mapped by its workers."""
