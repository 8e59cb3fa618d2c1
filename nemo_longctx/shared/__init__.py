"""What both front ends (NeMo 2 and Megatron-Bridge) and the apps share, importing no NeMo, Lightning or Megatron:
the local launcher (``launch``, ``reaper``, ``signals``, ``process_exit``), the console, Hydra overrides, the apps'
own keys (``app_keys``, ``plan_keys``) and the converters' arguments, path, checkpoint and resume checks, and the
tested versions. Standard library, torch (lazily) and Hydra/OmegaConf only, besides ``nemo_longctx.options``
(tests/test_layering.py checks it)."""
