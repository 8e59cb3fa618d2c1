"""On PYTHONPATH of a control run only (tests_bridge/test_gpt_oss_recipe.py): our core attention calls its attention
function without the sinks (softmax_type vanilla) in every process of the run, while the model keeps its
``softmax_offset`` parameters. If the GPT-OSS losses come from attention with sinks, they must change."""

from nemo_longctx.integrations.megatron.core_attention import LongContextCoreAttention

LongContextCoreAttention._sink_kwargs = lambda self: {}
