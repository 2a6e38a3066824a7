"""Fingerprint fixed-seed tiny runs, to prove a refactor changes no number.

Trains the tiny GRPO, PPO, DAPO, GRPO+LoRA and GRPO-padded (no packing) configs for their 2 steps each, and the tiny
SFT (on 12 generated conversations), DPO and reward-model configs for 2 steps each, and writes one JSON: per run, every
step's metrics except timings and throughput, and a sha256 of the final actor (and critic) parameters. Run it
before and after a change and compare the files (`--compare OLD.json`): equal means bitwise equal
parameters and metrics. About 3 CPU minutes.

    python scripts/tiny_run_fingerprint.py /tmp/before.json
    ... change the code ...
    python scripts/tiny_run_fingerprint.py /tmp/after.json --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _digest(tree) -> str:
    import jax
    import numpy as np

    h = hashlib.sha256()
    for x in jax.tree.leaves(jax.tree.map(np.asarray, tree)):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def _run(name: str, module, tweak=None) -> dict:
    from jaxrl_post.rl.trainer import RLTrainer

    c = module.get_config("tiny")
    c.trainer.default_local_dir = os.path.join(tempfile.mkdtemp(), name)
    c.trainer.val_before_train = False
    c.trainer.progress_bar = False
    if tweak:
        tweak(c)
    trainer = RLTrainer(c, console_write=lambda s: None)
    try:
        res = trainer.fit()
        drop = ("timing", "perf/")
        hist = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in res["history"]]
        state = getattr(trainer, "state", None)  # TrainState (train_state.py); older trainers: attributes
        actor = state.actor.params if state is not None else trainer.actor_params
        if state is not None:
            critic = state.critic.params if state.critic is not None else None
        else:
            critic = getattr(trainer, "critic_params", None)
        out = {"history": hist, "actor": _digest(actor)}
        if critic is not None:
            out["critic"] = _digest(critic)
        return out
    finally:
        trainer.close()


def _sft_rows(path: str) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i + 1}"},
                {"role": "assistant", "content": f"{2 * i + 1}"},
            ]
        }
        for i in range(12)
    ]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def _run_supervised(name: str, module, trainer_cls) -> dict:
    c = module.get_config("tiny")
    work = tempfile.mkdtemp()
    c.trainer.default_local_dir = os.path.join(work, name)
    c.trainer.logger = ("jsonl",)
    c.trainer.progress_bar = False
    c.trainer.total_training_steps = 2
    if name == "sft":
        c.data.train_files = c.data.val_files = _sft_rows(os.path.join(work, "sft.jsonl"))
    trainer = trainer_cls(c, console_write=lambda s: None)
    try:
        res = trainer.fit()
        drop = ("timing", "perf/")
        hist = [{k: v for k, v in m.items() if not k.startswith(drop)} for m in res["history"]]
        return {"history": hist, "actor": _digest(trainer.state_dict()["actor"]["params"])}
    finally:
        trainer.close()


def _lora(c):
    c.model.lora_rank, c.model.lora_alpha = 4, 8.0


def _padded(c):
    c.model.use_remove_padding = False


def fingerprints() -> dict:
    from configs import dapo, dpo, grpo, ppo, reward_model, sft
    from jaxrl_post.sft.dpo import DPOTrainer
    from jaxrl_post.sft.reward_model import RewardModelTrainer
    from jaxrl_post.sft.trainer import SFTTrainer

    return {
        "sft": _run_supervised("sft", sft, SFTTrainer),
        "dpo": _run_supervised("dpo", dpo, DPOTrainer),
        "rm": _run_supervised("rm", reward_model, RewardModelTrainer),
        "grpo": _run("grpo", grpo),
        "ppo": _run("ppo", ppo),
        "dapo": _run("dapo", dapo),
        "lora": _run("lora", grpo, _lora),
        "padded": _run("padded", grpo, _padded),
    }


def compare(old: dict, new: dict) -> list[str]:
    """The differences between two fingerprint files, one line each ([] when equal)."""
    diffs = []
    for run in sorted(set(old) | set(new)):
        a, b = old.get(run, {}), new.get(run, {})
        for part in ("actor", "critic"):
            if a.get(part) != b.get(part):
                diffs.append(f"{run}: {part} params {a.get(part)} != {b.get(part)}")
        for step, (x, y) in enumerate(zip(a.get("history", []), b.get("history", []))):
            for k in sorted(set(x) | set(y)):
                if x.get(k) != y.get(k):
                    diffs.append(f"{run} step {step + 1}: {k} {x.get(k)} != {y.get(k)}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="where to write the fingerprint JSON")
    ap.add_argument("--compare", help="an earlier fingerprint JSON to compare with")
    args = ap.parse_args(argv)
    res = fingerprints()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print("| run | steps | actor params sha256 |")
    print("|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {len(v['history'])} | {v['actor']} |")
    if args.compare:
        with open(args.compare) as f:
            diffs = compare(json.load(f), res)
        print(json.dumps({"equal": not diffs, "differences": diffs[:50]}))
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
