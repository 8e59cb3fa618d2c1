"""Both front ends agree: the same tiny Hugging Face Llama (``test_bridge_hf.write_tiny_llama``, made here) imported
into each -- ``nemo-longctx train init_from=<dir>`` (NeMo 2: NeMo's HF importer, ``.venv``) and ``nemo-longctx bridge
init_from=<dir>`` (Megatron-Bridge: ``AutoBridge``, this venv) -- trained one step at ring CP=2 on 2 gloo ranks on the
same tokens, read by each front end from one Megatron indexed dataset: step 1's loss is the same on both and equals
transformers' own fp32 forward on those tokens (<= 1e-5 relative).

The same tokens on both sides: Megatron's ``GPTDataset`` cuts samples of ``seq_length + 1`` tokens at a stride of
``seq_length`` from its (shuffled) documents, and shuffles the samples with sample counts that differ between the
front ends (each asks for its own train/validation/test sizes). The dataset here is ``DOC_COPIES`` copies of one
document of exactly ``SEQ`` tokens: the token stream is periodic with period ``SEQ``, so every sample either front end
can draw is ``tokens = doc``, ``labels = doc[1:] + doc[:1]``. The document avoids the tokenizers' EOD ids (NeMo: the
HF tokenizer's eos 2; Bridge: ``NullTokenizer``'s ``vocab_size - 1``; neither has a pad id), so the loss mask is all
ones on both sides whatever their ``eod_mask_loss``.

Controls: HF's loss on another token order, and with another RoPE base (``rope_theta`` 500000: 1.9% apart), differ
from the reference by far more than the bar, so the agreement is not vacuous. (A norm-epsilon change, 1e-6 -> 1e-5,
moves this model's loss by only 2e-7: not resolved at this bar.)

A non-default RoPE base is where the front ends parted: transformers 5 (this venv, Bridge) writes it as
``rope_parameters.rope_theta``, which the NeMo venv's transformers 4.57 ignores, so NeMo's importer silently took
rope_theta 10000 (the model here keeps the default 10000, read alike by both); ``nemo-longctx import`` / ``train
init_from`` now refuse such a directory, naming the field (last test)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEMO_CLI = ROOT / ".venv" / "bin" / "nemo-longctx"
pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")
if not NEMO_CLI.is_file():
    pytest.skip(f"the NeMo front end's venv is absent ({NEMO_CLI}: the README's first install command makes it; "
                f".ci/run creates .venv before .venv-bridge)", allow_module_level=True)

from runner import run_bridge  # noqa: E402
from test_bridge_hf import HF_CONFIG, hf_loss, write_tiny_llama  # noqa: E402

SEQ = 128
DOC_COPIES = 4
RTOL = 1e-5
# ring CP=2 with Megatron's selective recompute of core attention on both (the layers are then tracker scopes on both
# front ends: the per-layer bytes below)
RING = ["cp=ring", "cp.size=2", "recompute=selective"]
SPLIT = "'100,0,0'"  # every document trains (quoted: a bare comma is a Hydra sweep)
TIMES = {}


def _readable_by_transformers_4(hf: Path) -> None:
    """transformers 5 (this venv) saves ``tokenizer_class: TokenizersBackend``, a class the NeMo venv's transformers
    4.57 does not have (``init_from`` refuses it: "Tokenizer class TokenizersBackend does not exist"); both versions
    load the same tokenizer.json as ``PreTrainedTokenizerFast``."""
    f = hf / "tokenizer_config.json"
    cfg = json.loads(f.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    f.write_text(json.dumps(cfg, indent=2))


def write_dataset(prefix: Path, doc) -> None:
    """``DOC_COPIES`` copies of ``doc`` as a Megatron indexed dataset (``prefix``.bin/.idx), int32 tokens."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for _ in range(DOC_COPIES):
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")


def _batch(doc):
    import torch

    return {"tokens": doc, "labels": torch.roll(doc, -1), "position_ids": torch.arange(len(doc)),
            "loss_mask": torch.ones(len(doc))}


def _start_nemo(out: Path, hf: Path, prefix: Path) -> subprocess.Popen:
    """``nemo-longctx train`` of the NeMo venv (its own interpreter and packages: no variable of this one)."""
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # --verbose: NeMo's own restore line is read below (the quiet console hides NeMo's INFO lines)
    # recipe=demo: the CPU demo's settings, on both front ends (a tiny HF model has no NeMo or Megatron-Bridge recipe
    # of its architecture)
    cmd = [str(NEMO_CLI), "train", "--verbose", f"init_from={hf}", "recipe=demo", "data=indexed",
           f"data.paths=[{prefix}]", "data.tokenizer=null",
           f"data.split={SPLIT}", "data.num_workers=0", f"model.seq_length={SEQ}", "trainer.max_steps=1", *RING,
           f"output_dir={out}", "log.tensorboard=false", "launcher.threads_per_process=1"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=open(out / "log.txt", "w"),
                            stderr=subprocess.STDOUT, text=True)


