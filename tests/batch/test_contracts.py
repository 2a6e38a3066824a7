"""Stage contracts (batch/contracts.py, rl/stages.py): each way a stage can break its contract is an error naming
the stage; a stage that keeps it passes; the RL step's table covers every key the table declares."""

import numpy as np
import pytest

from jaxrl_post.batch.contracts import StageContract, StageContractError, StagedBatch
from jaxrl_post.batch.keys import BATCH_KEYS
from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rl.stages import STAGES, stage

B, R = 2, 3
LP = StageContract("old_log_prob", reads=("responses",), writes=("old_log_probs",), may_write=("routed_experts",))


def staged() -> StagedBatch:
    z = np.zeros((B, R), np.int32)
    keys = ("responses", "loss_mask", "input_ids", "attention_mask", "position_ids")
    return StagedBatch(DataProto({k: z.copy() for k in keys}))


def test_a_stage_that_keeps_its_contract_passes_and_may_skip_optional_writes():
    s = staged()
    with s.stage(LP) as b:
        b["old_log_probs"] = np.zeros((B, R), np.float32)
    assert set(s.finish()) == {"responses", "loss_mask", "input_ids", "attention_mask", "position_ids", "old_log_probs"}


@pytest.mark.parametrize(
    "body, message",
    [
        (lambda b: None, "did not write ['old_log_probs']"),
        (
            lambda b: b.update(old_log_probs=np.zeros((B, R)), values=np.zeros((B, R))),
            "wrote undeclared keys ['values']",
        ),
        (lambda b: (b.update(old_log_probs=np.zeros((B, R))), b.pop("loss_mask")), "removed keys ['loss_mask']"),
        (
            lambda b: b.update(old_log_probs=np.zeros((B, R)), loss_mask=np.zeros((B, R), np.int32)),
            "replaced undeclared keys ['loss_mask']",
        ),
        (lambda b: b.update(old_log_probs=np.zeros((B + 1, R))), "leading dim 3, expected 2"),
    ],
)
def test_each_broken_write_names_the_stage(body, message):
    s = staged()
    with pytest.raises(StageContractError, match="stage 'old_log_prob'") as e, s.stage(LP) as b:
        body(b)
    assert message in str(e.value)


def test_a_missing_read_and_an_unknown_key_are_errors_on_entry():
    s = StagedBatch(DataProto({"loss_mask": np.ones((B, R), np.int32)}))
    with pytest.raises(StageContractError, match=r"stage 'old_log_prob' reads \['responses'\], missing"), s.stage(LP):
        pass
    s = StagedBatch(DataProto({"responses": np.zeros((B, R), np.int32), "scratch": np.zeros((B,))}))
    with pytest.raises(StageContractError, match=r"not in the batch-key table: \['scratch'\]"), s.stage(LP):
        pass


def test_a_write_between_stages_is_caught_at_the_next_stage_naming_the_last():
    s = staged()
    with s.stage(LP) as b:
        b["old_log_probs"] = np.zeros((B, R), np.float32)
    s.data.batch["old_log_probs"] = np.ones((B, R), np.float32)  # behind the pipeline's back
    with pytest.raises(
        StageContractError, match=r"\['old_log_probs'\] changed outside a stage, after stage 'old_log_prob'"
    ):
        s.finish()


def test_contract_names_must_be_table_keys():
    with pytest.raises(KeyError, match="stage 'x' declares keys not in the batch-key table: \\['nope'\\]"):
        StageContract("x", reads=("nope",))


def test_the_rl_stage_timer_is_summed_and_the_body_error_propagates_unchanged():
    s, timing = staged(), {}
    # a stage's own error is not masked by a contract error (the body wrote nothing)
    with pytest.raises(ZeroDivisionError), stage(s, "old_log_prob", timing):
        raise ZeroDivisionError
    with stage(s, "old_log_prob", timing) as b:
        b["old_log_probs"] = np.zeros((B, R), np.float32)
    assert set(timing) == {"old_log_prob"} and timing["old_log_prob"] >= 0


def test_every_response_key_the_update_reads_is_written_by_some_stage():
    written = {k for c in STAGES.values() for k in (*c.writes, *c.may_write)}
    packer_only = {k for k, v in BATCH_KEYS.items() if v.source == "packer"}
    assert set(BATCH_KEYS) - packer_only - written == set()
