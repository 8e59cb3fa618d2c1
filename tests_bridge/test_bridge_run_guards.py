"""The CP run guard on the Megatron-Bridge front end (``integrations.bridge.guards``): built from the demo's
``ConfigContainer`` at CP=2 and driven through Bridge's callback hooks, it passes a step whose attention ran over the
CP group and sent bytes, and stops a step whose attention ran over one rank (each rank on its own slice) or sent
nothing. Every Bridge app test runs it for real (the callback is in ``long_context_callbacks``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.bridge", reason="the Megatron-Bridge stack (scripts/install_bridge.sh)")


@pytest.mark.smoke
def test_the_bridge_cp_guard_passes_a_working_step_and_stops_a_broken_one(monkeypatch):
    from nemo_longctx.apps import bridge as bridge_app
    from nemo_longctx.attention.comm import record_bytes_sent
    from nemo_longctx.integrations.bridge import guards
    from nemo_longctx.integrations.bridge.config import enable_long_context, long_context_callbacks
    from nemo_longctx.integrations.megatron import run_guards

    cfg = bridge_app.demo_config()
    enable_long_context(cfg, cp={"algorithm": "ring", "size": 2})
    assert any(type(c).__name__ == "LongContextRunGuards" for c in long_context_callbacks(cfg))
    seq = int(cfg.model.seq_length)
    layers = [SimpleNamespace(layer_number=1, cp_size=2, last_key_tokens=seq // 2)]
    monkeypatch.setattr(run_guards, "core_attentions", lambda model: layers)  # stands for the built model's layers
    guard = guards.run_guards_callback(cfg)
    context = SimpleNamespace(model=[], state=SimpleNamespace(train_state=SimpleNamespace(step=0)))

    def step(sent_bytes):
        guard.on_train_step_start(context)
        record_bytes_sent(sent_bytes)
        guard.on_train_step_end(context)

    guard.on_train_start(context)
    step(4096)
    with pytest.raises(run_guards.GuardTripped, match="sent no bytes"):
        step(0)
    layers[0].cp_size = 1
    with pytest.raises(run_guards.GuardTripped, match="runs over 1 CP rank"):
        step(4096)
