"""The stages of one RL step (`rl/step.py`) and the batch keys each reads and writes (`batch/contracts.py`).

| stage | reads | writes |
|---|---|---|
| rollout | - | the rollout's token fields, `token_level_scores` (+ rollout log-probs, routes, baselines, versions) |
| old_log_prob | token fields, `responses` (+ `routed_experts`: R3) | `old_log_probs` (+ `routed_experts`: R2) |
| ref | token fields, `responses` | `ref_log_prob` |
| teacher | token fields, `responses` | `teacher_log_prob` (+ top-k ids and log-probs) |
| values | token fields, `responses` | `values` |
| rollout_correction | `old_log_probs`, `rollout_log_probs` | `rollout_is_weights` (token IS) |
| adv | `token_level_scores`, `loss_mask` (+ old / ref log-probs, values, baselines) | rewards, advantages, returns |
| update_critic | token fields, `responses`, `loss_mask`, `values`, `returns` | - |
| update_actor | token fields, `responses`, `loss_mask`, `advantages` (+ the actor's optional inputs) | - |

The stage names are the step's timers (`timing_s/<stage>`; rollout's are `gen` and `reward`, inside the stage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jaxrl_post.batch.contracts import StageContract, StagedBatch
from jaxrl_post.batch.keys import ACTOR_UPDATE_KEYS, TOKEN_KEYS
from jaxrl_post.rl.dynamic_sampling import timer

_TOKENS = (*TOKEN_KEYS, "responses")
_ROLLOUT_ALWAYS = (
    "prompts",
    *_TOKENS,
    "response_attention_mask",
    "loss_mask",
    "truncated",
    "token_level_scores",
)
_ROLLOUT_OPTIONAL = (
    "rollout_log_probs",
    "sampling_logit_threshold",
    "routed_experts",
    "reward_baselines",
    "rollout_versions",
)

STAGES: dict[str, StageContract] = {
    c.name: c
    for c in (
        StageContract("rollout", writes=_ROLLOUT_ALWAYS, may_write=_ROLLOUT_OPTIONAL),
        StageContract(
            "old_log_prob",
            reads=_TOKENS,
            may_read=("sampling_logit_threshold", "routed_experts"),
            writes=("old_log_probs",),
            may_write=("routed_experts",),
        ),
        StageContract("ref", reads=_TOKENS, may_read=("sampling_logit_threshold",), writes=("ref_log_prob",)),
        StageContract(
            "teacher",
            reads=_TOKENS,
            writes=("teacher_log_prob",),
            may_write=("teacher_topk_log_probs", "teacher_topk_ids"),
        ),
        StageContract("values", reads=_TOKENS, writes=("values",)),
        StageContract(
            "rollout_correction", reads=("old_log_probs", "rollout_log_probs"), may_write=("rollout_is_weights",)
        ),
        StageContract(
            "adv",
            reads=("token_level_scores", "loss_mask"),
            may_read=("old_log_probs", "ref_log_prob", "values", "reward_baselines"),
            writes=("token_level_rewards", "advantages", "returns"),
        ),
        StageContract("update_critic", reads=(*_TOKENS, "loss_mask", "values", "returns")),
        StageContract(
            "update_actor", reads=(*_TOKENS, "loss_mask", "advantages"), may_read=(*ACTOR_UPDATE_KEYS, "routed_experts")
        ),
    )
}


@contextlib.contextmanager
def stage(staged: StagedBatch, name: str, timing: dict[str, float] | None = None) -> Iterator[dict]:
    """Stage `name` of `STAGES` over `staged` (its contract checked, `batch/contracts.py`), timed into
    `timing[name]` when `timing` is given; yields the batch dict the stage writes into. Raises
    StageContractError (a pipeline bug) naming the stage; KeyError for an unknown stage name."""
    contract = STAGES[name]
    if timing is None:
        with staged.stage(contract) as batch:
            yield batch
        return
    with timer(name, timing), staged.stage(contract) as batch:
        yield batch
