"""The processes of a Belayer cluster, one folder per kind, and the declaration of each
(shared/declaration.py): what the permissions, the entry points, `belayer up`'s plan, compose.yaml
and `belayer status` are made from."""

from __future__ import annotations

from belayer_rl.services.checkpointer.declaration import CHECKPOINTER
from belayer_rl.services.gateway.declaration import GATEWAY
from belayer_rl.services.kv_server.declaration import KV_SERVER
from belayer_rl.services.policy.declaration import POLICY
from belayer_rl.services.router.declaration import ROUTER
from belayer_rl.services.shadow_supervisor.declaration import SHADOW_SUPERVISOR
from belayer_rl.services.trainer.declaration import TRAINER
from belayer_rl.services.trainer_group.declaration import TRAINER_GROUP
from belayer_rl.services.weight_server.declaration import WEIGHT_SERVER
from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.shared.declaration import Service

# In the order `belayer up` starts them: the servers before the engines that map their segments.
SERVICES: tuple[Service, ...] = (
    ROUTER,
    WEIGHT_SERVER,
    KV_SERVER,
    WORKER,
    SHADOW_SUPERVISOR,
    CHECKPOINTER,
    POLICY,
    GATEWAY,
    TRAINER_GROUP,
    TRAINER,
)
