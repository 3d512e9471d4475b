"""Which process groups' collectives the overlap's lanes hand the baton over at, and where they wait.

A collective's kind is "tp" (tensor-parallel groups, expert-TP), "ep" (expert-parallel groups: the
token all-to-alls) or "cp" (the context-parallel group: context-parallel attention's all-gathers,
reduce-scatters and all-to-alls, megatron_ext/attention/context_parallel.py), read from megatron's
parallel_state (set_groups); the rules for waiting in place,
without a hand-off, are the same on every rank of a group, so the collectives' order stays the same
everywhere (lanes.py)."""
from __future__ import annotations

from typing import Optional


class _Groups:
    tp: tuple = ()  # groups whose collectives are overlapped (TP, expert-TP)
    ep: tuple = ()  # expert-parallel groups (all-to-all), overlapped too; reported apart
    cp: tuple = ()  # the context-parallel group, overlapped as TP's; reported apart
    hidden: int = 0  # the model's hidden size (set by the schedule): tells token rows from metadata


def is_metadata(kind: Optional[str], width: Optional[int]) -> bool:
    """An EP collective whose rows are at most a quarter of the hidden size wide (routing maps,
    probabilities, per-expert counts) is waited for in place, without handing the baton over: the
    token all-to-alls of a dispatch or combine then alternate with the other micro-batch's compute
    instead of the small collectives between them taking their turns. The row width is the same on
    every rank of the group (only row counts differ), so every rank makes the same choice and the
    collectives stay in the same order everywhere."""
    return kind == "ep" and width is not None and GROUPS.hidden > 0 and 4 * width <= GROUPS.hidden


GROUPS = _Groups()


def waits_in_place(kind: Optional[str], width: Optional[int], lane: Optional["Lane"]) -> bool:
    """Collectives waited for where they are issued, without handing the baton over:

    * EP metadata (is_metadata);
    * a TP (or CP) collective while the other lane has a token all-to-all in flight ("EP first"): handing
      the baton back there would make the other lane wait for its all-to-all after only the compute
      up to this lane's next TP collective. Kept, the all-to-all has all of this lane's compute up
      to its own next token all-to-all behind it. On a cluster the all-to-all crosses nodes and
      costs several times the TP collectives inside a node; both kinds' figures are reported.

    Every rank of a group runs the same two programs under the same rules, so the baton moves at
    the same collectives everywhere and their order stays the same on every rank."""
    if is_metadata(kind, width):
        return True
    return kind in ("tp", "cp") and lane is not None and lane.other.ep_in_flight > 0


def set_groups() -> None:
    """Read the current layout's TP / expert groups from megatron's parallel_state. A group is
    "tp" if its ranks are a tensor-parallel group's (expert-TP, or expert groups with EP=1), and
    "ep" if it spans expert-parallel ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def get(name):
        getter = getattr(ps, name, None)
        if getter is None:
            return None
        try:
            g = getter(check_initialized=False)
        except TypeError:
            g = getter()
        return g if g is not None and g.size() > 1 else None

    tp_group = get("get_tensor_model_parallel_group")
    tp_ranks = sorted(dist.get_process_group_ranks(tp_group)) if tp_group is not None else None
    ep_group = get("get_expert_model_parallel_group")
    ep_size = ep_group.size() if ep_group is not None else 1
    tp, ep = [], []
    for name in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group",
                 "get_expert_model_parallel_group", "get_expert_tensor_and_model_parallel_group"):
        g = get(name)
        if g is None or any(g is x for x in tp + ep):
            continue
        # the expert groups carry the token dispatch: "ep" whenever expert parallelism is on, even
        # where its ranks are the TP group's (TP2 x EP2 on 2 processes, expert-TP 1)
        same_as_tp = tp_ranks is not None and sorted(dist.get_process_group_ranks(g)) == tp_ranks
        is_tp = name in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group") or (
            same_as_tp and name == "get_expert_tensor_and_model_parallel_group" and ep_size < 2)
        (tp if is_tp else ep).append(g)
    GROUPS.tp, GROUPS.ep = tuple(tp), tuple(ep)
    cp = get("get_context_parallel_group")
    GROUPS.cp = (cp,) if cp is not None and not any(cp is g for g in tp + ep) else ()


def group_kind(group) -> Optional[str]:
    if group is None:
        return None
    if any(group is g for g in GROUPS.tp):
        return "tp"
    if any(group is g for g in GROUPS.ep):
        return "ep"
    if any(group is g for g in GROUPS.cp):
        return "cp"
    return None
