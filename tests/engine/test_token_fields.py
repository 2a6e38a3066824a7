"""`engine/token_fields.py`: per-token fields (routing replay's `routed_experts`) packed like `input_ids` and back."""

import numpy as np
import pytest

from jaxrl_post.engine import packing
from jaxrl_post.engine.token_fields import pack_tokens, unpack_tokens


@pytest.mark.parametrize("share_prompts,shards", [(False, 1), (True, 1), (False, 2)])
def test_pack_tokens_follows_input_ids_and_unpack_inverts_it(share_prompts, shards):
    """A field holding each token's (row, column) lands where `pack_batch` put that token (its packed `input_ids`
    are the token ids read through the field), and `unpack_tokens` gives back the field on every real token, 0 at
    padding. Samples of one prompt (pairs of rows here) share it when `share_prompts`."""
    rng = np.random.RandomState(0)
    m, p, r = 8, 5, 4
    prompts = np.repeat(rng.randint(1, 90, (m // 2, p)), 2, axis=0)
    ids = np.concatenate([prompts, rng.randint(1, 90, (m, r))], 1).astype(np.int32)
    mask = np.ones((m, p + r), np.int32)
    mask[0:2, :2] = 0  # left-padded prompt (both samples), right-padded responses
    mask[3, -2:] = 0
    mask[5, p:] = 0  # an empty response
    batch = dict(input_ids=ids, attention_mask=mask, responses=ids[:, p:])
    spec = packing.make_pack_spec(m, 4, p, r, row_len=2 * (p + r), share_prompts=share_prompts, shards=shards)
    plan = packing.plan_batch(batch, spec)
    packed = packing.pack_batch(batch, spec, plan)
    where = np.stack(np.meshgrid(np.arange(m), np.arange(p + r), indexing="ij"), -1).astype(np.int16)  # [M, T, 2]
    field = pack_tokens(where, plan, spec)
    real = packed["segment_ids"] != 0
    assert field.shape == (*packed["input_ids"].shape, 2) and not field[~real].any()
    np.testing.assert_array_equal(ids[field[real][:, 0], field[real][:, 1]], packed["input_ids"][real])
    if share_prompts:  # a shared prompt is written once: fewer packed tokens than real ones
        assert real.sum() < mask.sum()
    back = unpack_tokens(field, plan, spec, p + r)
    valid = mask != 0
    # every real token gets its own entry back, or (a shared prompt) that of the sample which wrote the prompt
    np.testing.assert_array_equal(ids[back[..., 0], back[..., 1]][valid], ids[valid])
    np.testing.assert_array_equal(back[..., 1][valid], np.nonzero(valid)[1])
    assert not back[~valid].any()
    if not share_prompts:
        np.testing.assert_array_equal(back[valid], where[valid])
