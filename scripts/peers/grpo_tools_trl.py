"""TRL `GRPOTrainer` with the calculator tool: the peer of `configs/grpo_tools.py`, timed per optimizer step.

    python scripts/peers/grpo_tools_trl.py --model-dir $MODEL_DIR [--rows rows.jsonl] [--steps 3]
        [--prompts 4] [--n 8] [--max-completion 192] [--micro 4] [--threads 2]

The same run as `python -m jaxrl_post.main --config=configs/grpo_tools.py` (docs/agents.md), in TRL 1.16:

- rows: `grpo_tools_rows.py` (our row builder, our training order; run in a separate process when `--rows` is
  not given, so this process never imports jax): the same system prompt with the same tool prompt inside it, so
  the rendered prompt text equals ours (`tests/e2e/test_peer_grpo_tools.py` checks it against our agent loop);
- tool: `tools=[calculator]`, our `jaxrl_post.rollout.tools.calculator` itself (TRL builds its schema from the
  docstring, as we do). TRL runs a turn's calls in this process and appends one `tool` message per call;
  `max_tool_calling_iterations=2` = our `max_assistant_turns=3` (two calls answered, a third turn to answer).
  TRL runs every call of a turn (we run the first: `max_parallel_calls=1`), and a malformed call is plain text
  for TRL (the trajectory ends) where ours answers `Error: malformed tool call`;
- chat template: SmolLM2's own (the converted dir's), plus the rendering of an assistant turn's `tool_calls`
  (TRL checks that a template can show them; SmolLM2's prints only `content`). The tool message renders as
  SmolLM2's template renders it (`<|im_start|>tool\\n...<|im_end|>`), so TRL's tool suffix is ours; the tool
  list is already in the system message and `tools=` renders nothing. Tool calls are parsed with TRL's Qwen3
  response template (Hermes `<tool_call>{json}</tool_call>`);
- reward: our `reasoning_gym_reward.compute_score` on the decoded completion tokens (the model's turns and the
  tool results, special tokens skipped, as our reward manager decodes them): the last `<answer>` tag;
- shape: 4 prompts x 8 completions per step, one AdamW step per generation batch (micro-batches of `--micro`
  completions, gradient accumulation 32 / micro), max_completion_length 192 over all turns, temperature 1.0,
  lr 1e-5 (2 warm-up steps, then constant), weight decay 0, clip 1.0, beta 0 (no reference model, our config
  has no KL), float32, CPU, torch threads 2, prompts in file order.

Timing: a callback from `on_step_begin` to `on_step_end` (one optimizer step, generation included); the first
step is the warm-up and is not counted. Generation time: the wrapped `_generate_and_score_completions`. Per
step it prints a JSON line; at the end `RESULT {json}` (`step_s`, `step_s_median`, `gen_s`, `warmup_step_s`,
`tool_call_frequency` = TRL's `tools/call_frequency` (calls per completion), `tool_use_rate` (completions
with at least one tool result), `num_turns_mean` (assistant turns + tool messages per completion, as our
`num_turns/mean`), `reward_mean`, `resp_len_mean`, `peak_rss_mb_self`, versions).
Peak memory for the comparison is the runner's `/usr/bin/time -v` maximum RSS of this process.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for p in (_HERE, _REPO):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

# SmolLM2-135M-Instruct's chat template (GGUF / converted dir) with one addition: an assistant message's
# `tool_calls` rendered after its content as Hermes `<tool_call>` blocks. `tools=` renders nothing (as SmolLM2's).
SMOLLM2_TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for tc in message['tool_calls'] %}"
    "{% if (message['content'] or '') or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n' }}{{ {'name': tc['function']['name'], 'arguments': tc['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="float32 safetensors HF dir (convert_gguf_to_hf.py)")
    ap.add_argument("--rows", default=None, help="jsonl of grpo_tools_rows.py; default: built in a subprocess")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--n", type=int, default=8, help="completions per prompt (rollout.n)")
    ap.add_argument("--max-completion", type=int, default=192, help="tokens over all turns (max_response_length)")
    ap.add_argument("--max-tool-iterations", type=int, default=2, help="max_assistant_turns - 1")
    ap.add_argument("--micro", type=int, default=4, help="completions per micro-batch (ppo_micro_batch_size)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=2, help="linear warm-up steps (optim.lr_warmup_steps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/trl_grpo_tools_run")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.prompts < 1 or a.n < 2:
        ap.error("--steps and --prompts must be >= 1, --n >= 2")
    if (a.prompts * a.n) % a.micro:
        ap.error(f"--micro {a.micro} must divide prompts x n = {a.prompts * a.n}")
    return a


def tool_template_tokenizer(tok):
    """`tok` with `SMOLLM2_TOOL_TEMPLATE` and TRL's Qwen3 response template (the Hermes tool-call parser)."""
    from trl.chat_template_utils import qwen3_template

    tok.chat_template = SMOLLM2_TOOL_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def make_reward(tok, stats: dict):
    """Our reward on TRL's completions: `compute_score` of the decoded completion tokens (model turns and tool
    results, special tokens skipped). Also counts, into `stats`, completions with a tool result and rewards."""
    from jaxrl_post.rewards.reasoning_gym_reward import compute_score

    def answer_tag_reward(prompts, completions, completion_ids, ground_truth, extra_info_json, data_source, **kw):
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        out = [
            float(compute_score(t, g, json.loads(e), d))
            for t, g, e, d in zip(texts, ground_truth, extra_info_json, data_source)
        ]
        used = [any(m.get("role") == "tool" for m in c) if isinstance(c, list) else False for c in completions]
        turns = [  # model turns + tool messages, as our `num_turns` (model + environment turns)
            sum(m.get("role") in ("assistant", "tool") for m in c) if isinstance(c, list) else 1 for c in completions
        ]
        stats["tool_use"] = stats.get("tool_use", []) + used
        stats["turns"] = stats.get("turns", []) + turns
        stats["reward"] = stats.get("reward", []) + out
        return out

    return answer_tag_reward


