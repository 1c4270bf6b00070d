"""The gateway service: what it starts and when it serves; `setup` is what the runtime runs
(shared/runtime.py). Its HTTP server is aiohttp's, started once the bus is connected and closed
by the runtime's close callbacks (in-flight responses get --drain-timeout to finish)."""

from __future__ import annotations

from aiohttp import web

from belayer_rl.services.gateway.gateway import Gateway
from belayer_rl.shared.access import AccessError, load_api_keys
from belayer_rl.shared.config import ConfigError, GatewayConfig
from belayer_rl.shared.metrics import GatewayMetrics
from belayer_rl.shared.runtime import Runtime

ENGINE_STATUS_S = 1.0  # how often it asks the router which engines are live


async def setup(rt: Runtime, config: GatewayConfig) -> None:
    assert config.api_keys is not None  # GatewayConfig requires it
    try:
        keys = load_api_keys(config.api_keys)
    except AccessError as exc:
        raise ConfigError(f"--api-keys: {exc}") from None
    nc = await rt.connect()
    gateway = Gateway(config, nc, keys, GatewayMetrics(rt.metrics), rt.metrics.registry)
    runner = web.AppRunner(gateway.app(), access_log=None, handle_signals=False,
                           shutdown_timeout=config.drain_timeout_s)  # fmt: skip
    await runner.setup()
    rt.on_close(runner.cleanup)
    site = web.TCPSite(runner, config.http_host, config.http_port)
    await site.start()
    await gateway.refresh()
    rt.every(ENGINE_STATUS_S, gateway.refresh, "engine-status")
    host, port = runner.addresses[0][:2]  # the port bound, where --http-port 0 asked for a free one
    rt.ready(f"HTTP on http://{host}:{port}; {len(keys)} API key(s); model {config.model_name!r}")
