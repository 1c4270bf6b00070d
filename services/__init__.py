"""The processes of a Belayer cluster, one folder per kind."""
