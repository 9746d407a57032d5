"""The whole prompt, protected (Random Attention, arXiv 2609.03430)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import EvictionInput, Reservation
from .guards import SelectionError


class PromptReservation(Reservation):
    """Protects every slot holding a prompt token of its row (position below the row's
    ``inp.prompt_lengths``; padding excluded), at every eviction, in every head.

    A budget that cannot hold the prompt beside what is protected before this stage (the recent
    buffer, earlier reservations) is refused at the eviction, naming the prompt and the budget:
    keeping only part of the prompt would silently break the rule the policy is built on. Engines
    that admit requests (vLLM) refuse such a prompt up front (``prompt_refusal``).
    """

    type_name: ClassVar[str] = "prompt"
    reads_values: ClassVar[bool] = False
    needs_prompt: ClassVar[bool] = True

    def reserve(self, inp: EvictionInput, protected: torch.Tensor) -> torch.Tensor:
        prompt = inp.prompt_mask(self)
        total = (protected | prompt).sum(-1)  # [B, Hkv]
        over = total > inp.budget
        if bool(over.any()):
            row, head = (int(i) for i in over.nonzero()[0])
            assert inp.prompt_lengths is not None  # prompt_mask refused otherwise
            length = int(inp.prompt_lengths[row])
            before = int(protected[row, head].sum())
            raise SelectionError(
                f"reservation 'prompt': a prompt of {length} tokens (row {row} of this eviction's input, whose rows are "
                f"the batch rows due, every layer stacked) which with the {before} slots "
                f"protected before it (recent buffer {inp.num_slots - inp.num_candidates}, earlier reservations) "
                f"needs {int(total[row, head])} slots, more than the budget of {inp.budget}: the policy keeps the "
                "whole prompt, so raise the budget (or lower schedule.recent), or shorten the prompt"
            )
        return prompt

    def prompt_refusal(self, prompt_len: int, room: int) -> str | None:
        if prompt_len <= room:
            return None
        return (f"its prompt of {prompt_len} tokens does not fit the {room} slots its policy's budget leaves beside "
                "the recent buffer and other reservations, and reservation 'prompt' keeps the whole prompt: "
                "raise the budget (or lower schedule.recent), or shorten the prompt")
