"""DPO: preference rows -> ids (by hand on the character tokenizer), errors naming file and row, the batch
layouts, the losses against TRL 1.16's DPOTrainer (loss, metrics and gradients on a tiny Llama), and a tiny
end-to-end run through main.py's trainer with resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_post.data.preference import collate_pairs, load_preference_pairs, pair_ids, tokenize_pairs
from jaxrl_post.data.rows import MalformedRowError
from jaxrl_post.engine.row_packer import pack_rows
from jaxrl_post.models.char_tokenizer import CHARS, build_char_tokenizer

S, E = 1, 2  # <|im_start|>, <|im_end|> (= eos) of the character tokenizer


def c(text: str) -> list[int]:
    """Character-tokenizer ids of plain text, by hand: 4 + the index in CHARS."""
    return [4 + CHARS.index(ch) for ch in text]


def turn(role: str, content: str) -> list[int]:
    return [S] + c(f"{role}\n{content}") + [E] + c("\n")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(tmp_path, rows, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


# ----------------------------------------------------------------------------------------- data formats
def test_plain_explicit_and_implicit_prompt(tok):
    assert pair_ids(tok, {"prompt": "2+2=", "chosen": "4", "rejected": "5"}) == (c("2+2="), c("4") + [E], c("5") + [E])
    # implicit: the common prefix (TRL extract_prompt; the space before the split goes to the completions)
    p, ch, rj = pair_ids(tok, {"chosen": "The sky is blue.", "rejected": "The sky is green."})
    assert (p, ch, rj) == (c("The sky is"), c(" blue.") + [E], c(" green.") + [E])
    # a completion already ending with the eos token gets no second one
    assert pair_ids(tok, {"prompt": "a", "chosen": "b<|im_end|>", "rejected": "c"})[1] == c("b") + [E]


def test_conversational_explicit_and_implicit_prompt(tok):
    user = [{"role": "user", "content": "hi"}]
    yes, no = [{"role": "assistant", "content": "yo"}], [{"role": "assistant", "content": "no"}]
    gen = turn("user", "hi") + [S] + c("assistant\n")  # prompt + the generation prompt
    want = (gen, c("yo") + [E], c("no") + [E])  # through <|im_end|>, not the template's "\n" after it
    assert pair_ids(tok, {"prompt": user, "chosen": yes, "rejected": no}) == want
    assert pair_ids(tok, {"chosen": user + yes, "rejected": user + no}) == want
    # multi-turn completion: everything after the prompt through the last assistant turn's end token
    two = yes + [{"role": "user", "content": "?"}, {"role": "assistant", "content": "k"}]
    _, ch, _ = pair_ids(tok, {"prompt": user, "chosen": two, "rejected": no})
    assert ch == c("yo") + [E] + c("\n") + turn("user", "?") + [S] + c("assistant\nk") + [E]


def test_errors_name_file_and_row(tok, tmp_path):
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    cases = {
        "missing": ({"prompt": "a", "chosen": "b"}, r"missing 'rejected'"),
        "empty": ({"prompt": "a", "chosen": " ", "rejected": "c"}, r"empty completion \('chosen'\)"),
        "equal": ({"prompt": "a", "chosen": "b", "rejected": "b"}, r"'chosen' equals 'rejected'"),
        "mixed": (
            {"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"},
            "must all be strings",
        ),
        "no_asst": (
            {
                "prompt": [{"role": "user", "content": "a"}],
                "chosen": [{"role": "user", "content": "b"}],
                "rejected": [{"role": "assistant", "content": "c"}],
            },
            r"no assistant turn in 'chosen'",
        ),
    }
    for name, (row, msg) in cases.items():
        f = _write(tmp_path, [good, row], f"{name}.jsonl")
        with pytest.raises(
            MalformedRowError, match=rf"{name}\.jsonl, row 1 \(line 2\): malformed preference row.*{msg}"
        ):
            load_preference_pairs(f, tok, max_length=32)
    bad_json = _write(tmp_path, [good, "{nope"], "j.jsonl")
    with pytest.raises(MalformedRowError, match=r"j\.jsonl, row 1 \(line 2\).*invalid JSON"):
        load_preference_pairs(bad_json, tok, max_length=32)
    f = _write(tmp_path, [good, cases["equal"][0], good], "skip.jsonl")
    d = load_preference_pairs(f, tok, max_length=32, skip_malformed=True)
    assert len(d) == 2 and d.stats["data/num_skipped_malformed"] == 1
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_preference_pairs(str(tmp_path / "nope.jsonl"), tok, max_length=32)


def test_overlong_error_truncate_or_skip(tok):
    rows = [
        ("f, row 0", {"prompt": "abcd", "chosen": "xyz", "rejected": "w"}),
        ("f, row 1", {"prompt": "a", "chosen": "b", "rejected": "c"}),
    ]
    # prompt 4 + chosen 4 (xyz + eos) = 8 > 6
    with pytest.raises(
        MalformedRowError, match=r"f, row 0: overlong: prompt \+ completion = 8 tokens > data.max_length=6"
    ):
        tokenize_pairs(iter(rows), tok, max_length=6)
    d = tokenize_pairs(iter(rows), tok, max_length=6, truncation="keep_start")
    x = d[0]
    assert (x.prompt_ids.tolist(), x.chosen_ids.tolist(), x.rejected_ids.tolist()) == (c("abcd"), c("xy"), c("w") + [E])
    d = tokenize_pairs(iter(rows), tok, max_length=6, truncation="keep_end")
    assert d[0].prompt_ids.tolist() == c("cd") and d[0].chosen_ids.tolist() == c("xyz") + [E]
    assert d.stats["data/num_truncated"] == 1
    with pytest.raises(
        MalformedRowError, match=r"f, row 0: overlong: the prompt has 4 tokens > data.max_prompt_length=3"
    ):
        tokenize_pairs(iter(rows), tok, max_length=16, max_prompt_length=3)
    d = tokenize_pairs(iter(rows), tok, max_length=16, max_prompt_length=3, truncation="keep_start")
    assert d[0].prompt_ids.tolist() == c("bcd")  # the prompt keeps its end
    d = tokenize_pairs(iter(rows), tok, max_length=6, filter_overlong=True)
    assert len(d) == 1 and d.stats["data/num_filtered_overlong"] == 1 and d[0].where == "f, row 1"
    # keep_start with a prompt filling max_length: no completion token would be left (TRL drops such rows)
    with pytest.raises(MalformedRowError, match=r"the prompt alone has 4 tokens >= data.max_length=4"):
        tokenize_pairs(iter(rows), tok, max_length=4, truncation="keep_start")


def test_collate_pairs_chosen_rows_then_rejected_rows(tok):
    d = tokenize_pairs(
        [
            ("r0", {"prompt": "ab", "chosen": "c", "rejected": "de"}),
            ("r1", {"prompt": "f", "chosen": "g", "rejected": "h"}),
        ],
        tok,
        max_length=8,
    )
    b = collate_pairs(d.pairs, max_length=6)
    assert b["input_ids"].tolist() == [
        c("abc") + [E, 0, 0],
        c("fg") + [E, 0, 0, 0],
        c("abde") + [E, 0],
        c("fh") + [E, 0, 0, 0],
    ]
    assert b["attention_mask"].sum(1).tolist() == [4, 3, 5, 3]
    assert b["loss_mask"].tolist()[2] == [0, 0, 1, 1, 1, 0]
    assert b["positions"][2].tolist() == [0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="does not fit max_length=4"):
        collate_pairs(d.pairs, max_length=4)


# ----------------------------------------------------------------------------------------- layout and losses
def _tiny_model(seed):
    from jaxrl_post.models import ModelConfig, init_model

    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return init_model(cfg, seed=seed)


PARITY_ROWS = [
    {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
    {"prompt": "hello ", "chosen": "world", "rejected": "moon"},
    {"prompt": "ab", "chosen": "cd", "rejected": "xyz!"},
]


def _pairs(tok, rows=PARITY_ROWS):
    return tokenize_pairs(((f"r{i}", r) for i, r in enumerate(rows)), tok, max_length=32).pairs


def test_shared_prompt_layout_by_hand(tok):
    from jaxrl_post.sft import dpo_step

    pairs = _pairs(tok, [{"prompt": "ab", "chosen": "c", "rejected": "de"}])
    b = dpo_step.layout_pairs(pairs, n_micro=1, pairs_per_micro=1, row_len=10, pack=True)
    ab, cc, de = c("ab"), c("c") + [E], c("de") + [E]
    assert b["input_ids"][0, 0].tolist() == ab + cc + de + [0, 0, 0]
    p0, p1 = 1 << 16, (1 << 16) | 1
    assert b["segment_ids"][0, 0].tolist() == [p0, p0, p1, p1, p1 + 1, p1 + 1, p1 + 1, 0, 0, 0]
    assert b["positions"][0, 0].tolist() == [0, 1, 2, 3, 2, 3, 4, 0, 0, 0]  # both completions continue the prompt
    n = int(b["slot_mask"][0].sum())
    # the last prompt token (index 1) predicts the first token of both completions
    assert b["slot_index"][0, :n].tolist() == [1, 2, 1, 4, 5]
    assert b["slot_label"][0, :n].tolist() == cc + de
    assert b["slot_seq"][0, :n].tolist() == [0, 0, 1, 1, 1]  # chosen of pair 0, then rejected (Q + 0, Q = 1)
    u = dpo_step.layout_pairs(pairs, n_micro=1, pairs_per_micro=1, row_len=5, pack=False)
    assert u["input_ids"][0].tolist() == [ab + cc + [0], ab + de]
    assert u["slot_index"][0, :5].tolist() == [1, 2, 6, 7, 8]


def test_pair_losses_against_hand_formulas():
    import jax.numpy as jnp

    from jaxrl_post.sft import dpo_step

    logps, ref = np.array([-3.0, -7.0, -5.0, -6.0]), np.array([-4.0, -6.5, -4.5, -6.0])
    counts = np.array([2.0, 4.0, 3.0, 5.0])
    cl, rl = logps[:2] - ref[:2], logps[2:] - ref[2:]
    d, beta, eps = cl - rl, 0.2, 0.1
    ls = lambda x: -np.log1p(np.exp(-x))  # log sigmoid
    want = {
        ("sigmoid", 0.0): -ls(beta * d),
        ("sigmoid", eps): -(1 - eps) * ls(beta * d) - eps * ls(-beta * d),  # cDPO
        ("robust", eps): (-(1 - eps) * ls(beta * d) + eps * ls(-beta * d)) / (1 - 2 * eps),
        ("ipo", 0.0): (cl / counts[:2] - rl / counts[2:] - 1 / (2 * beta)) ** 2,
    }
    for (kind, e), w in want.items():
        got, m = dpo_step.dpo_pair_losses(
            jnp.asarray(logps), jnp.asarray(ref), jnp.asarray(counts), beta=beta, loss_type=kind, label_smoothing=e
        )
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-6, err_msg=kind)
    np.testing.assert_allclose(np.asarray(m["rewards/margins"]), beta * d, rtol=1e-6)
    assert np.asarray(m["rewards/accuracies"]).tolist() == [1.0, 0.0]


@pytest.mark.slow  # torch + transformers + TRL import, three TRL trainers, four compiles (~60-90 s on this machine)
def test_loss_metrics_and_grads_match_trl_dpo_trainer(tok, tmp_path):
    pytest.importorskip("trl")
    torch = pytest.importorskip("torch")
    import jax
    from datasets import Dataset
    from flax import nnx
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from jaxrl_post.engine import steps
    from jaxrl_post.models import save_pretrained
    from jaxrl_post.models.hf_io import _get_variable, param_map
    from jaxrl_post.sft import dpo_step

    policy, reference = _tiny_model(3), _tiny_model(4)  # different weights: non-zero rewards
    save_pretrained(policy, tok, str(tmp_path / "pol"))
    save_pretrained(reference, tok, str(tmp_path / "ref"))
    g, params, rest = steps.split_model(policy)
    ref_params = steps.split_model(reference)[1]
    pairs = _pairs(tok)
    layouts = {
        "padded": dpo_step.layout_pairs(pairs, n_micro=2, pairs_per_micro=2, row_len=16, pack=False),
        "packed": dpo_step.layout_pairs(pairs, n_micro=3, pairs_per_micro=1, row_len=32, pack=True),
    }
    assert int(dpo_step._n_used(layouts["packed"])) == 2  # 11 + 17 + 10 tokens: two rows of 32, one empty micro
    cases = [("sigmoid", 0.0, ("padded", "packed")), ("ipo", 0.0, ("packed",)), ("robust", 0.1, ("packed",))]
    for loss_type, eps, names in cases:
        tm = LlamaForCausalLM.from_pretrained(str(tmp_path / "pol"), dtype=torch.float32)
        rm = LlamaForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
        args = DPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=3,
            report_to=[],
            use_cpu=True,
            bf16=False,
            max_length=64,
            beta=0.2,
            loss_type=[loss_type],
            label_smoothing=eps,
        )
        trainer = DPOTrainer(
            model=tm, ref_model=rm, args=args, train_dataset=Dataset.from_list(PARITY_ROWS), processing_class=tok
        )
        examples = [trainer.train_dataset[i] for i in range(3)]
        for ex, x in zip(examples, pairs):  # TRL's ids == ours
            assert ex["prompt_ids"] == x.prompt_ids.tolist()
            assert (ex["chosen_ids"], ex["rejected_ids"]) == (x.chosen_ids.tolist(), x.rejected_ids.tolist())
        tm.train()
        loss = trainer.compute_loss(tm, dict(trainer.data_collator(examples)))
        loss.backward()
        trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        t_params = dict(tm.named_parameters())
        fn = jax.jit(dpo_step.make_dpo_grads(g, rest, beta=0.2, loss_type=loss_type, label_smoothing=eps, chunk=8))
        for name in names:
            j_loss, j_metrics, j_grads = fn(params, layouts[name], ref_params)
            what = f"{loss_type}/{name}"
            np.testing.assert_allclose(float(j_loss), loss.item(), rtol=1e-5, atol=1e-6, err_msg=what)
            for k in dpo_step.METRIC_KEYS:
                np.testing.assert_allclose(float(j_metrics[k]), trl_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
            g_model = nnx.merge(g, j_grads, rest)
            for hf_name, (path, _, to_hf) in param_map(policy.config).items():
                want = t_params[hf_name].grad.numpy()
                got = to_hf(np.asarray(_get_variable(g_model, path)[...]))
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=f"{what} {hf_name}")


def test_bfd_plan_layout_gives_the_per_step_loss_and_grads(tok):
    """A batch laid out from a given packing plan (data.packing_strategy='bfd': rows packed once for the dataset)
    holds the same pairs in other rows; the loss, metrics and every gradient equal the per-step layout's."""
    import jax

    from jaxrl_post.engine import steps
    from jaxrl_post.sft import dpo_step

    g, params, rest = steps.split_model(_tiny_model(3))
    ref_params = steps.split_model(_tiny_model(4))[1]
    pairs = _pairs(tok)  # 11, 17, 10 tokens as prompt | chosen | rejected
    geo = dict(n_micro=3, pairs_per_micro=1, row_len=32, pack=True)
    auto = dpo_step.layout_pairs(pairs, **geo)  # first-fit decreasing: rows [1, 0] and [2]
    planned = dpo_step.layout_pairs(pairs, plan=[[2], [0, 1]], pair_slots=3, **geo)
    assert planned["pair_index"][0].tolist() == [2, -1, -1] and planned["pair_index"][1].tolist() == [0, 1, -1]
    assert auto["pair_index"][0].tolist() == [1, 0, -1]
    fn = jax.jit(dpo_step.make_dpo_grads(g, rest, beta=0.2, loss_type="sigmoid", label_smoothing=0.0, chunk=8))
    (la, ma, ga), (lp, mp, gp) = fn(params, auto, ref_params), fn(params, planned, ref_params)
    assert float(la) == pytest.approx(float(lp), rel=1e-6)
    for k in dpo_step.METRIC_KEYS:
        assert float(ma[k]) == pytest.approx(float(mp[k]), rel=1e-5, abs=2e-6), k  # f32 sums in other orders
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gp)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="every pair exactly once"):
        dpo_step.layout_pairs(pairs, plan=[[2], [0]], pair_slots=3, **geo)
    with pytest.raises(ValueError, match="more than row_len=32"):
        dpo_step.layout_pairs(pairs, plan=[[0, 1, 2]], pair_slots=3, **geo)
    with pytest.raises(ValueError, match="2 pairs in one micro-batch, the layout has 1 pair slots"):
        dpo_step.layout_pairs(pairs, plan=[[2], [0, 1]], pair_slots=1, **geo)


