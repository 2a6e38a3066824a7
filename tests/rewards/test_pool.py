"""`RewardWorkerPool(preload=...)`: a slow first import happens before a worker reports ready, so it never
counts against a call's timeout (found by the new-user trial of issue 55: on a loaded machine reasoning-gym's
import took 20 s, the first call of each reward worker timed out, and so did each replacement's: 38 of 200
validation rewards scored 0)."""

import sys
import textwrap

from jaxrl_post.rewards.manager import RewardManager
from jaxrl_post.rewards.pool import RewardWorkerPool


def test_preloaded_slow_import_does_not_count_against_the_call_timeout(tmp_path, monkeypatch):
    (tmp_path / "nu_slow_import.py").write_text("import time\ntime.sleep(3.0)\nVALUE = 7\n")
    (tmp_path / "nu_lazy_reward.py").write_text(
        textwrap.dedent(
            """
            def score(x):
                import nu_slow_import  # imported on the first call, as reasoning-gym's scorer does

                return x + nu_slow_import.VALUE
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # workers (forkserver) get the parent's sys.path
    from nu_lazy_reward import score

    args = [(i,) for i in range(4)]
    with RewardWorkerPool(score, 1, timeout_s=1.5, preload=("nu_slow_import",)) as pool:
        res = pool.map(args)
    assert [(r.status, r.value) for r in res] == [("ok", i + 7) for i in range(4)]
    assert pool.num_restarts == 0
    # without the preload the import lands in the first call of every new worker: each one times out
    with RewardWorkerPool(score, 1, timeout_s=1.5) as pool:
        res = pool.map(args[:2])
    assert [r.status for r in res] == ["timeout", "timeout"] and pool.num_restarts == 2
    sys.modules.pop("nu_lazy_reward", None)


def test_builtin_scorer_workers_preload_reasoning_gym():
    """The built-in scorer (reasoning-gym tasks) gets reasoning_gym preloaded; a user's function gets nothing."""

    class Tok:
        def batch_decode(self, seqs, skip_special_tokens=True):
            return ["" for _ in seqs]

    m = RewardManager(None, Tok(), num_workers=1)
    assert m._pool.preload == ("reasoning_gym",)
    m.close()
    m = RewardManager(len, Tok(), num_workers=1)
    assert m._pool.preload == ()
    m.close()
