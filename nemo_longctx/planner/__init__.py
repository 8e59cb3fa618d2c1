"""The long-context planner, plain Python (no torch): ``search`` (the memory and cost model and the search over CP,
recompute, offload, tiling and model-state layouts) and ``model_shapes`` (the model dimensions it reads). Callers
import the modules: ``from nemo_longctx.planner.search import plan``."""
