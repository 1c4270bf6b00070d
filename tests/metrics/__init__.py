"""Prometheus metrics of real services: failures are injected, `/metrics` is scraped over HTTP and
parsed with prometheus_client's own parser, and the counters must move by exactly what was done."""
