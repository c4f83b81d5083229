"""Training rows in verl's no-padding layout, built in one pass over the rows.

verl's engines take a micro-batch as a TensorDict: left-padded prompts, right-padded responses
and their masks, plus the rows' real tokens and positions as jagged (nested) tensors. verl builds
the jagged part from the padded one (`left_right_2_no_padding`), slicing every row on its own;
for a pass bound by host time that conversion was a tenth of the verl engine's overhead per
micro-batch. `no_padding_batch` writes the same TensorDict from the rows' token lists with a
handful of whole-batch operations (tests/trainer/test_verl_backend.py checks it key for key against
verl's conversion).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch
import torch.nn.functional as F

from client_app.rollout import TrainRow
from client_app.trainer.advantages import pad_rows


def no_padding_batch(rows: Sequence[TrainRow], pad_id: int, per_row: Mapping[str, Sequence[torch.Tensor]]) -> Any:
    """`rows` as `left_right_2_no_padding` leaves them: `prompts` [B, P] (left-padded),
    `responses`, `response_mask` = `loss_mask` [B, R] (right-padded), `attention_mask` [B, P+R],
    `input_ids` and `position_ids` jagged over each row's real tokens, `max_seq_len`,
    `max_response_len` and the real tokens' flat `indices` in [B, P+R]; each `per_row` entry
    (one fp32 value per response token and row) right-padded to [B, R]."""
    from verl.utils import tensordict_utils as tu

    prompt_lens = torch.tensor([len(rw.prompt_ids) for rw in rows])
    response_lens = torch.tensor([len(rw.response_ids) for rw in rows])
    p_max, r_max = int(prompt_lens.max()), int(response_lens.max())
    in_prompt = torch.arange(p_max) >= (p_max - prompt_lens)[:, None]
    in_response = torch.arange(r_max) < response_lens[:, None]

    def fill(shape: tuple[int, int], where: torch.Tensor, values: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
        flat = torch.tensor(list(chain.from_iterable(values)), dtype=torch.long)
        return torch.full(shape, pad, dtype=torch.long).masked_scatter_(where, flat)

    n = len(rows)
    prompts = fill((n, p_max), in_prompt, [rw.prompt_ids for rw in rows], pad_id)
    responses = fill((n, r_max), in_response, [rw.response_ids for rw in rows], pad_id)
    response_mask = fill((n, r_max), in_response, [rw.mask for rw in rows], 0)
    attention = torch.cat([in_prompt, in_response], 1)
    lengths = prompt_lens + response_lens
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))  # each row's first token in the packed layout, and the end
    tokens = torch.cat([prompts, responses], 1)[attention]
    positions = torch.arange(len(tokens)) - torch.repeat_interleave(offsets[:-1], lengths)
    tensors: dict[str, Any] = {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention.long(),
        "position_ids": torch.nested.nested_tensor_from_jagged(positions, offsets=offsets),
        "response_mask": response_mask,
    }
    tensors.update({key: pad_rows(values, r_max) for key, values in per_row.items()})
    td = tu.get_tensordict(tensors)
    tu.assign_non_tensor(
        td,
        max_seq_len=p_max + r_max,
        max_response_len=r_max,
        indices=torch.nonzero(attention.flatten()).flatten(),
    )
    # verl's unpad_input gives the ids' offsets as int32 (and the positions' as int64)
    td["input_ids"] = torch.nested.nested_tensor_from_jagged(tokens, offsets=offsets.to(torch.int32))
    td["loss_mask"] = td["response_mask"]
    return td
