"""SFT: row formats -> ids + loss mask (by hand on the character tokenizer; SmolLM2's template), the loss against
a numpy reference, packed == unpacked and micro-batched == whole batch, parity with TRL's SFTTrainer, and a tiny
end-to-end run with exact resume and the HF export loaded back as a model source."""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_post.data.rows import MalformedRowError
from jaxrl_post.data.sft import SFTKeys, load_sft_data, row_ids_and_mask, tokenize_rows
from jaxrl_post.engine import steps
from jaxrl_post.engine.row_packer import pack_rows
from jaxrl_post.models.char_tokenizer import CHARS, build_char_tokenizer
from jaxrl_post.sft import sft_step

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
S, E = 1, 2  # <|im_start|>, <|im_end|> of the character tokenizer


def c(text: str) -> list[int]:
    """Character-tokenizer ids of plain text, by hand: 4 + the index in CHARS."""
    return [4 + CHARS.index(ch) for ch in text]


def turn(role: str, content: str) -> list[int]:
    return [S] + c(f"{role}\n{content}") + [E] + c("\n")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


# ----------------------------------------------------------------------------------------- data formats
def test_messages_mask_covers_every_assistant_turn_through_its_end_token(tok):
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "B"},
    ]
    ids, mask = row_ids_and_mask(tok, {"messages": msgs}, "auto", SFTKeys())
    want_ids, want_mask = [], []
    for m in msgs:
        t = turn(m["role"], m["content"])
        want_ids += t
        if m["role"] == "assistant":  # header not trained; content + <|im_end|> trained; the "\n" after it not
            head = 1 + len("assistant\n")
            want_mask += [0] * head + [1] * (len(m["content"]) + 1) + [0]
        else:
            want_mask += [0] * len(t)
    assert ids == want_ids
    assert mask == want_mask