def load_rows(a) -> list[dict]:
    """The rows of `--rows`, or `grpo_tools_rows.py`'s first (steps + 1) x prompts, written by a subprocess."""
    need = (a.steps + 1) * a.prompts
    path = a.rows
    if path is None:
        path = os.path.join(a.workdir, "rows.jsonl")
        env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, os.path.join(_HERE, "grpo_tools_rows.py"), "--out", path, "--prompts", str(need)]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    if len(rows) < need:
        raise ValueError(f"{path} has {len(rows)} rows; {a.steps + 1} steps x {a.prompts} prompts need {need}")
    return rows[:need]


def summarize(steps: list[dict], a, **extra) -> dict:
    """The `RESULT` dict from per-step records (`step_s`, `gen_s`, `tool_call_frequency`, `tool_use_rate`,
    `num_turns_mean`, `reward_mean`, `resp_len_mean`); the first step is the warm-up; the rates are means over
    all steps, the warm-up included."""
    timed = steps[1:]
    step_s = [round(s["step_s"], 3) for s in timed]

    def mean_of(key):
        vals = [s[key] for s in steps if s.get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {
        "system": "trl",
        "trainer": "grpo_tools",
        "timed_steps": len(timed),
        "warmup_step_s": round(steps[0]["step_s"], 3) if steps else None,
        "step_s": step_s,
        "step_s_median": round(statistics.median(step_s), 3) if step_s else None,
        "gen_s": [round(s.get("gen_s", 0.0), 3) for s in timed],
        "tool_call_frequency": mean_of("tool_call_frequency"),
        "tool_use_rate": mean_of("tool_use_rate"),
        "reward_mean": mean_of("reward_mean"),
        "num_turns_mean": mean_of("num_turns_mean"),
        "resp_len_mean": mean_of("resp_len_mean"),
        "peak_rss_mb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "prompts": a.prompts,
        "n": a.n,
        "max_completion_length": a.max_completion,
        "micro": a.micro,
        "lr": a.lr,
        "threads": a.threads,
        **extra,
    }


def main(argv=None) -> None:
    a = parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    rows = load_rows(a)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl_post.rollout.tools import calculator

    torch.set_num_threads(a.threads)
    tok = tool_template_tokenizer(AutoTokenizer.from_pretrained(a.model_dir))
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    keys = ("prompt", "ground_truth", "extra_info_json", "data_source")
    ds = Dataset.from_list([{k: r[k] for k in keys} for r in rows])
    gen_batch = a.prompts * a.n
    cfg = GRPOConfig(
        output_dir=a.workdir,
        per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=gen_batch // a.micro,
        num_generations=a.n,
        max_completion_length=a.max_completion,
        max_tool_calling_iterations=a.max_tool_iterations,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=a.lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=a.warmup,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        max_steps=a.steps + 1,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        log_completions=False,
    )
    stats: dict = {}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(tok, stats),
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        tools=[calculator],
    )

    steps: list[dict] = []
    cur: dict = {}
    orig = trainer._generate_and_score_completions

    def timed_gen(inputs):
        t = time.perf_counter()
        out = orig(inputs)
        cur["gen_s"] = cur.get("gen_s", 0.0) + time.perf_counter() - t
        cur["resp_len_mean"] = float(out["completion_mask"].sum(1).float().mean())
        return out

    trainer._generate_and_score_completions = timed_gen

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            cur.clear()
            stats.clear()
            cur["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            rec = {"step": state.global_step, "step_s": time.perf_counter() - cur.pop("t0"), **cur}
            use, rew = stats.get("tool_use", []), stats.get("reward", [])
            rec["tool_use_rate"] = sum(use) / len(use) if use else None
            rec["reward_mean"] = sum(rew) / len(rew) if rew else None
            turns = stats.get("turns", [])
            rec["num_turns_mean"] = sum(turns) / len(turns) if turns else None
            steps.append(rec)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and steps and "tools/call_frequency" in logs:
                steps[-1]["tool_call_frequency"] = float(logs["tools/call_frequency"])
            if logs and steps and "loss" in logs:
                rec = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in steps[-1].items()}
                print("STEP " + json.dumps(rec), flush=True)

    trainer.add_callback(Timer())
    trainer.train()
    summarize_extra = dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__)
    summarize_extra["n_params"] = sum(p.numel() for p in model.parameters())
    print("RESULT " + json.dumps(summarize(steps, a, **summarize_extra)), flush=True)


if __name__ == "__main__":
    main()
