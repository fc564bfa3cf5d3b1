"""The model zoo under strict det_ddp: models the project did not write, unchanged apart from
det_transform, train to the same bytes at world sizes 1, 2 and 4 and with accumulation 2.

Models (tests/zoo_models.py): Hugging Face GPT-2 (default dropout, the library's own loss through
``labels=``), Llama (grouped-query attention, rotary embeddings), ViT (conv patches, cls token,
position embedding), a ResNet (Conv2d, BatchNorm2d, in-place ReLU, residual ``+=``),
nn.TransformerEncoder with dropout, and an MLP with Dropout; and, at world sizes 1 and 2 and with
accumulation 2, fifteen more Hugging Face models (zoo_models.MORE: BERT, RoBERTa, ALBERT, GPT-2's
sequence classifier, Qwen2, Gemma, T5, BART, OPT, Falcon, BLOOM, ConvNext, Swin, MobileNetV2 and CLIP's vision tower, each named there
for what it adds). Each configuration is one launch of
tests/zoo_harness.py (gloo, OMP_NUM_THREADS=1) that fits every model 3 steps (AdamWSR; plain runs take torch AdamW). Rank 0
records the SHA-256 of every parameter, buffer (BatchNorm's running statistics) and optimizer
state tensor, and the loss, after every step. BatchNorm takes its statistics over groups of 4
consecutive global samples (``batch_norm_group_size=4``), a group size every configuration's global
micro-batch holds. The plain-DDP control shows that world sizes 1 and 2 differ without det_ddp.
"""
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import clean_env

pytest.importorskip("transformers")

HARNESS = Path(__file__).with_name("zoo_harness.py")
ROOT = HARNESS.parent.parent
MODELS = ("gpt2", "llama", "vit", "resnet", "encoder", "mlp_dropout")
MORE = ("bert", "roberta", "albert", "gpt2_cls", "qwen2", "gemma", "t5", "bart", "opt", "falcon", "bloom", "convnext",
        "swin", "mobilenet_v2", "clip_vision")
BN_GROUP = 4


def _launched(devices: int) -> tuple:
    """The models a configuration's launch trains: MORE at world sizes 1 and 2 only."""
    return MODELS + MORE if devices <= 2 else MODELS

pytestmark = pytest.mark.slow


@lru_cache(maxsize=None)
def zoo_run(devices=1, accum=1, strategy="det_ddp"):
    """{model: rows (dicts) of its optimizer steps} for one configuration."""
    out = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"ldet-zoo-{devices}-{accum}-{strategy}-{os.getpid()}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(HARNESS), "--models", ",".join(_launched(devices)), "--devices", str(devices),
           "--accum", str(accum), "--strategy", strategy, "--out", str(out)]
    if strategy == "det_ddp":
        cmd += ["--bn-group", str(BN_GROUP)]
    proc = subprocess.run(cmd, env=clean_env(MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    if proc.returncode != 0 and not any("error" in r for r in rows):
        raise RuntimeError(f"zoo run failed ({' '.join(cmd[2:])}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return by_model


def steps(devices, accum, model, strategy="det_ddp"):
    rows = zoo_run(devices, accum, strategy).get(model)
    assert rows, f"{model}: no rows at devices={devices} accum={accum} ({strategy})"
    errors = [r for r in rows if "error" in r]
    assert not errors, f"{model} failed at devices={devices} accum={accum}: {errors[0]['error']}\n{errors[0]['trace']}"
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    return rows


def state(rows):
    return [(r["params_sha256"], r["buffers_sha256"], r["optim_sha256"]) for r in rows]


SPLITS = [(model, 2, 1) for model in MODELS + MORE] + [(model, 4, 1) for model in MODELS] + \
    [(model, 1, 2) for model in MODELS + MORE]


@pytest.mark.parametrize("model,devices,accum", SPLITS)
def test_zoo_model_is_split_invariant(model, devices, accum):
    base = steps(1, 1, model)
    other = steps(devices, accum, model)
    assert state(other) == state(base), f"{model}: parameters/buffers/optimizer state differ at devices={devices} accum={accum}"
    if accum == 1:  # a step's loss is the global batch's (with accumulation each micro-batch has its own)
        assert [r["loss_hex"] for r in other] == [r["loss_hex"] for r in base]


@pytest.mark.parametrize("model", MODELS + MORE)
def test_det_trains_every_parameter_plain_training_does(model):
    # a gradient the det path dropped (a mask's, a bias table's) would leave its parameter as it was
    det, plain = steps(1, 1, model)[0]["unchanged"], steps(1, 1, model, strategy="ddp")[0]["unchanged"]
    assert det == plain, f"{model}: the first det step left {sorted(set(det) - set(plain))} unchanged"


@pytest.mark.parametrize("model", MODELS + MORE)
def test_plain_ddp_control_differs(model):
    # the same models and data without det_ddp: world size 2 is not world size 1
    one, two = steps(1, 1, model, strategy="ddp"), steps(2, 1, model, strategy="ddp")
    assert [r["params_sha256"] for r in two] != [r["params_sha256"] for r in one]
