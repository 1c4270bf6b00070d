"""The policy service: the adaptive, risk-aware checkpoint decision, fed by step and response-time events."""