@pytest.mark.slow  # a tiny trainer and its compiles (~20-40 s on this 2-core machine)
def test_bfd_packing_steps_over_packed_pair_rows(tmp_path):
    import jax

    from jaxrl_post.errors import ConfigError
    from jaxrl_post.sft import dpo_step
    from jaxrl_post.sft.dpo import DPOTrainer, pair_tokens, validate_dpo_config

    bad = _tiny_config(tmp_path, "x", data__packing_strategy="bfd", model__use_remove_padding=False)
    with pytest.raises(ConfigError, match=r"'bfd' packs pairs into rows: it needs model.use_remove_padding=True"):
        validate_dpo_config(bad)
    cfg = _tiny_config(tmp_path, "bfd", data__packing_strategy="bfd")
    cfg.data.train_batch_size, cfg.data.micro_batch_size = 2, 1  # packed rows of 2 * 16 characters
    t = DPOTrainer(cfg)
    need = [len(x.prompt_ids) + len(x.chosen_ids) + len(x.rejected_ids) for x in t.data.train.pairs]
    assert t.data.packed_rows == pack_rows(need, 32, strategy="bfd", skip_empty=True).rows()
    assert max(len(r) for r in t.data.packed_rows) > 1  # several pairs share a row
    assert t.data.loader.batches_per_epoch == len(t.data.packed_rows) // 2
    m1 = t.train_step()  # after it the policy differs from the reference: the loss depends on the pairs
    state = t.data.loader.get_state()
    rows = next(t.data.loader)
    t.data.loader.set_state(state)
    pairs = [t.data.train.pairs[i] for r in rows for i in t.data.packed_rows[r]]
    # the step's loss, computed independently on a per-step layout of the same pairs from the same params
    fn = jax.jit(
        dpo_step.make_dpo_grads(t.model.graphdef, t.model.rest, beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    )
    geo = dict(n_micro=1, pairs_per_micro=len(pairs), row_len=32, pack=True)
    want = float(fn(t.state.params, dpo_step.layout_pairs(pairs, **geo), t.task.ref_params)[0])
    m2 = t.train_step()
    t.close()
    assert abs(want - np.log(2)) > 1e-4
    assert m2["loss"] == pytest.approx(want, rel=1e-5)
    assert m2["num_tokens"] - m1["num_tokens"] == pair_tokens(pairs)
    assert t.compile_counts()["update"] == 1


# ----------------------------------------------------------------------------------------- end to end
def _tiny_config(tmp_path, run, **over):
    import importlib.util
    import os

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("dpo_cfg", os.path.join(repo, "configs", "dpo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("tiny")
    cfg.data.val_files = cfg.data.train_files
    cfg.data.max_val_samples = 8
    cfg.trainer.default_local_dir = str(tmp_path / run)
    cfg.trainer.logger = ("jsonl",)
    for k, v in over.items():
        sec, key = k.split("__")
        cfg[sec][key] = v
    return cfg


def test_config_errors_name_the_keys(tmp_path):
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.sft.dpo import DPOTrainer, validate_dpo_config

    cfg = _tiny_config(tmp_path, "x", dpo__loss_type="hinge", data__truncation="right", dpo__beta=0.0)
    with pytest.raises(ConfigError, match=r"(?s)data.truncation='right'.*dpo.loss_type='hinge'.*dpo.beta=0.0"):
        validate_dpo_config(cfg)
    cfg = _tiny_config(tmp_path, "x", dpo__loss_type="ipo", dpo__label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"label_smoothing: not used by loss_type='ipo'"):
        validate_dpo_config(cfg)
    cfg = _tiny_config(tmp_path, "x", data__train_files=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"config.data.train_files=.*missing.jsonl"):
        DPOTrainer(cfg)


@pytest.mark.slow  # three tiny trainers and their compiles (~90 s on this 2-core machine)
def test_tiny_run_via_main_learns_and_resumes(tmp_path, monkeypatch):
    import math

    import jax

    from jaxrl_post import main as main_mod
    from jaxrl_post.sft.dpo import DPOTrainer

    # the whole run through main.py's dispatch (trainer_type='dpo')
    cfg = _tiny_config(tmp_path, "a")
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": cfg})())
    main_mod.main([])
    lines = [json.loads(s) for s in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    before = next(ln for ln in lines if ln["step"] == 0 and "val/loss" in ln)
    assert before["val/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference at step 0
    assert before["val/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    steps_ = [ln for ln in lines if "loss" in ln]
    assert [ln["step"] for ln in steps_] == [1, 2, 3, 4]
    for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert k in steps_[-1] and math.isfinite(steps_[-1][k])
    after = steps_[-1]["val/loss"]
    assert after < before["val/loss"] - 1e-3  # the held-out DPO loss falls
    assert steps_[-1]["val/rewards/margins"] > 0
    assert (tmp_path / "a" / "huggingface" / "model.safetensors").exists()

    # reference log-probs precomputed once; interrupted after step 2, resumed: the same run as per-step
    b = DPOTrainer(_tiny_config(tmp_path, "b", dpo__precompute_ref_log_probs=True))
    b.fit(max_steps=2)
    b.close()
    b2 = DPOTrainer(_tiny_config(tmp_path, "b", dpo__precompute_ref_log_probs=True))
    assert b2.global_steps == 2 and b2.resumed_from.endswith("global_step_2")
    rest = b2.fit()
    b2.close()
    assert b2.compile_counts() == {"update": 1, "eval": 1, "ref": 1}
    assert rest["last"]["loss"] == pytest.approx(steps_[-1]["loss"], abs=1e-6)
    assert rest["last"]["val/loss"] == pytest.approx(after, abs=1e-6)
    from jaxrl_post.engine import steps
    from jaxrl_post.models import load_pretrained

    exported = steps.split_model(load_pretrained(str(tmp_path / "a"))[0])[1]
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(b2.state.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


@pytest.mark.slow  # two compiles of the DPO grads fn (LoRA and plain graphs): 40-80 s on this loaded machine
def test_lora_reference_is_the_model_with_adapters_off(tok):
    """With LoRA the reference is the same model with its adapters off: the loss and metrics equal those of a
    plain model holding the merged weights (W + s A B) against a frozen copy of the base weights."""
    import jax
    from flax import nnx

    from jaxrl_post.engine import steps
    from jaxrl_post.models.lora import LoRAConfig, apply_lora, merged_state
    from jaxrl_post.sft import dpo_step

    model = _tiny_model(3)
    apply_lora(model, LoRAConfig(4, 8.0, "all-linear"), seed=0)
    g, adapters, frozen, rest = steps.split_lora_model(model)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)
    nnx.update(model, adapters)  # B != 0: the adapted model differs from its base
    batch = dpo_step.layout_pairs(_pairs(tok), n_micro=3, pairs_per_micro=1, row_len=32, pack=True)
    kw = dict(beta=0.2, loss_type="sigmoid", chunk=8)
    loss, metrics, grads = jax.jit(dpo_step.make_dpo_grads(g, rest, **kw))(adapters, batch, None, frozen)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # the adapters train, the base does not

    plain = _tiny_model(3)  # the same base weights, no adapters
    pg, base_params, prest = steps.split_model(plain)
    merged = merged_state(model)
    want_loss, want_metrics, _ = jax.jit(dpo_step.make_dpo_grads(pg, prest, **kw))(merged, batch, base_params)
    assert abs(float(metrics["rewards/margins"])) > 1e-3  # the adapters moved the policy off its reference
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for k in dpo_step.METRIC_KEYS:
        np.testing.assert_allclose(float(metrics[k]), float(want_metrics[k]), rtol=1e-5, atol=1e-6, err_msg=k)
