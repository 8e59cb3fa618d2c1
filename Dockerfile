# nemo-longctx on top of the NGC NeMo Framework container: the NeMo 2 front end (default) or the Megatron-Bridge one.
#
#   docker build -t nemo-longctx .                                     # NeMo 2 base (NEMO_IMAGE, below)
#   docker build --build-arg NEMO_IMAGE=nvcr.io/nvidia/nemo:25.09 -t nemo-longctx .
#   docker build --build-arg STRICT_VERSIONS=1 -t nemo-longctx .     # fail on a NeMo/Megatron pair not tested
#   docker build --build-arg FRONTEND=bridge -t nemo-longctx-bridge .  # Bridge-era base (BRIDGE_IMAGE, below)
#   enroot import dockerd://nemo-longctx && IMAGE=$PWD/nemo-longctx.sqsh sbatch examples/slurm/llama3_8b_1m.sbatch
#   enroot import dockerd://nemo-longctx-bridge && IMAGE=$PWD/nemo-longctx-bridge.sqsh \
#     sbatch examples/slurm/bridge_llama3_8b_128k.sbatch
#
# FRONTEND=nemo (`nemo-longctx train`, NeMo-Run recipes): a NeMo 2.x container (nemo.collections.llm +
# nemo.lightning, Megatron-core, TE, CUDA torch). Default 26.04, the last container with NeMo 2 (NeMo 2.7.3, the
# version the tests run; it pairs it with Megatron-core 0.17.0). The build prints the installed NeMo / Megatron-core /
# NeMo-Run versions and checks them against the tested stacks (python -m nemo_longctx.shared.versions): a warning for an
# untested pair, an error with STRICT_VERSIONS=1. docs/how-to/nemo-versions.md says what is tested how.
# FRONTEND=bridge (`nemo-longctx bridge`): a Megatron-Bridge-era container (no NeMo 2). 26.08 ships Megatron-Bridge
# 0.6.0 / Megatron-core 0.19.0 / TE 2.17.1 on Python 3.12: the NVIDIA build closest to the `[bridge]` extra's pins
# (constraints/bridge.txt: Bridge 0.6.2, Megatron-core 0.19.2, TE 2.20.2); override BRIDGE_IMAGE for another tag.
# Either way the plugin is pure Python and is installed with --no-deps: the extra's stack is the container's own
# build (checked below by importing it, never reinstalled), so the container's torch, TransformerEngine,
# Megatron-core, NeMo and Megatron-Bridge stay exactly as NVIDIA built them. BuildKit (docker's default builder)
# pulls only the selected base.
ARG NEMO_IMAGE=nvcr.io/nvidia/nemo:26.04
ARG BRIDGE_IMAGE=nvcr.io/nvidia/nemo:26.08
ARG FRONTEND=nemo

FROM ${NEMO_IMAGE} AS base-nemo
FROM ${BRIDGE_IMAGE} AS base-bridge

FROM base-${FRONTEND}
ARG FRONTEND
ARG STRICT_VERSIONS=0
WORKDIR /opt/nemo-longctx
COPY pyproject.toml README.md ./
COPY nemo_longctx ./nemo_longctx
COPY conf ./conf

# --no-deps: never replace the container's torch / transformer-engine / megatron-core / nemo-toolkit / megatron-bridge.
RUN python -m pip install --no-cache-dir --no-deps . \
 && python -c "import nemo_longctx, nemo_longctx.attention, nemo_longctx.planner.search, nemo_longctx.apps.plan; \
      print('nemo_longctx', nemo_longctx.__file__)" \
 && if [ "$FRONTEND" = bridge ]; then \
      python -c "import torch, megatron.core, megatron.bridge, megatron.bridge.recipes; \
        from megatron.bridge.training.pretrain import pretrain; \
        from megatron.bridge.training.gpt_step import forward_step; \
        import nemo_longctx.apps.bridge; from nemo_longctx.integrations.bridge.config import enable_long_context; \
        print('Megatron-Bridge', getattr(megatron.bridge, '__version__', '?'), 'Megatron-core', \
              megatron.core.__version__, '+ integration import OK')" \
      && nemo-longctx plan model=llama3_8b plan.seq_length=131072 plan.gpus=8 plan.gpu_memory_gb=80 \
           plan.frontend=bridge plan.show=3; \
    elif [ "$FRONTEND" = nemo ]; then \
      python -c "from nemo.collections import llm; import megatron.core; \
        from nemo_longctx.integrations.megatron.spec import long_context_layer_spec; \
        print('NeMo LLM collection + integration import OK')" \
      && STRICT_VERSIONS="$STRICT_VERSIONS" python -m nemo_longctx.shared.versions \
      && nemo-longctx plan model=llama3_8b plan.seq_length=1048576 plan.gpus=8 plan.gpu_memory_gb=80 plan.show=3; \
    else \
      echo "FRONTEND=$FRONTEND must be nemo or bridge" >&2 && exit 2; \
    fi

WORKDIR /workspace
CMD ["nemo-longctx", "--help"]
