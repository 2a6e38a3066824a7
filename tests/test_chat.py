"""scripts/chat.py one-shot: a tiny model exported as an HF directory answers `--prompt` greedily with the chat
template, matching an independent greedy loop (full forward per token, argmax, stop at EOS)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from configs import grpo
from tests.script_loader import load_script


# slow: one rollout compile plus an eager reference loop (about a minute on a loaded 2-core CPU)
@pytest.mark.slow
def test_one_shot_prompt_matches_a_plain_greedy_loop(tmp_path, capsys):
    from jaxrl_post.models import init_model
    from jaxrl_post.models.char_tokenizer import build_char_tokenizer
    from jaxrl_post.models.hf_io import save_pretrained
    from jaxrl_post.models.tokenizer import apply_chat_template
    from jaxrl_post.rl.builders import eos_and_pad, model_config_from

    tok = build_char_tokenizer()
    model = init_model(model_config_from(grpo.get_config("tiny")), seed=3)
    save_pretrained(model, tok, str(tmp_path / "hf"))
    chat = load_script("chat")
    R = 6
    assert (
        chat.main(
            ["--model", str(tmp_path / "hf"), "--prompt", "2+2?", "--max-new-tokens", str(R), "--temperature", "0"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.endswith("\n")
    answer = printed[:-1]

    ids = apply_chat_template(tok, [{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")  # the chat template was applied
    c = chat.Chat(model, tok, max_new_tokens=R, temperature=0)
    c.messages.append({"role": "user", "content": "2+2?"})
    assert c.prompt_ids() == ids  # what chat.py samples from (a random tiny model may not depend on it)
    eos, _ = eos_and_pad(tok)
    forward = jax.jit(lambda m, x: m(x, jnp.ones_like(x)))  # the plain forward, compiled (eager: op by op)
    out = []
    seq = list(ids)
    for _ in range(R):
        x = np.asarray([seq], np.int32)
        nxt = int(np.argmax(np.asarray(forward(model, x))[0, -1]))
        if nxt in eos:
            break
        out.append(nxt)
        seq.append(nxt)
    assert answer == tok.decode(out, skip_special_tokens=True) and len(out) > 0
    # a missing model: one error line, exit 2
    assert chat.main(["--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.startswith("error: no such file or directory")