def _rows(out: Path):
    f = out / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    tmp = tmp_path_factory.mktemp("front_ends")
    hf, prefix = tmp / "tiny_llama", tmp / "data" / "doc"
    write_tiny_llama(hf)
    _readable_by_transformers_4(hf)
    vocab = HF_CONFIG["vocab_size"]
    doc = torch.randint(3, vocab - 1, (SEQ,), generator=torch.Generator().manual_seed(11))  # no unk/bos/eos/EOD
    write_dataset(prefix, doc)

    t0 = time.perf_counter()
    nemo = _start_nemo(tmp / "nemo", hf, prefix)  # both front ends at once (each 2 ranks)
    try:
        bridge = run_bridge(tmp, "bridge", f"init_from={hf}", "recipe=demo", *RING, "train.train_iters=1",
                            f"model.seq_length={SEQ}", f"dataset.data_path={prefix}", f"dataset.split={SPLIT}",
                            "validation.eval_iters=0", "checkpoint.load=null")
        TIMES["bridge"] = round(time.perf_counter() - t0, 1)
        reference = hf_loss(hf, _batch(doc))  # meanwhile, in this process
        other_order = hf_loss(hf, _batch(doc.flip(0)))
        rope = tmp / "tiny_llama_rope"
        shutil.copytree(hf, rope)
        config = json.loads((rope / "config.json").read_text())
        config["rope_parameters"]["rope_theta"] = 500000.0
        (rope / "config.json").write_text(json.dumps(config))
        other_rope = hf_loss(rope, _batch(doc))
        nemo_code = nemo.wait(timeout=600)
        TIMES["nemo"] = round(time.perf_counter() - t0, 1)
    finally:
        if nemo.poll() is None:  # its ranks die with it (PR_SET_PDEATHSIG)
            nemo.kill()
            nemo.wait()
    nemo_run = (nemo_code, (tmp / "nemo" / "log.txt").read_text(), _rows(tmp / "nemo"))
    print(f"\nstep-1 losses: nemo {[r['loss'] for r in nemo_run[2][:1]]} bridge {[r['loss'] for r in bridge[2][:1]]} "
          f"hf {reference!r} (other order {other_order!r}, rope_theta 500000 {other_rope!r}); times (s): {TIMES}")
    return {"hf": hf, "rope": rope, "doc": doc, "reference": reference, "other_order": other_order,
            "other_rope": other_rope, "nemo": nemo_run, "bridge": bridge}


def _step1(run, name):
    code, log, rows = run
    assert code == 0, (name, log[-4000:])
    assert rows and rows[0]["step"] == 1, (name, rows, log[-3000:])
    assert rows[0]["cp_size"] == 2 and rows[0]["world_size"] == 2, (name, rows[0])
    return log, rows[0]["loss"]


def test_step1_loss_is_the_same_on_both_front_ends_and_equals_hugging_face(runs):
    ref = runs["reference"]
    nemo_log, nemo = _step1(runs["nemo"], "nemo")
    bridge_log, bridge = _step1(runs["bridge"], "bridge")
    # each started from the HF weights: NeMo's import + RestoreConfig, Bridge's HF loading
    assert f"importing init_from={runs['hf']}" in nemo_log and "Doing selective restore from RestoreConfig" in nemo_log
    assert f"loading HuggingFace-format checkpoint from {runs['hf']}" in bridge_log, bridge_log[-3000:]
    assert "core attention: 2 layers run LongContextCoreAttention" in bridge_log
    assert abs(nemo - bridge) <= RTOL * ref, (nemo, bridge)
    assert abs(nemo - ref) <= RTOL * ref, (nemo, ref)
    assert abs(bridge - ref) <= RTOL * ref, (bridge, ref)


def test_controls_differ(runs):
    """The tokens and the RoPE base each move HF's loss far past the bar; the weights move it far from ln(vocab)."""
    ref, doc = runs["reference"], runs["doc"]
    assert int(doc.min()) >= 3 and int(doc.max()) < HF_CONFIG["vocab_size"] - 1  # no special / EOD / pad id
    assert abs(ref - math.log(HF_CONFIG["vocab_size"])) > 0.5
    assert abs(runs["other_order"] - ref) > 1000 * RTOL * ref, (runs["other_order"], ref)
    assert abs(runs["other_rope"] - ref) > 100 * RTOL * ref, (runs["other_rope"], ref)


def test_nemo_front_end_refuses_a_rope_base_its_transformers_would_not_read(runs, tmp_path):
    """The RoPE control's directory (``rope_parameters.rope_theta`` 500000, transformers 5's format) would import into
    NeMo with transformers 4.57's default base 10000 -- another model than Bridge's: refused before anything runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    p = subprocess.run([str(NEMO_CLI), "import", f"source={runs['rope']}", f"output={tmp_path / 'imported'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 2, log[-3000:]
    assert f"source={runs['rope']}: config.json rope_parameters=" in log, log[-3000:]
    assert "(rope_theta 500000.0 is read as 10000.0)" in log, log[-3000:]
    assert not (tmp_path / "imported").exists()


def test_the_tracker_counts_the_same_activation_bytes_on_both_front_ends(runs):
    """The same model, tokens and CP layout: the activation tracker's saved-for-backward bytes of step 1 (rank 0), per
    layer, are exactly what the NeMo 2 path measures -- the Bridge callback measures like the NeMo one. Outside the
    layers the two loops differ by one fp32 scalar (measured: 1675848 vs 1675844 bytes in all, the loss reductions of
    Bridge's forward step and NeMo's)."""
    nemo, bridge = runs["nemo"][2][0], runs["bridge"][2][0]
    layers = nemo["activation_bytes_by_layer"]
    assert sorted(layers) == ["layer1", "layer2"] and all(b > 0 for b in layers.values()), nemo
    assert bridge["activation_bytes_by_layer"] == layers, (nemo, bridge)
    assert nemo["activation_bytes_host"] == bridge["activation_bytes_host"] == 0
    assert abs(bridge["activation_bytes_device"] - nemo["activation_bytes_device"]) <= 16, (nemo, bridge)
