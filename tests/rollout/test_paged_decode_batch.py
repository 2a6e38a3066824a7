"""The paged engine's decode batch follows the running sequences (issue 56): a dispatch runs them padded to the
smallest compiled size (`cudagraph_capture_sizes`, vLLM's name; default powers of two from 8 and `max_num_seqs`),
not the whole slot batch, and gives the dense `Generator`'s tokens (log-probs to float rounding) while the sizes
shrink as sequences retire; one decode program per size used."""

import numpy as np
import pytest

from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.rollout import Generator, SamplingParams
from jaxrl_post.rollout.paged import programs
from jaxrl_post.rollout.paged.dispatch import by_slot, decode_batch_sizes, padded_batch_size
from jaxrl_post.rollout.paged.engine import PagedGenerator
from tests.rollout.test_paged_engine import EXACT, TINY, left_padded_prompts


def test_decode_batch_sizes_by_hand():
    assert decode_batch_sizes(256) == (8, 16, 32, 64, 128, 256)
    assert decode_batch_sizes(4) == (4,) and decode_batch_sizes(8) == (8,) and decode_batch_sizes(12) == (8, 12)
    assert decode_batch_sizes(12, [4, 1, 100, 2, 4]) == (1, 2, 4, 12)  # sorted, unique, capped, max_num_seqs added
    for bad in ([0], [3, -1], [2.5], [True]):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            decode_batch_sizes(16, bad)
    sizes = (8, 16, 32)
    assert [padded_batch_size(sizes, r) for r in (0, 1, 8, 9, 16, 17, 32)] == [8, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        PagedGenerator(init_model(ModelConfig(**TINY), seed=3), cudagraph_capture_sizes=(0,))
    out = by_slot(np.array([[1, 2], [3, 4], [9, 9]]), np.array([5, 1, 6]), 6)  # entry 2 is padding (slot 6 = S)
    np.testing.assert_array_equal(out, [[0, 0], [3, 4], [0, 0], [0, 0], [0, 0], [1, 2]])


@pytest.mark.slow  # three decode sizes of a 2-layer model compile, ~25 s on 2 cores
def test_decode_batch_shrinks_with_the_running_sequences(monkeypatch):
    model = init_model(ModelConfig(**TINY), seed=3)
    dp = left_padded_prompts(1)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, eos_token_ids=(4, 5, 6, 7, 8), seed=5)
    dense = Generator(model, decode_chunk=4).generate(dp, params, n=4)  # 20 sequences
    ends = dense.batch["response_attention_mask"].sum(1)
    assert ends.min() <= 8 and (ends == 24).sum() <= 8, "the test needs sequences that retire early"
    real, seen = programs.decode, []

    def recording(*args, **kw):
        seen.append(np.asarray(args[6]))  # idx [D, B]: slots of the batch entries, S for padding
        return real(*args, **kw)

    monkeypatch.setattr(programs, "decode", recording)
    before = programs.TRACE_COUNTS["decode"]
    eng = PagedGenerator(model, max_num_seqs=32, max_num_batched_tokens=64, page_size=4, steps_per_dispatch=4)
    out = eng.generate(dp, params, n=4)
    for k in EXACT:
        np.testing.assert_array_equal(out.batch[k], dense.batch[k], err_msg=k)
    np.testing.assert_allclose(out.batch["rollout_log_probs"], dense.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    sizes = [idx.shape[1] for idx in seen]
    running = [int((idx < 32).sum()) for idx in seen]
    assert running[0] == 20 and sizes[0] == 32
    assert sizes == [8 if r <= 8 else 16 if r <= 16 else 32 for r in running]  # the smallest size that holds them
    assert sizes[-1] == 8 and 16 in sizes  # it shrank as sequences retired
    st = eng.last_stats
    assert st["decode_row_steps"] == 4 * sum(sizes) < 4 * 32 * len(sizes)
    assert programs.TRACE_COUNTS["decode"] - before == len(set(sizes)) == 3  # one program per size