def test_prompt_completion_plain_and_conversational(tok):
    ids, mask = row_ids_and_mask(tok, {"prompt": "2+2=", "completion": "4"}, "auto", SFTKeys())
    assert ids == c("2+2=") + c("4") + [E]  # TRL: eos appended to the completion, no chat template
    assert mask == [0, 0, 0, 0, 1, 1]
    row = {"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "yz"}]}
    ids, mask = row_ids_and_mask(tok, row, "auto", SFTKeys())
    assert ids == turn("user", "x") + turn("assistant", "yz")
    assert mask == [0] * len(turn("user", "x")) + [0] * 11 + [1, 1, 1, 0]


def test_verl_prompt_response_keys_gsm8k_style(tok):
    row = {"question": "1+1?", "answer": "2\n#### 2"}
    ids, mask = row_ids_and_mask(tok, row, "auto", SFTKeys(prompt_key="question", response_key="answer"))
    prompt = turn("user", "1+1?") + [S] + c("assistant\n")  # the generation prompt
    assert ids == prompt + c("2\n#### 2") + [E]
    assert mask == [0] * len(prompt) + [1] * (len("2\n#### 2") + 1)


def test_errors_name_file_and_row(tok, tmp_path):
    kw = dict(max_length=64)
    no_asst = _write(tmp_path, [{"prompt": "a", "completion": "b"}, {"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(MalformedRowError, match=r"d\.jsonl, row 1 \(line 2\).*no assistant turn"):
        load_sft_data(no_asst, tok, **kw)
    empty = _write(tmp_path, [{"prompt": "a", "completion": "  "}], "e.jsonl")
    with pytest.raises(MalformedRowError, match=r"e\.jsonl, row 0.*empty completion"):
        load_sft_data(empty, tok, **kw)
    unknown = _write(tmp_path, [{"text": "a"}], "u.jsonl")
    with pytest.raises(MalformedRowError, match=r"u\.jsonl, row 0.*unknown SFT row format.*'text'"):
        load_sft_data(unknown, tok, **kw)
    bad_json = _write(tmp_path, ["{not json"], "j.jsonl")
    with pytest.raises(MalformedRowError, match=r"j\.jsonl, row 0 \(line 1\).*invalid JSON"):
        load_sft_data(bad_json, tok, **kw)
    # skip_malformed: counted, the good row kept
    data = load_sft_data(no_asst, tok, skip_malformed=True, **kw)
    assert len(data) == 1 and data.stats["data/num_skipped_malformed"] == 1


def test_overlong_error_truncate_or_skip(tok):
    rows = [("f, row 0", {"prompt": "ab", "completion": "cdefgh"}), ("f, row 1", {"prompt": "a", "completion": "b"})]
    with pytest.raises(MalformedRowError, match=r"f, row 0: 9 tokens > data.max_length=5"):
        tokenize_rows(iter(rows), tok, max_length=5)
    d = tokenize_rows(iter(rows), tok, max_length=5, truncation="right")
    assert d.input_ids[0].tolist() == c("abcde") and d.loss_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert d.stats["data/num_truncated"] == 1
    d = tokenize_rows(iter(rows), tok, max_length=5, filter_overlong=True)
    assert len(d) == 1 and d.stats["data/num_filtered_overlong"] == 1
    assert d.input_ids[0].tolist() == c("ab") + [E]


def test_template_that_rewrites_earlier_turns_is_reported(tok):
    import copy

    t = copy.deepcopy(tok)
    # drops the content of earlier assistant turns (like templates that strip past reasoning): not append-only
    t.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    row_ids_and_mask(t, {"messages": msgs}, "auto", SFTKeys())  # one turn: fine
    msgs += [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ValueError, match="not append-only at message 1"):
        row_ids_and_mask(t, {"messages": msgs}, "auto", SFTKeys())


@pytest.mark.slow  # parses the SmolLM2 GGUF tokenizer (~20-40 s on this 2-core machine)
def test_smollm2_template_mask_is_exactly_the_assistant_text():
    from jaxrl_post.rl.builders import load_tokenizer

    t = load_tokenizer("smollm2-135m-instruct")
    msgs = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 2+4?"},
        {"role": "assistant", "content": "6, of course."},
    ]
    ids, mask = row_ids_and_mask(t, {"messages": msgs}, "auto", SFTKeys())
    ids, mask = np.asarray(ids), np.asarray(mask)
    # the default system prompt is rendered first; the trained spans decode to the two answers + <|im_end|>
    assert t.decode(ids[:3].tolist()) == "<|im_start|>system\n"
    edges = np.flatnonzero(np.diff(np.r_[0, mask, 0]))
    spans = [t.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert spans == ["It is 5.<|im_end|>", "6, of course.<|im_end|>"]
    # verl keys: the response + eos
    ids, mask = row_ids_and_mask(t, {"question": "Q", "answer": "A 7"}, "auto", SFTKeys("m", "question", "answer"))
    assert t.decode([i for i, m in zip(ids, mask) if m]) == "A 7<|im_end|>"


# ----------------------------------------------------------------------------------------- loss and step
def _tiny_model(seed=3):
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


def _examples(n=6, seed=0):
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(n):
        t = int(rng.integers(5, 15))
        x = rng.integers(4, 100, size=t).astype(np.int32)
        m = np.zeros(t, np.int32)
        m[int(rng.integers(1, t - 1)) :] = 1  # a completion suffix
        ids.append(x)
        masks.append(m)
    return ids, masks


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_model()
    g, p, r = steps.split_model(model)
    return model, g, p, r


@pytest.fixture(scope="module")
def grads_fn(tiny):
    _, g, _, r = tiny
    return jax.jit(sft_step.make_sft_grads(g, r, chunk=8))


def _reference_loss(model, ids, masks):
    """The plain model forward (right-padded rows, no packing, no segment ids, full logits); numpy log-softmax,
    token-mean over all loss tokens of the batch; argmax accuracy."""
    x_pad = np.zeros((len(ids), 16), np.int32)
    for i, x in enumerate(ids):
        x_pad[i, : len(x)] = x
    forward = jax.jit(lambda m, ids, mask: m(ids, mask))  # the plain forward, compiled (eager: op by op)
    all_logits = np.asarray(forward(model, jnp.asarray(x_pad), jnp.asarray(x_pad > 0, jnp.int32)), np.float64)
    nll, hits, n = 0.0, 0, 0
    for x, m, logits in zip(ids, masks, all_logits):
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        for t in range(1, len(x)):
            if m[t]:
                nll -= logp[t - 1, x[t]]
                hits += int(np.argmax(logits[t - 1]) == x[t])
                n += 1
    return nll / n, hits / n


@pytest.mark.slow  # the first compile of the grads fn (shared by the tests below): ~40 s on this loaded machine
def test_loss_matches_numpy_reference(tiny, grads_fn):
    model, _, params, _ = tiny
    ids, masks = _examples(8)
    batch = sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=False)
    loss, hits, n, _ = grads_fn(params, batch)
    ref_loss, ref_acc = _reference_loss(model, ids, masks)
    assert float(n) == sum(int(m[1:].sum()) for m in masks)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(float(hits) / float(n), ref_acc, atol=1e-9)


def test_packed_and_micro_batched_equal_the_whole_batch(tiny, grads_fn):
    _, _, params, _ = tiny
    ids, masks = _examples(8, seed=1)
    whole = sft_step.layout_batch(ids, masks, n_micro=1, rows=8, row_len=16, pack=False)
    plan = pack_rows([len(x) for x in ids], 16, strategy="bfd", skip_empty=True).rows()
    variants = {
        "micro": sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=False),
        "packed": sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=True),
        "bfd plan": sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=True, plan=plan),
    }
    assert int(np.any(variants["packed"]["segment_ids"] == 2))  # several examples share a row
    assert int(sft_step._n_used(variants["packed"])) < 4  # trailing empty micro-batches are skipped
    ref = jax.jit(sft_step.make_sft_grads(tiny[1], tiny[3], chunk=8))(params, whole)
    for name, b in variants.items():
        got = grads_fn(params, b)
        np.testing.assert_allclose(float(got[0]), float(ref[0]), atol=1e-6, err_msg=name)
        assert float(got[1]) == float(ref[1]) and float(got[2]) == float(ref[2])
        for a, r in zip(jax.tree.leaves(got[3]), jax.tree.leaves(ref[3])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-6, err_msg=name)


