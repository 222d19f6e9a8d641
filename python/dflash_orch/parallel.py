"""Data-parallel torch drafters: the D drafter ranks of a run form one `torch.distributed`
process group (gloo on CPU, NCCL on GPU) at a rendezvous the orchestrator picks: a FileStore in
the run directory on one node, the authenticated store of `authstore.py` across nodes.

Every rank takes the same optimiser step, so every rank must hold the same summed gradient, to
the bit, whatever the timing. A reduction whose order follows message arrival does not promise
that; this one adds in a fixed order. The flattened gradient is cut into one piece per rank:
rank k gathers piece k from every rank and adds them in rank order (0, 1, ..., D - 1), then every
rank gathers every summed piece. The result depends only on the ranks' gradients.

Two ranks' weights are compared by a checksum, not a copy: per tensor the f64 sum and sum of
squares of its values, gathered from every rank (identical bits give identical sums).
"""

import datetime
import math

import torch


class Group:
    """This process's place in the drafters' process group."""

    def __init__(self, rank, world, device, timeout_s=120.0, store=None, address=None, port=None,
                 key=None):
        """Joins the group at `store`, a FileStore's path in a directory of the run's own (one
        node: nothing another user can reach), or at `address:port`, node 0's rendezvous host,
        through the store of `dflash_orch.authstore` that global rank 0 serves there to peers
        holding `key` (several nodes)."""
        import torch.distributed as dist

        if not 0 <= rank < world:
            raise ValueError(f"drafter rank {rank} is outside the group of {world}")
        self.dist = dist
        self.rank, self.world = int(rank), int(world)
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.server = None
        timeout = datetime.timedelta(seconds=float(timeout_s))
        if store is not None:
            rendezvous = dist.FileStore(str(store), self.world)
        elif address is not None and key is not None:
            from .authstore import AuthStore, StoreServer

            if self.rank == 0:
                self.server = StoreServer(str(address), int(port), key)
            rendezvous = AuthStore(str(address), int(port), key, float(timeout_s))
        else:
            raise ValueError("the drafters' group needs a store path, or an address with the "
                             "run's key")
        dist.init_process_group(self.backend, store=rendezvous, rank=self.rank,
                                world_size=self.world, timeout=timeout)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        if self.server is not None:
            self.server.close()

    def sum_in_rank_order(self, flat):
        """The sum over the ranks of each rank's 1-D `flat` (same length on every rank), added in
        rank order; the same bits on every rank."""
        dist, world = self.dist, self.world
        n = flat.numel()
        per = max(1, math.ceil(n / world))
        padded = torch.zeros(per * world, dtype=flat.dtype, device=flat.device)
        padded[:n] = flat
        pieces = list(padded.split(per))
        mine = None
        for k in range(world):
            into = [torch.empty_like(pieces[k]) for _ in range(world)] if self.rank == k else None
            dist.gather(pieces[k].contiguous(), into, dst=k)
            if self.rank == k:
                total = into[0].clone()
                for other in into[1:]:
                    total += other
                mine = total
        out = [torch.empty(per, dtype=flat.dtype, device=flat.device) for _ in range(world)]
        dist.all_gather(out, mine)
        return torch.cat(out)[:n]

    def checksums(self, tensors):
        """Per rank, the checksum of `tensors` (a list of [sum, sum of squares] per tensor)."""
        local = torch.tensor([[float(t.double().sum()), float(t.double().pow(2).sum())]
                              for t in tensors], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        self.dist.all_gather(out, local)
        return [o.tolist() for o in out]


def sum_gradients(group, params, names, skip):
    """Replaces each parameter's gradient by the sum of every rank's, in rank order (a parameter
    without a gradient on a rank counts as zeros there), and agrees on the step: returns
    (skip, any_gradient), the same on every rank. A rank that drops its micro-batches (`skip`)
    drops the group's step everywhere; when no rank has a gradient, there is no step at all, as
    with one drafter."""
    shapes = [params[n].shape for n in names]
    have = any(params[n].grad is not None for n in names)
    flat = torch.cat([
        (params[n].grad if params[n].grad is not None else torch.zeros_like(params[n])).reshape(-1)
        for n in names
    ] + [torch.tensor([1.0 if skip else 0.0, 1.0 if have else 0.0],
                      dtype=params[names[0]].dtype, device=params[names[0]].device)])
    total = group.sum_in_rank_order(flat)
    skip_any, any_gradient = bool(total[-2] > 0), bool(total[-1] > 0)
    at = 0
    for n, shape in zip(names, shapes):
        size = math.prod(shape)
        params[n].grad = total[at:at + size].view(shape).clone() if any_gradient else None
        at += size
    return skip_any, any_gradient
