"""The checkpointer's fixtures (Docker with CRIU, a nats-server URL), for the checkpointer metrics test."""

from tests.checkpointer.conftest import docker_env, nats_url  # noqa: F401  (fixtures, found by name)
