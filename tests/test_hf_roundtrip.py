"""Extend a pretrained model to long context: Hugging Face -> NeMo (``nemo-longctx import`` / ``init_from``) -> RoPE
extension -> CP=2 training -> Hugging Face (``nemo-longctx export``), checked against Hugging Face's own forward.

Tiny GQA models are made with ``transformers`` (random init, norms away from 1) and a BPE tokenizer trained with
``tokenizers``; everything else is the product from its CLI, in real processes:
  * ``imp_l31``: ``nemo-longctx import`` of a Llama with HF ``rope_scaling`` (rope_type llama3, non-default
    low/high frequency factors and original length -- fields NeMo's importer drops, completed by ours);
  * ``llama``: ``nemo-longctx train init_from=<plain Llama HF dir>`` (imported once into the output dir), ring CP=2,
    Llama-3.1 scaling added on the command line, 3 steps, checkpoint -> ``nemo-longctx export``;
  * ``qwen``: ``train init_from=<Qwen2 HF dir> data=documents`` (JSONL -> indexed dataset), Ulysses CP=2, 2 steps,
    then the same command with 3 steps resumes from its own checkpoint (not from init_from) -> ``export``;
  * one 2-rank gloo job builds each checkpoint's model the way the app does (context config + safe overrides + our
    core attention), loads its weights with Megatron's dist_checkpointing and gathers the logits under cp=none,
    ring CP=2 and Ulysses CP=2; Hugging Face's forward on the same tokens is the reference (fp32, <= 1e-4 relative).
Bad inputs fail before anything runs, with a message naming the field, and write nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from app_runner import metrics_rows, run_app
from distributed import run_distributed
from hf_models import corpus, hf_logits, make_hf_model, make_tokenizer, nemo_logits_worker

BIN = Path(sys.executable).parent
CLI = [str(BIN / "nemo-longctx")]
SEQ = 128
TOL = 1e-4
L31_HF = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
          "original_max_position_embeddings": 32}
L31_OVERRIDE = {"scale_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "old_context_len": 32}
COMMON = [f"model.seq_length={SEQ}", "memory.track=false", "launcher.threads_per_process=1", "recipe=demo"]
TIMES = {}
# scripts/matrix_smoke.sh (the version matrix) runs only this file's `matrix` tests: the fixture then skips what only
# the other tests read (the Llama-3.1 import and the 18 imported-logits cases), ~2 of its 3 minutes
SMOKE = os.environ.get("NEMO_LONGCTX_MATRIX_SMOKE") == "1"


def _ok(cmd, name, timeout=420):
    t0 = time.perf_counter()
    code, out = run_app(cmd, timeout)
    TIMES[name] = round(time.perf_counter() - t0, 1)
    assert code == 0, out[-5000:]
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _steps(out_dir: Path):
    rows = metrics_rows(out_dir)
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _last_ckpt(out_dir: Path) -> Path:
    found = [p for p in (out_dir / "checkpoints").iterdir() if p.name.endswith("-last")]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    tok = make_tokenizer()
    hf = {"llama": make_hf_model(base / "hf_llama", "llama", tok, seed=1),
          "l31": make_hf_model(base / "hf_l31", "llama", tok, seed=2, rope_scaling=L31_HF),
          "qwen": make_hf_model(base / "hf_qwen", "qwen2", tok, seed=3)}
    docs = base / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(n=40, seed=1)))
    d = {k: base / k for k in ("imp_l31", "llama", "qwen", "exp_llama", "exp_qwen")}

    def llama_chain():
        if not SMOKE:
            _ok(CLI + ["import", f"source={hf['l31']}", f"output={d['imp_l31']}"], "import")
        out = _ok(CLI + ["train", "--verbose", f"init_from={hf['llama']}", f"output_dir={d['llama']}", "cp=ring",
                         "trainer.max_steps=3", "checkpoint.every_n_steps=3", *COMMON,
                         *[f"++model.{k}={v}" for k, v in L31_OVERRIDE.items()]], "train_llama_ring")
        _ok(CLI + ["export", f"checkpoint={d['llama']}", f"output={d['exp_llama']}"], "export")
        return out

    def qwen_chain():
        qwen_args = [f"init_from={hf['qwen']}", f"output_dir={d['qwen']}", "cp=ulysses", "checkpoint.every_n_steps=2",
                     "data=documents", f"data.paths=[{docs}]", "model.rotary_base=100000", *COMMON]
        # --verbose: the resume assertions read NeMo's own INFO lines (which checkpoint it restores, no selective
        # restore)
        out = _ok(CLI + ["train", "--verbose", *qwen_args, "trainer.max_steps=2"], "train_qwen_ulysses")
        resumed = _ok(CLI + ["train", "--verbose", *qwen_args, "trainer.max_steps=3"], "resume_qwen")
        _ok(CLI + ["export", f"checkpoint={d['qwen']}", f"output={d['exp_qwen']}"], "export_qwen")
        return out, resumed

    # the two models' runs are independent: side by side (a worker with nothing else to run uses both cores)
    with ThreadPoolExecutor(2) as pool:
        llama, qwen = pool.submit(llama_chain), pool.submit(qwen_chain)
        llama_out, (qwen_out, qwen_resumed) = llama.result(), qwen.result()

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, len(tok), (1, SEQ), generator=g)
    imp_llama, imp_qwen = str(d["llama"] / "pretrained"), str(d["qwen"] / "pretrained")
    variants = {  # name -> (checkpoint, overrides, HF dir, HF config changes)
        "llama": (imp_llama, {}, hf["llama"], {}),
        "llama_base": (imp_llama, {"rotary_base": 500000.0}, hf["llama"], {"rope_theta": 500000.0}),
        "llama_l31": (imp_llama, L31_OVERRIDE, hf["llama"], {"rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}}),
        "l31_import": (str(d["imp_l31"]), {}, hf["l31"], {}),
        "qwen": (imp_qwen, {}, hf["qwen"], {}),
        "qwen_base": (imp_qwen, {"rotary_base": 100000.0}, hf["qwen"], {"rope_theta": 100000.0}),
    }
    cases = [] if SMOKE else [(f"{v}/{a}", ck, ov, a) for v, (ck, ov, _, _) in variants.items()
                              for a in ("none", "ring", "ulysses")]
    cases += [("trained_llama/ring", str(_last_ckpt(d["llama"])), {}, "ring"),
              ("trained_qwen/ulysses", str(_last_ckpt(d["qwen"])), {}, "ulysses")]
    t0 = time.perf_counter()
    nemo = run_distributed(nemo_logits_worker, 2, cases, tokens, threads=1, timeout=600)[0]
    TIMES["nemo_logits_20_cases"] = round(time.perf_counter() - t0, 1)
    ref = {v: hf_logits(h, tokens, ch) for v, (_, _, h, ch) in variants.items() if not (SMOKE and v == "l31_import")}
    ref["trained_llama"] = hf_logits(d["exp_llama"], tokens)
    ref["trained_qwen"] = hf_logits(d["exp_qwen"], tokens)
    ref["plain_llama"], ref["plain_qwen"] = ref["llama"], ref["qwen"]
    for r in nemo.values():
        r["logits"] = torch.from_numpy(r["logits"])
    errors = {name: _rel(r["logits"], ref[name.split("/")[0]]) for name, r in nemo.items()}
    print("\nlogit errors (max |nemo - hf| / max |hf|):")
    for name, e in sorted(errors.items()):
        print(f"  {name:24s} {e:.2e}")
    print("process times (s):", TIMES)
    return {"dirs": d, "hf": hf, "nemo": nemo, "ref": ref, "errors": errors, "tokens": tokens,
            "llama_out": llama_out, "qwen_out": qwen_out, "qwen_resumed": qwen_resumed, "tok": tok, "base": base}


@pytest.mark.parametrize("variant", ["llama", "llama_base", "llama_l31", "l31_import", "qwen", "qwen_base"])
@pytest.mark.parametrize("algorithm", ["none", "ring", "ulysses"])
def test_imported_logits_equal_hugging_face(world, variant, algorithm):
    err = world["errors"][f"{variant}/{algorithm}"]
    assert err <= TOL, (variant, algorithm, err)


def test_rope_variants_are_not_vacuous(world):
    """The RoPE changes move HF's logits far more than the tolerance, and NeMo follows each one."""
    ref = world["ref"]
    for variant, plain in (("llama_base", "llama"), ("llama_l31", "llama"), ("qwen_base", "qwen")):
        assert _rel(ref[variant], ref[plain]) > 100 * TOL, variant
    assert world["nemo"]["llama_l31/ring"]["config"] == "Llama31Config"
    assert world["nemo"]["l31_import/ring"]["config"] == "Llama31Config"
    assert world["nemo"]["qwen_base/ulysses"]["rotary_base"] == 100000.0


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_trained_checkpoint_exports_to_the_same_logits(world):
    """NeMo logits of the checkpoint trained under CP=2 == HF logits of its export; training moved the weights."""
    for name, plain in (("trained_llama/ring", "plain_llama"), ("trained_qwen/ulysses", "plain_qwen")):
        assert world["errors"][name] <= TOL, (name, world["errors"][name])
    assert _rel(world["ref"]["trained_llama"], world["ref"]["llama_l31"]) > 100 * TOL  # 3 steps of Adam
    assert _rel(world["ref"]["trained_qwen"], world["ref"]["qwen_base"]) > 100 * TOL
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(world["dirs"]["exp_llama"])  # the extension travels into the HF config
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert cfg.max_position_embeddings == SEQ
    assert AutoConfig.from_pretrained(world["dirs"]["exp_qwen"]).rope_theta == 100000.0


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_training_starts_from_the_pretrained_weights(world):
    """Step 1's loss of the ring CP=2 run (weights restored by NeMo's RestoreConfig) == HF's loss on the same sample
    with the same RoPE scaling."""
    from nemo_longctx.integrations.nemo.data import RepeatedBlockDataset

    sample = RepeatedBlockDataset(1, SEQ, len(world["tok"]), period=256, seed=1234, skew=3.0)[0]
    logits = hf_logits(world["hf"]["llama"], sample["tokens"][None], {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    hf_loss = float(torch.nn.functional.cross_entropy(logits[0], sample["labels"]))
    steps = _steps(world["dirs"]["llama"])
    assert abs(steps[1] - hf_loss) <= 1e-5 * hf_loss, (steps[1], hf_loss)
    assert "importing init_from=" in world["llama_out"] and (world["dirs"]["llama"] / "pretrained").is_dir()
    assert "Doing selective restore from RestoreConfig" in world["llama_out"]


@pytest.mark.matrix  # the version-matrix smoke set (scripts/matrix_smoke.sh)
def test_documents_data_and_resume_from_own_checkpoint(world):
    out, resumed = world["qwen_out"], world["qwen_resumed"]
    m = re.search(r"data=documents: (\d+) documents, (\d+) tokens", out)
    assert m and int(m.group(1)) == 40 and int(m.group(2)) > 3 * SEQ, out[-3000:]
    assert "data=documents:" not in resumed  # the indexed dataset is reused
    assert "Restoring states from the checkpoint path" in resumed and "step=1-" in resumed
    assert re.search(r"nemo-longctx: resumed at step 2 from \S*step=1-", resumed), resumed[-3000:]
    assert "Doing selective restore" not in resumed  # its own checkpoint, not init_from's weights
    steps = _steps(world["dirs"]["qwen"])
    assert sorted(steps) == [1, 2, 3] and all(0 < v < 10 for v in steps.values()), steps


def test_bad_inputs_fail_before_anything_runs(world, tmp_path):
    tok = world["tok"]
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    (not_hf / "README.md").write_text("no model here")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    small_vocab = make_hf_model(tmp_path / "small_vocab", "llama", tok, vocab_size=256)
    cases = {
        "not_hf": (["import", f"source={not_hf}"], "not a Hugging Face model directory (no config.json)"),
        "arch": (["import", f"source={gpt2}"], "architecture GPT2LMHeadModel is not supported"),
        "vocab": (["import", f"source={small_vocab}"], "tokenizer/vocab mismatch: the tokenizer has 300 tokens but "
                                                       "config.json vocab_size=256"),
        "export": (["export", f"checkpoint={not_hf}"], "not a NeMo checkpoint directory"),
    }
    for name, (args, message) in cases.items():
        out_dir = tmp_path / f"out_{name}"
        code, out = run_app(CLI + args + [f"output={out_dir}"], 120)
        assert code == 2 and message in out, (name, code, out[-2000:])
        assert not out_dir.exists() and not list(tmp_path.glob(f".out_{name}*")), name
    run_dir = tmp_path / "arch_override"
    code, out = run_app(CLI + ["train", f"init_from={world['dirs']['imp_l31']}", f"output_dir={run_dir}",
                               "model.num_layers=3", "model.hidden_size=128", "model.seq_length=64", "recipe=demo"],
                        200)
    assert code != 0, out[-2000:]
    assert "model.num_layers: init_from takes the model from the checkpoint" in out, out[-3000:]
    assert "model.hidden_size" in out and "model.seq_length" not in out.split("invalid configuration")[-1]
    assert "step 1" not in out and not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
