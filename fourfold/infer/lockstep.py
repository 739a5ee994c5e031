"""Keeping tensor- or pipeline-parallel engine ranks in lockstep: rank 0 sends each step's commands to the rest.

Every rank of a parallel model runs its own LLMEngine over its shards; the engines stay identical as long
as they see the same requests and aborts in the same order before the same steps (they sample with one
shared seed). Rank 0 (which serves HTTP) broadcasts, before each engine step, the commands it is about
to apply (a JSON document as a uint8 tensor, over the group's own backend); the other ranks run `follow`,
which applies the same commands and steps whenever rank 0 does. When idle, rank 0 sends an empty
message every `heartbeat_s` so the followers' collectives never reach the process-group timeout.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist

from fourfold.infer.requests import SamplingParams


class CommandChannel:
    """Broadcasts engine commands from rank 0 of `group` to its other ranks."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, heartbeat_s: float = 30.0):
        self.group, self.heartbeat_s = group, heartbeat_s
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self.source = dist.get_global_rank(group, 0)

    def send(self, commands: list[tuple], stop: bool = False) -> None:
        """Rank 0: the commands (("add", id, ids, params) / ("abort", id)) it applies before its next step."""
        wire = [[kind, rid, *rest[:1], dataclasses.asdict(rest[1])] if kind == "add" else [kind, rid]
                for kind, rid, *rest in commands]
        payload = json.dumps({"commands": wire, "stop": stop}).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, self.source, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device), self.source,
                       group=self.group)

    def receive(self) -> tuple[list[tuple], bool]:
        """Other ranks: (commands, stop) as rank 0 sent them."""
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.broadcast(size, self.source, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, self.source, group=self.group)
        message = json.loads(bytes(payload.cpu().tolist()))
        commands = [(c[0], c[1], c[2], SamplingParams(**c[3])) if c[0] == "add" else (c[0], c[1])
                    for c in message["commands"]]
        return commands, message["stop"]


def apply(engine, commands: list[tuple]) -> None:
    """Apply received commands to a follower's engine exactly as rank 0 applied them."""
    for kind, rid, *rest in commands:
        if kind == "add":
            try:
                engine.add_request(rid, rest[0], rest[1])
            except Exception:  # rank 0 refused it too (and told its caller)
                pass
        else:
            engine.abort_request(rid)


def follow(engine, channel: CommandChannel) -> None:
    """A follower rank's whole life: mirror rank 0's commands and steps until it says stop."""
    while True:
        commands, stop = channel.receive()
        if stop:
            return
        apply(engine, commands)
        if engine.has_unfinished():
            engine.step()