def test_layout_positions_segments_and_shifted_labels():
    ids = [np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32)]
    masks = [np.array([0, 1, 1], np.int32), np.array([0, 1], np.int32)]
    b = sft_step.layout_batch(ids, masks, n_micro=1, rows=1, row_len=6, pack=True)
    assert b["input_ids"][0, 0].tolist() == [5, 6, 7, 8, 9, 0]
    assert b["segment_ids"][0, 0].tolist() == [1, 1, 1, 2, 2, 0]
    assert b["positions"][0, 0].tolist() == [0, 1, 2, 0, 1, 0]
    assert b["labels"][0, 0].tolist() == [6, 7, 0, 9, 0, 0]  # never across an example boundary
    assert b["loss_mask"][0, 0].tolist() == [1, 1, 0, 1, 0, 0]
    with pytest.raises(ValueError, match="2 rows needed, the batch layout has 1"):
        sft_step.layout_batch(ids, masks, n_micro=1, rows=1, row_len=6, pack=False)


def test_layout_rejects_an_overfull_plan():
    # the packer itself (first fit, best fit, by hand and against the replaced copies): tests/engine/test_row_packer.py
    ids = [np.arange(1, 7, dtype=np.int32)] * 2
    with pytest.raises(ValueError, match="row 0 of the plan holds 12 tokens > 10"):
        sft_step.layout_batch(ids, [np.ones(6, np.int32)] * 2, n_micro=1, rows=2, row_len=10, pack=True, plan=[[0, 1]])


