"""Weight server, kv-server and the worker-side mapping helpers, against a real nats-server."""
