"""What a training framework's rollout function needs to run its samples as Belayer trajectories,
whatever the framework: a connection to the cluster, the text of a sample's prompt, and the Task it
names. The framework-specific parts (the call signature, the output type, the status mapping, the
seeds) stay in each adapter (examples/verl, examples/slime); the trainable tokens come from the
result itself (`TrajectoryResult.prompt_len` and `loss_mask`).

- `await client(url, cluster_id, creds, name)`: the `Client` of the running event loop for that
  cluster, connected once and shared by every sample of that loop; `await close_clients()` closes the
  ones the running loop opened (at shutdown, and after a test).
- `prompt_text(messages_or_text)`: a string as is, chat messages' contents one after another.
- `task_for(prompt, spec, task_id)`: a Task with that prompt, shaped by a mapping of its other fields,
  else one of Belayer's shell tasks.

The one piece of module state is the client cache (`ClientCache`, one instance here): a framework
calls its rollout function once per sample, with nothing of its own to keep a connection in, so the
connection lives with the module, one per event loop since a NATS connection is bound to its loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from belayer_rl.services.rollout.workloads import Task, shell_tasks
from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.subjects import Subjects

# ---------------------------------------------------------------- the connection, one per event loop

ClientKey = tuple[asyncio.AbstractEventLoop, str, str | None, str | None, str]


class ClientCache:
    """Clients by event loop, cluster (URL, cluster id, credentials) and connection name. A connection
    being made is shared too: samples that start together wait on the one connect."""

    def __init__(self) -> None:
        self.pending: dict[ClientKey, asyncio.Future[Client]] = {}

    async def get(self, url: str, cluster_id: str | None, creds: str | None, name: str) -> Client:
        """The Client of this event loop for that cluster, connected now if there is none (or the one
        there failed to connect or has closed)."""
        key = (asyncio.get_running_loop(), url, cluster_id, creds, name)
        pending = self.pending.get(key)
        if pending is None or (
            pending.done() and (pending.cancelled() or pending.exception() or pending.result().nc.is_closed)
        ):
            target = Target(
                url,
                Subjects(cluster_id) if cluster_id else Subjects(),
                Access(creds=Path(creds)) if creds else Access(),
            )
            pending = self.pending[key] = asyncio.ensure_future(Client.connect(target, name))
        return await pending

    async def close(self) -> None:
        """Close the connections this event loop opened and forget them."""
        loop = asyncio.get_running_loop()
        for key in [k for k in self.pending if k[0] is loop]:
            pending = self.pending.pop(key)
            if pending.done() and not pending.cancelled() and pending.exception() is None:
                await pending.result().nc.close()


CLIENTS = ClientCache()  # the module's one cache: see the module docstring


async def client(
    url: str, cluster_id: str | None = None, creds: str | None = None, name: str = "belayer-rollout"
) -> Client:
    """The Client of this event loop for that cluster: connected once, shared by every sample."""
    return await CLIENTS.get(url, cluster_id, creds, name)


async def close_clients() -> None:
    """Close the connections this event loop opened (at shutdown; tests call it)."""
    await CLIENTS.close()


# ---------------------------------------------------------------- sample -> task


def prompt_text(messages_or_text: str | Iterable[Mapping[str, Any]]) -> str:
    """The text of a prompt: a string as is, chat messages' contents one after another (of a content
    given as a list of typed parts, the text parts)."""
    if isinstance(messages_or_text, str):
        return messages_or_text
    parts = []
    for message in messages_or_text:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        parts.append(content)
    return "\n".join(parts)


TASK_FIELDS = frozenset(f.name for f in dataclasses.fields(Task)) - {"prompt"}


def task_for(prompt: str, spec: Mapping[str, Any] | None, task_id: str) -> Task:
    """A Task with this prompt, shaped by `spec` (a mapping of Task's other fields, as a dataset gives
    them: lists for tuples, maybe strings for numbers; unknown keys are ignored) or a shell task."""
    if not spec:
        return dataclasses.replace(shell_tasks(1)[0], task_id=task_id, prompt=prompt)
    fields = {k: v for k, v in dict(spec).items() if k in TASK_FIELDS}
    fields.setdefault("task_id", task_id)
    fields.setdefault("max_turns", 1)
    if "menu" in fields:
        fields["menu"] = tuple(str(action) for action in fields["menu"])
    for name in ("max_turns", "max_tokens"):
        if name in fields:
            fields[name] = int(fields[name])
    return Task(prompt=prompt, **fields)