# ----------------------------------------------------------------------------------------- TRL parity
@pytest.mark.slow  # torch + transformers + TRL import and a trainer build (~30-60 s on this machine)
def test_loss_and_grads_match_trl_sft_trainer(tiny, grads_fn, tok, tmp_path):
    pytest.importorskip("trl")
    torch = pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from jaxrl_post.models import save_pretrained
    from jaxrl_post.models.hf_io import _get_variable, param_map

    model, g, params, r = tiny
    save_pretrained(model, tok, str(tmp_path / "hf"))
    tm = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    rows = [{"prompt": "2+2=", "completion": "4, sure"}, {"prompt": "hello ", "completion": "world"}]
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        completion_only_loss=True,
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=64,
    )
    trainer = SFTTrainer(model=tm, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    examples = [trainer.train_dataset[i] for i in range(2)]
    # TRL's tokenization and completion mask == ours (plain strings: no template, eos appended)
    ours = [row_ids_and_mask(tok, row, "auto", SFTKeys()) for row in rows]
    for ex, (ids, mask) in zip(examples, ours):
        assert ex["input_ids"] == ids
        assert [int(lab != -100) for lab in ex["labels"]] == mask
    batch = trainer.data_collator(examples)
    tm.train()
    loss = trainer.compute_loss(tm, dict(batch))
    loss.backward()

    packed = sft_step.layout_batch(
        [np.asarray(i) for i, _ in ours], [np.asarray(m) for _, m in ours], n_micro=4, rows=2, row_len=16, pack=True
    )
    j_loss, _, _, j_grads = grads_fn(params, packed)
    np.testing.assert_allclose(float(j_loss), loss.item(), rtol=1e-5)
    g_model = __import__("flax").nnx.merge(g, j_grads, r)
    t_params = dict(tm.named_parameters())
    for name, (path, _, to_hf) in param_map(model.config).items():
        want = t_params[name].grad.numpy()
        got = to_hf(np.asarray(_get_variable(g_model, path)[...]))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=name)


# ----------------------------------------------------------------------------------------- end to end
def _tiny_config(tmp_path, train, run="run"):
    spec = importlib.util.spec_from_file_location("sft_cfg", os.path.join(REPO, "configs", "sft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config("tiny")
    cfg.data.train_files = cfg.data.val_files = train
    cfg.trainer.default_local_dir = str(tmp_path / run)
    cfg.trainer.logger = ("jsonl",)
    return cfg


def _rows(n=12):
    return [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": f"{2 * i + 1}"},
                {"role": "user", "content": "sure?"},
                {"role": "assistant", "content": f"yes, {2 * i + 1}"},
            ]
        }
        for i in range(n)
    ]


