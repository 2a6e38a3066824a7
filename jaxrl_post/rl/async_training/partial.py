"""`PartialGeneration`: one generation batch of the paged engine that a weight update may stop and that resumes
under the new weights (verl's fully-async `partial_rollout`, slime's partial rollout), keeping each token, its
log-prob under the weights that sampled it and that version.

The engine stops at a dispatch boundary (`PagedGenerator.generate(should_stop=...)`) and hands back the unfinished
sequences; `resume` re-reads the rollout model's weights (`update_weights`) and continues them: their contexts
(prompt + tokens so far) are prefilled again under the new weights, and sampling goes on with the same per-row keys
(`fold_in(fold_in(key, step), row)`), so with unchanged weights a stopped and resumed batch equals an uninterrupted
one. The state is JSON-able (a checkpoint holds the batch in flight).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_post.batch.protocol import DataProto
from jaxrl_post.rl.async_training.host_arrays import ArrayPacker, decode_array, encode_array
from jaxrl_post.rollout.paged.scheduler import Seq


def _proto_json(dp: DataProto, packer: ArrayPacker | None) -> dict[str, Any]:
    return {
        "batch": {k: encode_array(np.asarray(v), packer) for k, v in dp.batch.items()},
        "non_tensor": {k: encode_array(v, packer) for k, v in dp.non_tensor_batch.items()},
    }


def _proto_from_json(d: dict[str, Any], arrays) -> DataProto:
    batch = {k: decode_array(v, arrays) for k, v in d["batch"].items()}
    return DataProto.from_dict(batch, {k: decode_array(v, arrays) for k, v in d["non_tensor"].items()})


def _seq_json(s: Seq, packer: ArrayPacker | None) -> dict[str, Any]:
    arrays = {
        "prompt": np.asarray(s.prompt, np.int32),
        "tokens": np.asarray(s.tokens, np.int32).reshape(-1),
        "log_probs": np.asarray(s.log_probs, np.float32).reshape(-1),
        "thresholds": np.asarray(s.thresholds, np.float32).reshape(-1),
    }
    out = {"row": int(s.row), "limit": int(s.limit)}
    if packer is None:  # flat lists (float32 -> Python float -> float32 is exact)
        out.update({k: v.tolist() for k, v in arrays.items()})
    else:
        out.update({k: packer.add(v) for k, v in arrays.items()})
    out["routes"] = [encode_array(r, packer) for r in s.routes]  # MoE routing replay: experts of the tokens fed so far
    return out


def _seq_from_json(d: dict[str, Any], arrays) -> Seq:
    get = lambda x, dt: np.asarray(x, dt) if isinstance(x, list) else decode_array(x, arrays)  # a list: the old form
    return Seq(
        row=d["row"],
        prompt=get(d["prompt"], np.int32),
        limit=d["limit"],
        tokens=[int(t) for t in get(d["tokens"], np.int32)],
        log_probs=list(get(d["log_probs"], np.float32)),
        thresholds=list(get(d["thresholds"], np.float32)),
        routes=[decode_array(r, arrays) for r in d.get("routes", [])],
    )


@dataclasses.dataclass
class PartialGeneration:
    """A generation batch (`prompts`, `n` samples each, sampling `seed`) possibly stopped at a weight update.

    Fields: `out` the result so far (every row; unfinished rows hold their tokens so far), `unfinished` the
    sequences to resume, `versions [B, R] int32` the policy version of every generated token (-1: none yet).
    """

    prompts: DataProto
    seed: int
    n: int
    out: DataProto | None = None
    unfinished: list[Seq] = dataclasses.field(default_factory=list)
    versions: np.ndarray | None = None

    @property
    def done(self) -> bool:
        return self.out is not None and not self.unfinished

    def _tag(self, rows, version: int) -> None:
        """Tokens that exist now and had no version yet get `version`."""
        lengths = self.out.batch["response_attention_mask"].sum(-1)
        for row in rows:
            k = int(lengths[row])
            untagged = self.versions[row, :k] < 0
            self.versions[row, :k][untagged] = version

    def run(self, engine, params, version: int, max_dispatches: int | None = None) -> None:
        """Start, or resume under the engine's model's current weights, for at most `max_dispatches` dispatches
        (None: to the end). `params`: the `SamplingParams` (the same on every call); `version`: the policy
        version of the weights the engine samples with now."""
        stop = None if max_dispatches is None else (lambda d: d >= max_dispatches)
        if self.out is None:
            self.out = engine.generate(self.prompts, params, seed=self.seed, n=self.n, should_stop=stop)
            for k in list(self.out.batch):  # host copies, written in place when resumed rows come back
                self.out.batch[k] = np.array(self.out.batch[k])
            self.versions = np.full(self.out.batch["responses"].shape, -1, np.int32)
            rows = range(len(self.versions))
        else:
            engine.update_weights()  # the weights published since the stop
            rows = [s.row for s in self.unfinished]
            kw = dict(seed=self.seed, n=self.n, should_stop=stop, resume=self.unfinished)
            part = engine.generate(self.prompts, params, **kw)
            for k, v in part.batch.items():
                self.out.batch[k][rows] = np.asarray(v)[rows]
        self.unfinished = list(engine.unfinished)
        self._tag(rows, version)

    def copy(self) -> PartialGeneration:
        """A copy that later runs do not change (they write resumed rows into `out` and extend the unfinished
        sequences in place); arrays are copied, keys keep their order."""
        shallow = lambda dp: DataProto(dict(dp.batch), dict(dp.non_tensor_batch), dict(dp.meta_info))
        out = None
        if self.out is not None:
            out = shallow(self.out)
            out.batch = {k: np.array(v) for k, v in out.batch.items()}
        lists = lambda s: dict(
            tokens=list(s.tokens), log_probs=list(s.log_probs), thresholds=list(s.thresholds), routes=list(s.routes)
        )
        return dataclasses.replace(
            self,
            prompts=shallow(self.prompts),
            out=out,
            unfinished=[dataclasses.replace(s, **lists(s)) for s in self.unfinished],
            versions=None if self.versions is None else self.versions.copy(),
        )

    def state_dict(self, packer: ArrayPacker | None = None) -> dict[str, Any]:
        """JSON-able state (tokens, log-probs, thresholds, versions, the result so far); with `packer` the numeric
        arrays go into its buffers (host_arrays.py) and the JSON holds references."""
        return {
            "prompts": _proto_json(self.prompts, packer),
            "seed": int(self.seed),
            "n": int(self.n),
            "out": None if self.out is None else _proto_json(self.out, packer),
            "unfinished": [_seq_json(s, packer) for s in self.unfinished],
            "versions": None if self.versions is None else encode_array(self.versions, packer),
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> PartialGeneration:
        """Inverse of `state_dict` (`arrays`: the packer's buffers, when it had one)."""
        return cls(
            prompts=_proto_from_json(d["prompts"], arrays),
            seed=int(d["seed"]),
            n=int(d["n"]),
            out=None if d["out"] is None else _proto_from_json(d["out"], arrays),
            unfinished=[_seq_from_json(s, arrays) for s in d["unfinished"]],
            versions=None if d["versions"] is None else decode_array(d["versions"], arrays),
        )
