"""The gateway, declared (shared/declaration.py): one per cluster, a client of the router with a
role of its own. It serves HTTP (OpenAI's completions and chat completions, SGLang's /generate)
and calls the router under `gateway.<API key name>`, so each key owns the requests it starts."""

from __future__ import annotations

from belayer_rl.shared.access import API_KEYS_FILE, write_api_keys
from belayer_rl.shared.config import GatewayConfig
from belayer_rl.shared.declaration import Compose, Deployment, Planned, Service, Variable, event

DEFAULT_KEY = "default"


def up(cluster: Deployment) -> list[Planned]:
    """With `belayer up --gateway`: the gateway, and an API key `default` in the cluster's credentials
    folder (kept across restarts: its holders keep their access)."""
    if not cluster.gateway:
        return []
    folder = cluster.creds_dir or cluster.state_dir / "creds"
    folder.mkdir(parents=True, exist_ok=True)
    write_api_keys(folder, (DEFAULT_KEY,))
    settings = cluster.settings(GatewayConfig, "gateway") | {"api_keys": folder / API_KEYS_FILE}
    return [Planned("gateway", GatewayConfig(**settings))]


GATEWAY = Service(
    name="gateway",
    summary="Serve the HTTP API (OpenAI- and SGLang-shaped) over the router.",
    runs="cluster",
    config=GatewayConfig,
    setup="belayer_rl.services.gateway.service:setup",
    client=True,  # the router streams chunks into its inboxes
    subscribes=(event("router_started"),),  # a restarted router: every open stream re-attaches
    publishes=(
        # Under `<its name>.<key>`: the router records the key as the owner (shared/subjects.caller).
        lambda s, x: s.router_generate(f"{x.client}.*"),
        lambda s, x: s.router_attach(f"{x.client}.*"),
        lambda s, x: s.router_cancel(f"{x.client}.*"),
        lambda s, x: s.router_keepalive(f"{x.client}.*"),
        lambda s, x: s.router_status,
    ),
    up=up,
    up_settings=("http_port", "max_concurrent"),
    up_flags={"http_port": "--gateway-port", "max_concurrent": "--gateway-max-concurrent"},
    compose=Compose(
        uid=2006,
        note="""The HTTP API: OpenAI's /v1/completions and /v1/chat/completions, SGLang's /generate, with token
ids, logprobs and weight versions (README, "HTTP gateway"). Keys: `belayer creds` writes
api-key-<name> for the callers and their digests, api-keys.json, which this reads.""",
        args=("--http-host", "0.0.0.0", "--api-keys", f"/run/secrets/{API_KEYS_FILE}"),
        secrets={API_KEYS_FILE: API_KEYS_FILE},
        after=("router",),
        variables={
            "BELAYER_GATEWAY_PORT": Variable("8000", "the gateway's HTTP port, published on 127.0.0.1 only")
        },
        keys={"ports": ["127.0.0.1:$BELAYER_GATEWAY_PORT:8000"]},
    ),
)
