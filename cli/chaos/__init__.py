"""`belayer chaos`: a seeded fault campaign against a local cluster, and the oracle that judges it.

The campaign starts what `belayer up` starts (nats-server, a router and a warm standby, workers
under the shadow supervisor, the weight and KV servers, the checkpointer and the policy service)
and keeps two kinds of work running throughout:
- generations, each compared afterwards with its fault-free reference (the engine in-process);
- sandbox trajectories, whose every action appends a line to a file and prints the file, and which
  are checkpointed after every action with an L_k of their own making; a failed sandbox is
  restored from its latest checkpoint and carries on.

Meanwhile a seeded schedule injects faults, one every `--interval` seconds on average: SIGKILL and
SIGSTOP/SIGCONT of workers, routers and services, nats-server killed and restarted, sandbox
containers killed and paused, the checkpoint store full for a while, dockerd restarted. Each fault
is a `chaos_fault` event. The seed fixes the kinds and the times; the targets are whatever is in
flight when a fault fires. The campaign runs its own nats-server, its own dockerd and its own
size-capped checkpoint store (a tmpfs), so that restarting or filling them touches nothing else;
the last two need root.

The oracle then checks:
- every generation's tokens equal its reference;
- the token log: every whole chunk came from the attempt its request was last dispatched to, no
  record of a router incarnation older than one that claimed the request, and the tokens the log
  holds for each finished request are the ones its client got (no acknowledged chunk lost);
- every action's output shows exactly the file its trajectory wrote so far, after any restore too;
  every restore returns the L_k its checkpoint was given and no checkpoint older than the newest
  acknowledged one;
- at least `--min-completion` of the generations and of the trajectories completed; any that did
  not names the bound that stopped it;
- afterwards nothing leaked: no shared-memory segment, container, checkpoint or process of the
  cluster, and no more JetStream consumers than the cluster held at rest.

    belayer chaos --faults 1000 --seed 7 [--json]

The parts, each a module: config (the settings and the fault kinds), workload (the generations and
trajectories kept running, and their references), lab (the campaign's own nats-server, dockerd and
store), injector (the seeded faults), oracle (the checks), campaign (the run and the command).
Beside the campaign, training (`belayer train --chaos worker@2:kill,...`): the rollout side's faults
of a training run's schedule, struck at the local cluster.
"""
