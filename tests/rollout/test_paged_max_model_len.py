"""`PagedGenerator(max_model_len=...)` (rollout.max_model_len): page tables of a fixed width, so a batch with
another `max_new_tokens` reuses the compiled programs, with the same tokens as the dense `Generator`."""

import dataclasses

import numpy as np
import pytest

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout import Generator
from jaxrl_post.rollout.paged import programs
from jaxrl_post.rollout.paged.engine import PagedGenerator
from tests.script_loader import load_test_module

engine_tests = load_test_module("rollout/test_paged_engine")


@pytest.mark.slow  # a dense and a paged compile of a 2-layer model, ~20 s on 2 loaded cores
def test_fixed_table_width_compiles_once_for_two_response_lengths():
    model = init_model(ModelConfig(**engine_tests.TINY), seed=3)
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((3, 12), np.int32), np.zeros((3, 12), np.int32)
    for i, n in enumerate([5, 12, 2]):
        ids[i, 12 - n :], mask[i, 12 - n :] = rng.integers(7, 96, n), 1
    dp = DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": np.array(list("abc"))})
    eng = PagedGenerator(model, **engine_tests.ENGINE, max_model_len=40)
    assert eng.table_pages(12, 20) == eng.table_pages(3, 8) == 10  # 40 tokens / 4 per page, whatever the batch
    long = engine_tests.SAMPLED
    engine_tests._assert_same(eng.generate(dp, long, n=2), Generator(model, decode_chunk=4).generate(dp, long, n=2))
    traces = dict(programs.TRACE_COUNTS)
    short = dataclasses.replace(long, max_new_tokens=8)
    out = eng.generate(dp, short, n=2)
    assert traces == programs.TRACE_COUNTS, "another max_new_tokens compiled again"
    ref = eng.generate(dp, long, n=2)  # per-row keys: the first 8 tokens are the long run's
    got = out.batch["response_attention_mask"].sum(1)
    for row in range(6):
        np.testing.assert_array_equal(out.batch["responses"][row, : got[row]], ref.batch["responses"][row, : got[row]])
    with pytest.raises(ValueError, match="exceed the paged engine's max_model_len 40"):
        eng.generate(dp, dataclasses.replace(long, max_new_tokens=29), n=2)
