"""The router: request routing, the token log, resumption."""
