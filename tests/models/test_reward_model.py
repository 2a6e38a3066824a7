"""Reward model (models/reward_model.py, hf_io.load/save_reward_model) against transformers'
`*ForSequenceClassification` (torch as a test-only reference)."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.models import init_model
from jaxrl_post.models.hf_io import load_reward_model, save_reward_model
from jaxrl_post.models.reward_model import RewardModel, last_token_index, segment_end_mask
from tests.models.test_models import BASE, _tiny

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 0
SEQ_CLS_CASES = {
    "llama": ("LlamaConfig", dict(BASE, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict({k: v for k, v in BASE.items() if k != "head_dim"}, tie_word_embeddings=True)),
}


def _hf_rm(case, tmp_path):
    cls_name, kw = SEQ_CLS_CASES[case]
    cfg = getattr(transformers, cls_name)(**kw, num_labels=1, pad_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # O(1) scores so every op matters
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.15 * torch.randn_like(p))
    assert type(model).__name__ == f"{ {'llama': 'Llama', 'qwen2': 'Qwen2'}[case] }ForSequenceClassification"
    model.save_pretrained(tmp_path)
    return model


def _padded(vocab, side, b=3, t=10, seed=0):
    """Token ids in [1, vocab) (0 = PAD only at padding), rows of lengths 10, 6, 3 padded on `side`."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, vocab, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.int32)
    for i, n in enumerate((10, 6, 3)[:b]):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, t - n :] = 1
    return np.where(mask == 1, ids, PAD).astype(np.int32), mask


def _hf_scores(model, ids, mask):
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0)  # positions from the mask (verl passes them the same way)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(pos),
        )
    assert out.logits.shape == (ids.shape[0], 1)
    return out.logits[:, 0].float().numpy()


_rm_forward = jax.jit(lambda m, ids, mask: m(ids, mask))


@pytest.mark.parametrize("case", list(SEQ_CLS_CASES))
def test_seq_cls_logit_parity_left_and_right_padding(case, tmp_path):
    hf = _hf_rm(case, tmp_path)
    ours = load_reward_model(tmp_path)
    assert isinstance(ours, RewardModel) and ours.backbone.lm_head is None
    assert ours.pad_token_id == PAD
    for side in ("right", "left", "pad_is_eos"):
        ids, mask = _padded(ours.config.vocab_size, "right" if side == "pad_is_eos" else side)
        if side == "pad_is_eos":  # rows end with the pad id as a real token (pad = eos): both skip it
            last = mask.sum(1) - 1
            ids[np.arange(3), last] = PAD
        ref = _hf_scores(hf, ids, mask)
        got = np.asarray(_rm_forward(ours, ids, mask))
        assert got.shape == (3,) and got.dtype == np.float32
        assert np.abs(ref).max() > 0.1  # not trivially zero
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=f"{case} {side} padding")


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.slow
def test_save_reward_model_loads_in_transformers(family, tmp_path):
    kw = {"llama": dict(tie_word_embeddings=False), "qwen3": dict(qk_norm=True), "gemma3": {}}[family]
    cfg = _tiny(family, **kw)
    backbone = init_model(cfg, seed=3)
    rm = RewardModel.from_backbone(backbone, nnx.Rngs(1))
    assert backbone.lm_head is not None or cfg.tie_word_embeddings  # the source model keeps its head
    save_reward_model(rm, None, tmp_path, pad_token_id=PAD)
    with open(tmp_path / "config.json") as f:
        hf_cfg = json.load(f)
    assert hf_cfg["num_labels"] == 1 and hf_cfg["architectures"][0].endswith("ForSequenceClassification")
    hf, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert tuple(hf.score.weight.shape) == (1, cfg.hidden_size) and hf.score.bias is None
    ids, mask = _padded(cfg.vocab_size, "right", t=7)
    ours = np.asarray(_rm_forward(rm, ids, mask))
    np.testing.assert_allclose(ours, _hf_scores(hf.eval(), ids, mask), atol=1e-5)
    again = load_reward_model(tmp_path)
    np.testing.assert_array_equal(np.asarray(_rm_forward(again, ids, mask)), ours)


def test_load_reward_model_refuses_a_causal_lm(tmp_path):
    from jaxrl_post.models import save_pretrained

    save_pretrained(init_model(_tiny("llama"), seed=0), None, tmp_path)
    with pytest.raises(ValueError, match="not a \\*ForSequenceClassification"):
        load_reward_model(tmp_path)


@pytest.mark.slow
def test_last_token_and_packed_segment_scores():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(last_token_index(mask)), [4, 2, 0])
    cfg = _tiny("llama")
    rm = RewardModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(1)
    a, b = rng.randint(1, cfg.vocab_size, 5), rng.randint(1, cfg.vocab_size, 3)
    # one packed row [a a a a a b b b 0 0] with per-segment positions
    ids = np.concatenate([a, b, [0, 0]])[None].astype(np.int32)
    seg = np.array([[1] * 5 + [2] * 3 + [0, 0]], np.int32)
    pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]], np.int32)
    ends = np.asarray(segment_end_mask(seg))
    np.testing.assert_array_equal(np.flatnonzero(ends[0]), [4, 7])
    scores = np.asarray(rm.token_scores(ids, seg != 0, pos, segment_ids=seg))[0][ends[0]]
    alone = [float(rm(x[None].astype(np.int32), np.ones((1, len(x)), np.int32))[0]) for x in (a, b)]
    np.testing.assert_allclose(scores, alone, atol=1e-5)
    # a shared prompt (chunk 1, sub 0) ends no sequence; its responses (subs 1, 2) do
    shared = np.array([[65536, 65536, 65537, 65537, 65538, 0]], np.int32)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(segment_end_mask(shared))[0]), [3, 4])
