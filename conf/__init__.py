"""Hydra config tree of nemo-longctx (installed as the package ``nemo_longctx.conf``)."""
