"""``model.cp_comm_type`` from NVIDIA's model configs yields to ``cp.algorithm``; a contradicting value the user set is
refused, naming both keys.

NeMo's ``MistralConfig7B`` carries ``cp_comm_type='a2a'`` (TransformerEngine's all-to-all CP, chosen because TE's p2p
ring refuses sliding windows). nemo_longctx runs windows under every algorithm, and the CP algorithm is the user's
``cp.algorithm``: a value the config class sets is replaced by the algorithm's own name (``ring`` -> ``p2p``,
``ulysses`` -> ``a2a``, ``hybrid`` -> ``a2a+p2p``) with one line saying so; a value the user set (a Hydra
``model.cp_comm_type`` key, or on a config object a value other than the class default) that contradicts
``cp.algorithm`` stops the run before anything starts. Checked on NVIDIA's own config class, through the app (dry
runs of ``model=mistral_7b`` and of the class named by ``model._target_``) and through the NeMo strategy's own hook.
"""

from __future__ import annotations

import pytest

from app_runner import dry_runs_in_one_process



def test_nvidia_mistral_hint_yields_to_the_algorithm_and_user_values_are_checked():
    from nemo.collections.llm.gpt.model.mistral import MistralConfig7B

    from nemo_longctx.integrations.megatron.cp_algorithms import align_cp_comm_type

    assert MistralConfig7B().cp_comm_type == "a2a"  # NVIDIA's value, the premise of this test
    for algorithm, expected in [("ring", "p2p"), ("hybrid", "a2a+p2p")]:
        config = MistralConfig7B()
        note = align_cp_comm_type(config, algorithm)
        assert config.cp_comm_type == expected
        assert "'a2a' from MistralConfig7B replaced by" in note and f"cp.algorithm={algorithm}" in note
    config = MistralConfig7B()
    assert align_cp_comm_type(config, "ulysses") is None and config.cp_comm_type == "a2a"  # it already agrees
    config = MistralConfig7B(cp_comm_type=None)
    assert align_cp_comm_type(config, "ring") is None and config.cp_comm_type is None  # null: every algorithm

    # the user's own values: set on the object (differs from the class default) or named by the Hydra node
    with pytest.raises(ValueError, match=r"model.cp_comm_type='p2p' contradicts cp.algorithm='ulysses'"):
        align_cp_comm_type(MistralConfig7B(cp_comm_type="p2p"), "ulysses")
    with pytest.raises(ValueError, match=r"model.cp_comm_type='a2a' contradicts cp.algorithm='ring'"):
        align_cp_comm_type(MistralConfig7B(), "ring", explicit=True)
    with pytest.raises(ValueError, match=r"contradicts cp.algorithm='ring'"):
        align_cp_comm_type(MistralConfig7B(cp_comm_type=["a2a", "p2p"]), "ring")


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Three dry runs of the app in one process: NVIDIA's Mistral 7B (our YAML, no cp_comm_type key) under ring, the
    class itself named by ``model._target_`` under hybrid, and a user override contradicting ring."""
    base = tmp_path_factory.mktemp("comm")
    runs = {
        "yaml_ring": ["model=mistral_7b", "cp=ring", "cp.size=2", "data=synthetic"],
        "class_hybrid": ["model._target_=nemo.collections.llm.gpt.model.mistral.MistralConfig7B", "cp=hybrid",
                         "cp.size=2", "cp.ulysses_size=2"],
        "user_contradicts": ["model=tiny_mistral", "cp=ring", "cp.size=2", "++model.cp_comm_type=a2a"],
    }
    args = [a + ["trainer.devices=2", "run.dry_run=true", f"output_dir={base / name}"] for name, a in runs.items()]
    return dict(zip(runs, dry_runs_in_one_process(args, base)))


def test_app_dry_runs_align_nvidia_configs_and_say_so(dry_runs):
    for name, expected in [("yaml_ring", "'p2p'"), ("class_hybrid", "'a2a+p2p'")]:
        _, code, err, out = dry_runs[name]
        assert code == 0 and "dry run OK" in out, (err, out[-3000:])
        line = next((ln for ln in out.splitlines() if "model.cp_comm_type: 'a2a' from MistralConfig7B" in ln), None)
        assert line is not None and f"replaced by {expected}" in line, out[-3000:]


def test_app_refuses_a_user_cp_comm_type_that_contradicts_the_algorithm(dry_runs):
    _, code, err, out = dry_runs["user_contradicts"]
    assert code != 0 and "dry run OK" not in out, out[-3000:]
    assert "model.cp_comm_type='a2a' contradicts cp.algorithm='ring'" in err, err
