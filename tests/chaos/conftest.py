from tests.checkpointer.conftest import docker_env  # noqa: F401 - the campaign runs sandboxes
