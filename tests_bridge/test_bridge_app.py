"""The Megatron-Bridge front end on the CPU (Python 3.12 stack: scripts/install_bridge.sh; run with
``.venv-bridge/bin/python -m pytest tests_bridge``): Bridge's own ``pretrain`` + ``gpt_step.forward_step`` trains the
CPU demo (a tiny Llama from Bridge's Llama mapping, mock data) on gloo ranks, with our ring and Ulysses attention at
CP=2 giving the losses of one rank, every attention layer ours; bad values get the NeMo front end's messages."""

from __future__ import annotations


import pytest
from hub_configs import offline_cache
from runner import ROOT, run_bridge, shared_dir, shared_run

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")


def _run(tmp_path, name, *args, timeout=600):
    return run_bridge(tmp_path, name, *args, timeout=timeout)


@pytest.fixture(scope="module")
def demo_runs():
    """The demo at cp=none (1 rank), ring and Ulysses CP=2 (shared with the other files: runner.shared_run)."""
    return {name: shared_run(*args) for name, args in {
        "none": ["cp=none"], "ring": ["cp=ring", "cp.size=2"], "ulysses": ["cp=ulysses", "cp.size=2"]}.items()}


@pytest.mark.smoke
def test_ring_and_ulysses_cp2_match_one_rank(demo_runs):
    code, log, ref = demo_runs["none"]
    assert code == 0, log[-4000:]
    assert [r["step"] for r in ref] == [1, 2, 3] and all(r["cp_size"] == 1 and r["world_size"] == 1 for r in ref)
    for name in ("ring", "ulysses"):
        code, log, rows = demo_runs[name]
        assert code == 0, log[-4000:]
        assert "world 2" in log and "core attention: 2 layers run LongContextCoreAttention" in log, log[-3000:]
        assert [r["cp_size"] for r in rows] == [2, 2, 2] and rows[0]["world_size"] == 2
        for a, b in zip(ref, rows):
            assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (name, a, b)
    # the losses move (training happens) and are not all equal
    assert ref[0]["loss"] != ref[-1]["loss"]
    # TensorBoard through Bridge's own logger config (logger.tensorboard_dir = <output_dir>/tensorboard)
    assert list((shared_dir("cp=ring", "cp.size=2") / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.smoke
@pytest.mark.parametrize("args, message", [
    (["cp.size=2.5"], "cp.size=2.5 must be a positive int"),
    (["cp=hybrid", "cp.ulysses_size=3"], "cp.ulysses_size=3 must be a positive divisor of cp.size=4"),
    (["optim.lr=0.1"], "optim.lr: on the Bridge front end the learning-rate schedule is Bridge's (optimizer.lr=...)"),
    (["offload=layer_input"], "offload=layer_input requires recompute=full or full_keep_attn (got recompute=none)"),
    (["recompute=full_keep_attn", "cp=ulysses", "cp.size=2"], "it needs cp.algorithm=ring (cp=ring or cp=none)"),
    (["tiling.mlp_tiles=0"], "tiling.mlp_tiles must be a positive number of tiles"),
    (["cp.size=2", "model.seq_length=250"], "model.seq_length=250 must be divisible by 2*cp.size = 4"),
    (["cp=foo"], "cp=foo: no such choice of the cp group (choose one of: hybrid, none, ring, ulysses)"),
    (["--recipe"], "--recipe needs a Bridge recipe name"),
    (["--recipe", "no_such_recipe"], "recipe='no_such_recipe' is not a Megatron-Bridge recipe"),
    (["+run.timout_s=3"], "run: unknown key(s) ['timout_s']"),
    (["dataset.reset_attention_mask=true"], "dataset.reset_attention_mask=true without data.packing=documents: "
                                            "nemo_longctx attention (every cp, cp=none too) is causal"),
])
def test_bad_values_fail_before_any_rank_with_the_shared_messages(tmp_path, args, message):
    code, log, _ = _run(tmp_path, "bad", *args, timeout=300)
    assert code == 2 and message in log, log[-3000:]
    assert "core attention:" not in log  # no rank started


LLAMA32_1B_CONFIG = {  # Llama-3.2-1B's config.json (its public values): all the recipe reads from the hub
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
SHRINK = ["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.num_attention_heads=4",
          "model.num_query_groups=2", "model.kv_channels=32", "model.seq_length=256", "train.train_iters=2",
          "train.global_batch_size=1", "train.micro_batch_size=1", "dataset.num_workers=0", "validation.eval_iters=0",
          "checkpoint.save=null", "scheduler.lr_warmup_iters=1"]


def test_a_bridge_recipe_by_name_trains_with_ring_cp2_as_on_one_rank(tmp_path, monkeypatch):
    """NVIDIA's own recipe function, unmodified (``llama32_1b_pretrain_config``), shrunk by Bridge's overrides: the hub
    is replaced by Hugging Face's own offline cache holding the model's config.json (no weights are read)."""
    offline_cache(tmp_path / "hf", {"meta-llama/Llama-3.2-1B": LLAMA32_1B_CONFIG})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runs = {name: _run(tmp_path, name, "recipe=llama32_1b_pretrain_config", *args, *SHRINK)
            for name, args in {"none": ["cp=none"], "ring": ["cp=ring", "cp.size=2"]}.items()}
    for name, (code, log, rows) in runs.items():
        assert code == 0 and "recipe llama32_1b_pretrain_config" in log, log[-4000:]
        assert "core attention: 2 layers run LongContextCoreAttention" in log and len(rows) == 2, log[-3000:]
    for a, b in zip(runs["none"][2], runs["ring"][2]):
        assert b["cp_size"] == 2 and abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)


def test_control_a_wrong_kernel_in_our_attention_changes_the_losses(tmp_path, demo_runs):
    """The control of the parity test: the same ring CP=2 run with our core attention using a deliberately wrong
    kernel (the self-test's ``injected_wrong``: no causal mask, registered in every process by
    tests_bridge/wrong_kernel/sitecustomize.py) must differ -- the losses above come from our attention."""
    inject = ROOT / "tests_bridge" / "wrong_kernel"
    code, log, rows = run_bridge(tmp_path, "wrong", "cp=ring", "cp.size=2", "+cp.kwargs.kernel=injected_wrong",
                                 timeout=600, env={"PYTHONPATH": f"{inject}:{ROOT}"})
    assert code == 0 and len(rows) == 3, log[-3000:]
    ref = demo_runs["ring"][2]
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 * abs(a["loss"]) for a, b in zip(ref, rows)), (ref, rows)


@pytest.mark.smoke
def test_a_config_container_is_read_into_a_spec_in_bridges_dialect():
    """``spec_of_container``: the trainer, the provider's layout and fields, whether the container saves, the data
    of a real ConfigContainer (the demo's), in Bridge's dialect; ``enable_long_context`` takes its Context from that
    spec and names bad options as before, byte for byte."""
    from nemo_longctx.apps.bridge import demo_config
    from nemo_longctx.integrations.bridge.config import enable_long_context, spec_of_container
    from nemo_longctx.options import ConfigError, Context
    from nemo_longctx.shared.app_keys import BRIDGE_KEYS
    from nemo_longctx.shared.run_spec import Layout

    cfg = demo_config()
    spec = spec_of_container(cfg, {"cp": {"size": 2}})
    t = spec.trainer
    assert (t.max_steps, t.micro_batch_size, t.global_batch_size, t.precision, t.layout, t.world_size) == (
        3, 1, 1, "bf16-mixed", Layout(), None)
    assert (spec.model.seq_length, spec.model.get("num_layers"), spec.options.cp.size, spec.dialect) == (
        256, 2, 2, "bridge")
    assert spec.checkpoint.saves and spec.checkpoint.dir == cfg.checkpoint.save
    assert spec.context() == Context(seq_length=256, checkpointing=True, keys=BRIDGE_KEYS, packed_data=False)
    assert spec_of_container(cfg, packed_documents=True).context().packed_data is True
    assert spec_of_container(cfg, packed_documents=None).data is None
    cfg.checkpoint.save_interval, cfg.mixed_precision = None, "fp16_mixed"
    cfg.model.tensor_model_parallel_size, cfg.model.sequence_parallel = 2, True
    spec = spec_of_container(cfg)
    assert (spec.trainer.layout, spec.trainer.precision, spec.checkpoint.saves) == (
        Layout(tp=2, sequence_parallel=True), "16-mixed", False)
    cfg = demo_config()
    for groups, message in (
            ({"cp": {"size": 3}}, "model.seq_length=256 must be divisible by 2*cp.size = 6 (zigzag layout: 2 chunks "
                                  "per CP rank): use 252 or 258"),
            ({"cp": {"size": 2}, "optim": {"megatron_fsdp": True, "use_distributed_optimizer": True}},
             "optim.megatron_fsdp=true with checkpoint.save_interval > 0: Megatron-FSDP checkpoints (the fsdp_dtensor "
             "format) are saved by nemo-longctx train only, which gives every rank the optimizer state of every "
             "parameter that format needs (set checkpoint.save_interval=0, or train with nemo-longctx train)"),
            ({"cp": {"size": 2, "split_min_tokens": 64}}, "cp.split_min_tokens=64 places packed documents, but the "
             "data (data.packing) are dense sequences (no document boundaries): use packed documents or drop it")):
        with pytest.raises(ConfigError) as e:
            enable_long_context(cfg, groups)
        assert e.value.problems == [message], groups


@pytest.mark.smoke
def test_python_api_enable_long_context_with_keyword_groups():
    """``enable_long_context(cfg, **groups)`` on a Bridge ConfigContainer (the demo's): the provider gets the CP size,
    our layer spec (core attention, tiled MLP) and Megatron's recompute fields, the callbacks exist; bad values raise
    one ConfigError naming them, in Bridge's key names where the key is Bridge's."""
    from nemo_longctx.apps import bridge as bridge_app
    from nemo_longctx.integrations.bridge.config import enable_long_context, long_context_callbacks
    from nemo_longctx.integrations.megatron.spec import LongContextSpec
    from nemo_longctx.integrations.megatron.tiled_mlp_layer import TiledMLPLayerSpec
    from nemo_longctx.options import ConfigError

    cfg = bridge_app.demo_config()
    out = enable_long_context(cfg, cp={"algorithm": "ulysses", "size": 2}, recompute={"name": "full"},
                              tiling={"mlp_tiles": 2})
    m = out.model
    assert out is cfg and m.context_parallel_size == 2 and m.cp_comm_type is None
    assert m.recompute_granularity == "full" and m.recompute_method == "uniform" and m.recompute_num_layers == 1
    assert isinstance(m.transformer_layer_spec, TiledMLPLayerSpec)
    assert isinstance(m.transformer_layer_spec.base, LongContextSpec)
    assert m.transformer_layer_spec.base.cp_algorithm == "ulysses"
    assert [type(c).__name__ for c in long_context_callbacks(cfg)] == ["LongContextMemoryCallback",
                                                                      "LongContextRunGuards"]
    enable_long_context(cfg, cp={"size": 2})  # again: from the user's base spec, not nested in our wrappers
    assert isinstance(m.transformer_layer_spec, LongContextSpec) and not isinstance(
        m.transformer_layer_spec.base, (LongContextSpec, TiledMLPLayerSpec))
    # the model-state keys on Bridge's OptimizerConfig / DistributedDataParallelConfig: Megatron-FSDP the way the
    # NeMo 2 front ends set it (one set of DDP fields), and back off again
    from nemo_longctx.integrations.megatron.model_state import MEGATRON_FSDP_DDP_FIELDS

    cfg.checkpoint.save_interval = 0  # Megatron-FSDP's checkpoints are refused by name
    enable_long_context(cfg, cp={"size": 2}, optim={"megatron_fsdp": True, "use_distributed_optimizer": True})
    assert {k: getattr(cfg.ddp, k) for k in MEGATRON_FSDP_DDP_FIELDS} == MEGATRON_FSDP_DDP_FIELDS
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.grad_reduce_in_fp32
    enable_long_context(cfg, cp={"size": 2}, optim={"use_distributed_optimizer": False})
    assert not cfg.ddp.use_megatron_fsdp and not cfg.ddp.use_distributed_optimizer
    with pytest.raises(ConfigError) as e:
        enable_long_context(cfg, cp={"size": 2.5}, offload={"name": "layer_input"})
    text = str(e.value)
    assert "cp.size=2.5 must be a positive int" in text and "offload=layer_input requires recompute=full" in text
