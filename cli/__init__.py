"""The top layer: the `belayer` command, the local cluster, the demo and the benchmarks. It imports
the services; nothing below it imports it."""
