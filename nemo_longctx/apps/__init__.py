"""The entry points: ``nemo-longctx`` (``cli``) and its commands -- ``train`` (NeMo 2), ``bridge`` and
``bridge_convert`` (Megatron-Bridge), ``plan``, ``convert`` (import/export), ``help`` -- and NeMo-Run's CLI
(``nemo_run_cli``, ``nemo_run_planned``). Nothing below the apps imports them."""