@pytest.mark.slow  # two tiny trainers and their compiles (~60-90 s on this 2-core machine)
def test_tiny_run_resumes_exactly_and_exports_a_model_source(tmp_path):
    from jaxrl_post.models import load_pretrained
    from jaxrl_post.sft.trainer import SFTTrainer

    train = _write(tmp_path, _rows())
    a = SFTTrainer(_tiny_config(tmp_path, train, "a"))
    full = a.fit()
    a.close()
    assert a.compile_counts() == {"update": 1, "eval": 1}
    losses = [m["loss"] for m in full["history"]]
    assert len(losses) == 3 and losses[-1] < losses[0]  # lr 1e-3 on repeated short answers: the loss falls
    assert full["last"]["val/perplexity"] == pytest.approx(np.exp(full["last"]["val/loss"]))

    b = SFTTrainer(_tiny_config(tmp_path, train, "b"))
    b.fit(max_steps=2)  # save_freq=2: checkpoint of step 2
    b.close()
    b2 = SFTTrainer(_tiny_config(tmp_path, train, "b"))
    assert b2.global_steps == 2 and b2.resumed_from.endswith("global_step_2")
    rest = b2.fit()
    b2.close()
    assert rest["last"]["loss"] == full["last"]["loss"]
    assert rest["last"]["num_tokens"] == full["last"]["num_tokens"]
    for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b2.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lines = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines if "loss" in ln] == [1, 2, 3]  # each step once (truncated at resume)

    # the run dir is a model source: model.path=<run dir> loads the exported weights and tokenizer
    model, t = load_pretrained(str(tmp_path / "a"))
    got = jax.tree.leaves(steps.split_model(model)[1])
    for x, y in zip(got, jax.tree.leaves(a.state.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    rendered = t.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert rendered == "<|im_start|>user\nx<|im_end|>\n"


def test_config_errors_name_the_keys(tmp_path):
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.sft.trainer import validate_sft_config

    cfg = _tiny_config(tmp_path, "x.jsonl")
    cfg.data.micro_batch_size = 3
    cfg.data.format = "chat"
    with pytest.raises(ConfigError, match=r"(?s)multiple of data.micro_batch_size=3.*data.format='chat'"):
        validate_sft_config(cfg)
    cfg = _tiny_config(tmp_path, "x.jsonl")
    cfg.data.packing_strategy = "ffd"
    with pytest.raises(ConfigError, match=r"data.packing_strategy='ffd': must be one of \['per_step', 'bfd'\]"):
        validate_sft_config(cfg)
    cfg.data.packing_strategy, cfg.model.use_remove_padding = "bfd", False
    with pytest.raises(ConfigError, match=r"'bfd' packs examples into rows: it needs model.use_remove_padding=True"):
        validate_sft_config(cfg)


@pytest.mark.slow  # a tiny trainer and its compile (~20-40 s on this 2-core machine)
def test_bfd_packing_steps_over_packed_rows(tmp_path):
    from jaxrl_post.sft.trainer import SFTTrainer

    cfg = _tiny_config(tmp_path, _write(tmp_path, _rows()))
    cfg.data.packing_strategy, cfg.data.max_length = "bfd", 256
    cfg.data.train_batch_size, cfg.data.micro_batch_size = 2, 1  # packed rows
    t = SFTTrainer(cfg)
    lengths = [len(x) for x in t.data.train.input_ids]
    assert t.data.packed_rows == pack_rows(lengths, 256, strategy="bfd", skip_empty=True).rows()
    assert sorted(i for r in t.data.packed_rows for i in r) == list(range(12))
    assert len(t.data.packed_rows) < 12 and t.data.loader.batches_per_epoch == len(t.data.packed_rows) // 2
    state = t.data.loader.get_state()
    rows = next(t.data.loader)
    t.data.loader.set_state(state)
    examples = [i for r in rows for i in t.data.packed_rows[r]]
    m = t.train_step()
    t.close()
    assert m["num_tokens"] == sum(lengths[i] for i in examples)
    assert m["num_loss_tokens"] == sum(int(t.data.train.loss_mask[i][1:].sum()) for i in examples)
    assert t.compile_counts()["update"] == 1


def test_every_variant_passes_the_config_check_and_tools_feeds_grpo_tools():
    import sys

    from jaxrl_post.rl.config_check import validate_config
    from jaxrl_post.sft.trainer import validate_sft_config

    spec = importlib.util.spec_from_file_location("sft_cfg", os.path.join(REPO, "configs", "sft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for variant in (None, "gsm8k", "tools", "tiny"):
        validate_sft_config(mod.get_config(variant))
    sys.path.insert(0, REPO)
    from configs import grpo_tools

    c, g = mod.get_config("tools"), grpo_tools.get_config()
    assert c.model.path == g.model.path == "smollm2-135m-instruct"  # SFT starts from the GRPO run's model
    assert (c.data.train_files, c.data.val_files) == ("runs/tool_sft/train.jsonl", "runs/tool_sft/val.jsonl")
    # the run dir with its Hugging Face export is the GRPO run's model source
    assert c.trainer.export_hf and c.trainer.default_local_dir == "runs/sft_tools"
    g.model.path = c.trainer.default_local_dir
    validate_config(g, n_devices=1)


def test_missing_data_file_and_model_path_are_one_config_error(tmp_path):
    from jaxrl_post.errors import ConfigError
    from jaxrl_post.sft.trainer import SFTTrainer

    cfg = _tiny_config(tmp_path, "missing.jsonl")
    with pytest.raises(ConfigError, match=r"config.data.train_files=.*missing.jsonl"):
        SFTTrainer(cfg)
    cfg = _tiny_config(tmp_path, "missing.jsonl")
    cfg.model.random_init = False
    cfg.model.path = str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match=r"config.model.path=.*no_such_model"):
        SFTTrainer(cfg)
    # a run directory without an exported model is named as such (its config.json is the job config)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"trainer": {"experiment_name": "x"}, "model": {"path": "m"}}))
    cfg.model.path = str(run)
    with pytest.raises(ConfigError, match=r"run directory without an exported model.*export_hf.py"):
        SFTTrainer(cfg)


def test_main_dispatches_on_trainer_type(tmp_path, monkeypatch, capsys):
    from jaxrl_post import main as main_mod

    cfg = _tiny_config(tmp_path, str(tmp_path / "missing.jsonl"))
    cfg.trainer_type = "ppo_sft"
    monkeypatch.setattr(main_mod, "_CONFIG", type("F", (), {"value": cfg})())
    with pytest.raises(SystemExit) as e:
        main_mod.main([])
    assert e.value.code == 2
    want = "config.trainer_type='ppo_sft': must be one of ['dpo', 'reward_model', 'rl', 'sft']"
    assert want in capsys.readouterr().err


def test_sgd_step_moves_params_by_the_gradient(tiny, grads_fn):
    """The jitted update applies the optimizer to exactly `make_sft_grads`' gradients (sgd(1): p - g)."""
    _, g, params, r = tiny
    ids, masks = _examples(8, seed=2)
    batch = sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=True)
    tx = optax.sgd(1.0)
    new, _, m = jax.jit(sft_step.make_sft_update(g, r, tx, chunk=8))(params, tx.init(params), batch)
    _, _, _, grads = grads_fn(params, batch)
    for p0, p1, gr in zip(jax.tree.leaves(params), jax.tree.leaves(new), jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(p0) - np.asarray(p1), np.asarray(gr), atol=1e-7)
    assert float(m["update_skipped"]) == 0.0 and float(m["grad_norm"]) > 0


def test_a_run_dir_with_an_export_resolves_to_it(tmp_path):
    from jaxrl_post.models.resolve import resolve_model_path

    run = tmp_path / "run"
    (run / "huggingface").mkdir(parents=True)
    (run / "config.json").write_text("{}")  # the run's own config: not a model
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(run / "huggingface"))
    (run / "huggingface" / "config.json").write_text("{}")
    assert resolve_model_path(str(run)) == ("hf_dir", str(run / "huggingface"))
    assert resolve_model_path(str(run / "huggingface")) == ("hf_dir", str(run / "huggingface"))


@pytest.mark.slow  # a second compile of the grads fn (LoRA graph): ~30 s on this machine
def test_lora_grads_cover_the_adapters_with_the_base_frozen(tiny, grads_fn):
    from jaxrl_post.models.lora import LoRAConfig, apply_lora

    model = _tiny_model()
    apply_lora(model, LoRAConfig(4, 8.0, "all-linear"), seed=0)
    g, adapters, frozen, r = steps.split_lora_model(model)
    ids, masks = _examples(8, seed=3)
    batch = sft_step.layout_batch(ids, masks, n_micro=4, rows=2, row_len=16, pack=True)
    loss, _, _, grads = jax.jit(sft_step.make_sft_grads(g, r, chunk=8))(adapters, batch, frozen)
    # B = 0 at init: the same function as the base model, so the same loss as full fine-tuning's
    np.testing.assert_allclose(float(loss), float(grads_fn(tiny[2], batch)[0]), rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # adapters only
    norms = [float(jnp.abs(x).sum()) for x in jax.tree.leaves(grads)]
    assert sum(n > 0 for n in norms) == len(norms) // 2  # every B has a gradient; no A while B = 0 (dL/dA ~ B)
