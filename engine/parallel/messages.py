"""What rank 0 (the driver) broadcasts to the other ranks, one pickled message per call on the gloo group."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqUpdate:
    """One scheduled sequence as the other ranks need it for the step (engine/parallel/seq_sync.py)."""

    seq_id: int
    num_preemptions: int
    num_prompt_tokens: int
    new: bool                  # a sequence the ranks do not hold: built afresh from this update
    token_ids: list[int]       # new: every token on the host; else those appended since the last message
    new_table: bool            # block_ids is the whole table (a new sequence, or new pages after preemption)
    block_ids: list[int]       # the table, or the pages appended to it
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_in_flight_tokens: int
    num_prompt_logprobs: int   # len(prompt_logprobs): whether the step scores prompt tokens


@dataclass
class ExecuteStep:
    """Run `ModelRunner.execute` on these sequences; `has_input_ids`: a tensor broadcast follows with the
    step's token ids (a decode step launched on tokens still on the device)."""

    serial: int
    step_id: int
    seqs: list[SeqUpdate]
    released_pages: list[int] = field(default_factory=list)   # freed since the last message
    has_input_ids: bool = False


@dataclass
class PromptLogits:
    """Logits of prompt rows lo..hi of the PromptHidden at `origin` (serial, index) of the current step."""

    origin: tuple[int, int]
    lo: int
    hi: int


@dataclass
class CheckStep:
    """Every rank reports whether its last execute raised (the sum is gathered on the gloo group)."""


@dataclass
class Heartbeat:
    """An idle driver is alive; the ranks answer with a collective, so a hung rank times out."""


@dataclass
class Stop:
    """The server is stopping: leave the group and exit 0."""


Message = ExecuteStep | PromptLogits | CheckStep | Heartbeat | Stop
