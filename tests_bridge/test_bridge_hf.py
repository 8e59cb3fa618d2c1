"""Hugging Face import and export on the Bridge front end, through Megatron-Bridge's own ``AutoBridge``
(``integrations/bridge/hf.py``): a tiny GQA Llama written with ``save_pretrained`` trains through
``nemo-longctx bridge init_from=<dir>`` with the step-1 loss of transformers' own forward on the same batch (1 rank and
ring CP=2 on 2 gloo ranks); ``nemo-longctx bridge-export`` writes the trained checkpoint back as a HF directory whose
forward gives the next step's loss, and an untrained round trip gives back the original tensors bit for bit.

The batch is rebuilt from the container the app builds (``apps.bridge.build``: its mock dataset config and tokenizer)
with Bridge's own dataset provider: Bridge's mock data is deterministic from its seed, and sample i is step i+1's
(global batch 1, no data parallelism)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")

HF_CONFIG = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"])
RTOL = 1e-5
RUN = ["validation.eval_iters=0", "checkpoint.load=null", "dataset.eod_mask_loss=true"]


def write_tiny_llama(path: Path) -> None:
    """Weights set from a fixed generator (not the init), large enough that the loss is far from a random init's
    ln(vocab); a word-level tokenizer (Bridge's export copies the source's tokenizer)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIG)).float()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if p.dim() == 1 else
                    0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(HF_CONFIG["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def _start(out: Path, module: str, *args) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=open(out / "log.txt", "w"),
                            stderr=subprocess.STDOUT, text=True)


def _bridge(out: Path, *args) -> subprocess.Popen:
    return _start(out, "nemo_longctx.apps.bridge", f"output_dir={out}", *args)


def _export(out: Path, checkpoint: Path, hf_out: Path) -> subprocess.Popen:
    return _start(out, "nemo_longctx.apps.bridge_convert", f"checkpoint={checkpoint}", f"output={hf_out}")


def _result(p: subprocess.Popen, out: Path, timeout: int = 600):
    code = p.wait(timeout=timeout)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return code, (out / "log.txt").read_text(), rows


def reference_batches(hf_dir: Path, n: int, out: Path):
    """The first ``n`` training samples of the container ``nemo-longctx bridge init_from=<hf_dir>`` builds (the app's
    own ``build``), from Bridge's own dataset provider."""
    from megatron.bridge.data.utils import pretrain_train_valid_test_datasets_provider
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    from nemo_longctx.apps import bridge as bridge_app

    spec = bridge_app.compose([f"init_from={hf_dir}", "recipe=demo", "cp=none"])
    container = bridge_app.build(spec, RUN, str(out))
    ds = container.dataset
    ds.finalize()
    ds.tokenizer = build_tokenizer(container.tokenizer)
    train, _, _ = pretrain_train_valid_test_datasets_provider([n, 0, 0], ds)
    return [train[i] for i in range(n)]


def hf_loss(hf_dir: Path, batch) -> float:
    """transformers' LlamaForCausalLM in fp32 on the batch: mean cross-entropy of ``labels`` under ``loss_mask``."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"][None].long(),
                       position_ids=batch["position_ids"][None].long()).logits[0].float()
    ce = torch.nn.functional.cross_entropy(logits, batch["labels"].long(), reduction="none")
    mask = batch["loss_mask"].float()
    return float((ce * mask).sum() / mask.sum())


def _tensors(hf_dir: Path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bridge_hf")
    hf = tmp / "tiny_llama"
    write_tiny_llama(hf)
    # recipe=demo: the CPU demo's settings (the tiny model has no Megatron-Bridge recipe of its architecture, which
    # recipe=auto, the default, would look for)
    init = [f"init_from={hf}", "recipe=demo", *RUN]
    ring_args = [*init, "cp=ring", "cp.size=2", "train.train_iters=2", "scheduler.lr_warmup_iters=0",
                 f"checkpoint.save={tmp / 'ckpt_ring'}", "checkpoint.save_interval=1"]  # a real step (no warm-up)
    # 1 rank: no training (lr 0), saved, for the exact round trip; the control: the same run without init_from
    started = {"none": _bridge(tmp / "none", *init, "cp=none", "train.train_iters=1", "optimizer.lr=0",
                               "optimizer.min_lr=0", f"checkpoint.save={tmp / 'ckpt_none'}",
                               "checkpoint.save_interval=1"),
               "control": _bridge(tmp / "control", *RUN, "cp=none", "train.train_iters=1")}
    batches = reference_batches(hf, 2, tmp / "reference")  # meanwhile, in this process
    reference = hf_loss(hf, batches[0])
    runs = {"none": _result(started.pop("none"), tmp / "none")}
    started["export_none"] = _export(tmp / "export_none", tmp / "ckpt_none", tmp / "hf_none")
    started["ring"] = _bridge(tmp / "ring", *ring_args)  # ring CP=2 on 2 ranks
    runs.update({k: _result(started.pop(k), tmp / k) for k in ("control", "export_none", "ring")})
    runs["export_ring"] = _result(_export(tmp / "export_ring", tmp / "ckpt_ring" / "iter_0000001", tmp / "hf_ring"),
                                  tmp / "export_ring")
    return {"tmp": tmp, "hf": hf, "runs": runs, "batches": batches, "hf_loss": reference}


def _ok(run):
    code, log, rows = run
    assert code == 0, log[-4000:]
    return log, rows


def test_step1_loss_equals_hugging_face_forward_at_one_rank_and_ring_cp2(hf_runs):
    ref = hf_runs["hf_loss"]
    assert abs(ref - math.log(HF_CONFIG["vocab_size"])) > 0.5  # the weights matter (a random init gives ~ln V)
    for name, cp in (("none", 1), ("ring", 2)):
        log, rows = _ok(hf_runs["runs"][name])
        assert f"loading HuggingFace-format checkpoint from {hf_runs['hf']}" in log, log[-3000:]
        assert "core attention: 2 layers run LongContextCoreAttention" in log
        assert rows[0]["step"] == 1 and rows[0]["cp_size"] == cp and rows[0]["world_size"] == cp
        assert abs(rows[0]["loss"] - ref) <= RTOL * ref, (name, rows[0]["loss"], ref)


def test_control_a_model_without_the_weights_gives_another_loss(hf_runs):
    log, rows = _ok(hf_runs["runs"]["control"])
    assert "HuggingFace-format" not in log
    ref = hf_runs["hf_loss"]
    assert abs(rows[0]["loss"] - ref) > 1000 * RTOL * ref, (rows[0]["loss"], ref)


def test_export_without_training_gives_back_the_original_tensors(hf_runs):
    _ok(hf_runs["runs"]["export_none"])
    hf, out = hf_runs["hf"], hf_runs["tmp"] / "hf_none"
    original, exported = _tensors(hf), _tensors(out)
    assert sorted(original) == sorted(exported)
    for k, t in original.items():
        assert exported[k].dtype == t.dtype and exported[k].shape == t.shape, k
        assert exported[k].equal(t), (k, float((exported[k] - t).abs().max()))
    assert json.loads((out / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (out / "tokenizer.json").is_file()


def test_export_after_a_step_is_the_trained_model(hf_runs):
    _ok(hf_runs["runs"]["export_ring"])
    _, rows = _ok(hf_runs["runs"]["ring"])
    out = hf_runs["tmp"] / "hf_ring"
    original, exported = _tensors(hf_runs["hf"]), _tensors(out)
    assert sorted(original) == sorted(exported)
    assert all(float((exported[k] - original[k]).abs().max()) > 0 for k in original)  # every tensor trained
    # HF's forward of the exported step-1 weights on step 2's batch = the Megatron model's step-2 loss (a batch with
    # an EOD, masked out of the loss: dataset.eod_mask_loss=true)
    assert hf_runs["batches"][1]["loss_mask"].sum() < len(hf_runs["batches"][1]["loss_mask"])
    step2 = hf_loss(out, hf_runs["batches"][1])
    assert rows[1]["step"] == 2 and abs(rows[1]["loss"] - step2) <= RTOL * step2, (rows[1]["loss"], step2)
    assert abs(hf_loss(hf_runs["hf"], hf_runs["batches"][1]) - step2) > 10 * RTOL * step2  # the step changed it


def _run(*args, module="nemo_longctx.apps.bridge", timeout=300):
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def test_bad_init_from_and_export_arguments_fail_before_anything_runs(hf_runs, tmp_path):
    missing = tmp_path / "missing"
    code, log = _run(f"init_from={missing}", f"output_dir={tmp_path}/o1")
    assert code == 2 and f"init_from={missing}: not a directory" in log, log[-3000:]
    (tmp_path / "empty").mkdir()
    code, log = _run(f"init_from={tmp_path / 'empty'}", f"output_dir={tmp_path}/o2")
    assert code == 2 and f"init_from={tmp_path / 'empty'}: not a Hugging Face model directory (no config.json)" in log
    hf = hf_runs["hf"]
    code, log = _run(f"init_from={hf}", "recipe=demo", "cp.size=2", "model.seq_length=250",
                     "model.ffn_hidden_size=512", f"output_dir={tmp_path}/o3")
    assert code == 2, log[-3000:]
    assert f"init_from={hf}: model.seq_length=250 must be divisible by 2*cp.size = 4" in log, log[-3000:]
    assert f"model.ffn_hidden_size=512 but init_from={hf} has ffn_hidden_size=256" in log
    assert "core attention:" not in log  # no rank started
    code, log = _run(f"checkpoint={missing}", f"output={tmp_path}/x", module="nemo_longctx.apps.bridge_convert")
    assert code == 2 and f"checkpoint={missing}: not a directory" in log, log[-3000:]
    code, log = _run(f"checkpoint={hf_runs['tmp'] / 'ckpt_none'}", f"output={hf}",
                     module="nemo_longctx.apps.bridge_convert")
    assert code == 2 and f"output={hf}: exists and is not empty" in log, log[-3000:]


def test_export_refuses_a_checkpoint_whose_rope_differs_from_the_source(hf_runs, tmp_path):
    """Bridge's export writes the source's config.json: a checkpoint trained with another RoPE base (here its
    run_config.yaml says so) would come out computing something else -- refused, naming the field."""
    import yaml

    from nemo_longctx.integrations.bridge import hf as bridge_hf
    from nemo_longctx.options import ConfigError

    trained = hf_runs["tmp"] / "ckpt_none" / "iter_0000001"
    fake = tmp_path / "iter_0000001"
    fake.mkdir()
    for f in trained.iterdir():
        if f.name != "run_config.yaml":
            (fake / f.name).symlink_to(f)
    run_config = yaml.safe_load((trained / "run_config.yaml").read_text())
    run_config["model"]["rotary_base"] = 500000.0
    (fake / "run_config.yaml").write_text(yaml.safe_dump(run_config))
    with pytest.raises(ConfigError, match=r"model.rotary_base=500000.0 but source=.* has rotary_base=10000"):
        bridge_hf.export_hf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()
