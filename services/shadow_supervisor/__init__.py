"""The shadow supervisor: main and shadow rollout workers per engine, handover, quarantine."""
