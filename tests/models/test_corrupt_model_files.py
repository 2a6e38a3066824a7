"""A corrupt or truncated model file (config.json, model.safetensors, .gguf) is named with what is wrong, by the
pre-flight check (one `error:` line from main) and by the loader, instead of json's / safetensors' / gguf's
messages that name no file."""

import re

import pytest

from jaxrl_post.errors import ConfigError


def test_corrupt_model_files_are_named(tmp_path):
    """A corrupt or truncated config.json, model.safetensors or .gguf: the pre-flight check names model.path, the
    file and what is wrong (main prints it as one `error:` line before anything is built); the loader says the
    same as a ValueError instead of json's / safetensors' / gguf's messages, which name no file."""
    import shutil

    import gguf
    import ml_collections
    import numpy as np
    from flax import nnx

    from jaxrl_post.models import get_preset, hf_io, load_pretrained
    from jaxrl_post.models.decoder import Transformer
    from jaxrl_post.rl.preflight import check_model_path

    mcfg = get_preset("smollm2_135m").replace(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=64
    )
    good = tmp_path / "good"
    hf_io.save_pretrained(Transformer(mcfg, rngs=nnx.Rngs(0)), None, str(good))
    w = gguf.GGUFWriter(str(tmp_path / "good.gguf"), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf_bytes = (tmp_path / "good.gguf").read_bytes()

    def hf_variant(name, file, data):
        shutil.copytree(good, tmp_path / name)
        (tmp_path / name / file).write_bytes(data)
        return tmp_path / name, tmp_path / name / file

    st = (good / "model.safetensors").read_bytes()
    cases = [
        (*hf_variant("cfg_cut", "config.json", (good / "config.json").read_bytes()[:20]), "not valid JSON (Expecting"),
        (*hf_variant("st_cut", "model.safetensors", st[: len(st) // 2]), "incomplete metadata, file not fully covered"),
        (*hf_variant("st_junk", "model.safetensors", b"\xff" * 100), "header too large"),
    ]
    for name, data, what in [
        ("magic.gguf", b"XXXX" + gguf_bytes[4:], "it starts with b'XXXX', not b'GGUF'"),
        ("cut.gguf", gguf_bytes[:-100], "the GGUF file is corrupt or truncated (188 bytes"),
    ]:
        (tmp_path / name).write_bytes(data)
        cases.append((tmp_path / name, tmp_path / name, what))
    for path, file, what in cases:
        c = ml_collections.ConfigDict({"trainer_type": "rl", "model": {"random_init": False, "path": str(path)}})
        with pytest.raises(ConfigError) as e:
            check_model_path(c)
        assert str(e.value).startswith(f"config.model.path={str(path)!r}: {file}: "), str(e.value)
        assert what in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ValueError, match=f"^{file}: .*{re.escape(what)}"):
            load_pretrained(str(path))
    c = ml_collections.ConfigDict({"trainer_type": "rl", "model": {"random_init": False, "path": str(good)}})
    check_model_path(c)  # the intact checkpoint passes
    # the other model keys: a reward model's directory and a teacher (`distillation.teacher_models...model_path`)
    st_junk, junk_file, junk_what = cases[2]
    with pytest.raises(ValueError, match=f"^{junk_file}: .*{junk_what}"):
        hf_io.load_reward_model(str(st_junk))
    from configs import opd
    from jaxrl_post.rl.roles.teacher import check_teacher_path

    oc = opd.get_config("smollm2")
    oc.distillation.teacher_models.teacher_model.model_path = str(tmp_path / "magic.gguf")
    with pytest.raises(
        ConfigError, match=r"^config\.distillation\.teacher_models\.teacher_model\.model_path=.*b'XXXX'"
    ):
        check_teacher_path(oc)


def test_incomplete_or_mistyped_config_json_is_named(tmp_path):
    """A config.json that is valid JSON but lacks a key the model needs, has a size of the wrong type, or names an
    unsupported model type: the pre-flight check names model.path, the file and the key (one `error:` line from
    main) instead of a KeyError / TypeError traceback from the loader (found by the new-user trial of issue 55)."""
    import json
    import shutil

    import ml_collections
    from flax import nnx

    from jaxrl_post.models import get_preset, hf_io
    from jaxrl_post.models.decoder import Transformer
    from jaxrl_post.rl.preflight import check_model_path

    mcfg = get_preset("smollm2_135m").replace(
        num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, vocab_size=64
    )
    good = tmp_path / "good"
    hf_io.save_pretrained(Transformer(mcfg, rngs=nnx.Rngs(0)), None, str(good))
    base = json.loads((good / "config.json").read_text())
    cases = [
        ("no_heads", {"num_attention_heads": None}, "num_attention_heads=None is not a positive integer"),
        ("str_size", {"hidden_size": "sixty-four"}, "hidden_size='sixty-four' is not a positive integer"),
        ("zero_vocab", {"vocab_size": 0}, "vocab_size=0 is not a positive integer"),
        ("list_layers", {"num_hidden_layers": [2]}, "num_hidden_layers=[2] is not a positive integer"),
        ("bad_rope", {"rope_scaling": "x"}, "the model config has a value of the wrong type ("),
        ("bert", {"model_type": "bert"}, "model_type 'bert' not supported; supported: ["),
    ]
    missing = {k: v for k, v in base.items() if k != "num_attention_heads"}
    for name, change, what in [*cases, ("missing_heads", None, "the model config has no 'num_attention_heads'")]:
        shutil.copytree(good, tmp_path / name)
        cfg = missing if change is None else {**base, **change}
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        c = ml_collections.ConfigDict(
            {"trainer_type": "rl", "model": {"random_init": False, "path": str(tmp_path / name)}}
        )
        with pytest.raises(ConfigError) as e:
            check_model_path(c)
        file = tmp_path / name / "config.json"
        assert str(e.value).startswith(f"config.model.path={str(tmp_path / name)!r}: {file}: "), str(e.value)
        assert what in str(e.value) and "\n" not in str(e.value), str(e.value)
    c = ml_collections.ConfigDict({"trainer_type": "rl", "model": {"random_init": False, "path": str(good)}})
    check_model_path(c)  # the intact checkpoint passes
