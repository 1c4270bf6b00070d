"""The wire contract and the thin layers over it: bus, config, client, CLI."""
