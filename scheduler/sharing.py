"""Prompt sharing between the siblings of one request (OpenAI `n` > 1).

The n completions of one request have the same prompt, so its KV need be
computed once (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023, §4.4, "Parallel
sampling").  The first completion, the leader, is scheduled as usual.  Its
siblings are held back from the policy until the leader has computed the
prompt's shareable blocks; then they adopt those blocks (reference-counted
in the `BlockManager`) and enter the policy with their computed tokens set
past them.

Only whole blocks strictly before the last prompt position are shared:
floor((P - 1) / block_size) blocks of a P-token prompt, so no block needs
the paper's copy-on-write.  Each sibling then still computes at least the
last prompt token, which gives it its own last-position logits to sample
from, and every position it writes lies in a block of its own.  No holder
ever writes a shared block: all of them have computed those positions
already, and recomputation after a preemption or a swap-in starts from
fresh blocks.  (Nor does a sibling ever see the logits of the shared
positions: prompt logprobs belong on the leader, `engine/request.py`.)

When the leader cannot lead any more before that point (aborted, finished,
preempted, swapped out), its held siblings are released to the policy
unshared and prefill by themselves: a sibling never waits on a job that is
not making progress, nor on a less important one (priority inversion).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.blocks import BlockManager
from scheduler.job import Job, JobState


@dataclass(eq=False)
class _Group:
    leader: Job
    # The leader's preemption count when the first sibling was held: any
    # eviction (recompute or swap-out, for whatever reason) raises it.
    preemptions: int
    siblings: list[Job] = field(default_factory=list)


class PromptSharing:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._groups: dict[str, _Group] = {}  # by leader id
        self._leader_of: dict[str, str] = {}  # held sibling id -> leader id
        # Prompt tokens that siblings adopted instead of computing.
        self.num_shared_tokens = 0
        self.num_adopted = 0

    @property
    def num_held(self) -> int:
        return len(self._leader_of)

    def is_held(self, job: Job) -> bool:
        return job.job_id in self._leader_of

    def shareable_blocks(self, job: Job) -> int:
        return (job.num_prompt_tokens - 1) // self.blocks.block_size

    def attach(self, sibling: Job, leader: Job) -> bool:
        """`sibling` (same prompt, nothing computed) arrives for `leader`.

        Adopts at once when the leader has the blocks on the device, holds
        the sibling when the leader is on its way there; True when held (the
        caller must not give it to the policy yet).
        """
        root = self._leader_of.get(leader.job_id)
        if root is not None:  # a held sibling leads nobody: its leader does
            leader = self._groups[root].leader
        k = self.shareable_blocks(sibling)
        if k == 0:
            return False
        if self._has_blocks(leader, k):
            self._adopt(sibling, leader, k)
            return False
        if leader.state is JobState.PREEMPTED or not leader.is_resident:
            return False  # not on its way: computing alone is no slower
        if sibling.priority < leader.priority:
            return False  # never wait on a less important job
        group = self._groups.get(leader.job_id)
        if group is None:
            group = self._groups[leader.job_id] = _Group(leader, leader.num_preemptions)
        group.siblings.append(sibling)
        self._leader_of[sibling.job_id] = leader.job_id
        return True

    @property
    def has_groups(self) -> bool:
        """Whether any sibling waits on a leader (else `on_computed` has
        nothing to do for any job)."""
        return bool(self._groups)

    def on_computed(self, leader: Job) -> list[Job]:
        """`leader` computed more tokens; the siblings that adopted its
        blocks now, for the policy."""
        group = self._groups.get(leader.job_id)
        if group is None:
            return []
        k = self.shareable_blocks(leader)
        if not self._has_blocks(leader, k):
            return []
        self._close(group)
        for s in group.siblings:
            self._adopt(s, leader, k)
        return group.siblings

    def on_gone(self, leader: Job) -> list[Job]:
        """`leader` finished or was aborted: its held siblings go alone."""
        group = self._groups.get(leader.job_id)
        if group is None:
            return []
        self._close(group)
        return group.siblings

    def release_evicted(self) -> list[Job]:
        """After a plan: held siblings of leaders that the plan evicted."""
        out: list[Job] = []
        for group in [g for g in self._groups.values()
                      if g.leader.num_preemptions != g.preemptions]:
            self._close(group)
            out += group.siblings
        return out

    def drop(self, sibling: Job) -> bool:
        """Forget a held sibling (aborted); False if it was not held."""
        leader_id = self._leader_of.pop(sibling.job_id, None)
        if leader_id is None:
            return False
        group = self._groups[leader_id]
        group.siblings.remove(sibling)
        if not group.siblings:
            del self._groups[leader_id]
        return True

    def _has_blocks(self, leader: Job, k: int) -> bool:
        return (leader.num_computed_tokens >= k * self.blocks.block_size
                and leader.is_resident and not leader.is_finished)

    def _adopt(self, sibling: Job, leader: Job, k: int) -> None:
        assert sibling.num_computed_tokens == 0 and not sibling.block_table
        self.blocks.share(sibling, leader, k)
        sibling.num_computed_tokens = k * self.blocks.block_size
        self.num_shared_tokens += sibling.num_computed_tokens
        self.num_adopted += 1

    def _close(self, group: _Group) -> None:
        del self._groups[group.leader.job_id]
        for s in group.siblings:
            del self._leader_of[s.job_id]
