# nemo-longctx on top of the NGC NeMo Framework container.
#
#   docker build -t nemo-longctx .                                   # default base (below)
#   docker build --build-arg NEMO_IMAGE=nvcr.io/nvidia/nemo:25.09 -t nemo-longctx .
#   enroot import dockerd://nemo-longctx && IMAGE=$PWD/nemo-longctx.sqsh sbatch examples/slurm/llama3_8b_1m.sbatch
#
# The base is pinned to a NeMo 2.x container (nemo.collections.llm + nemo.lightning, Megatron-core, TE, CUDA torch).
# 25.07 is a NeMo 2.x-era release with the LLM collection this plugin integrates with; override NEMO_IMAGE to use
# another 2.x tag. The plugin is pure Python and is installed with --no-deps, so the container's torch,
# TransformerEngine, Megatron-core and NeMo stay exactly as NVIDIA built them.
ARG NEMO_IMAGE=nvcr.io/nvidia/nemo:25.07
FROM ${NEMO_IMAGE}

WORKDIR /opt/nemo-longctx
COPY pyproject.toml README.md ./
COPY nemo_longctx ./nemo_longctx
COPY conf ./conf

# --no-deps: never replace the container's torch / transformer-engine / megatron-core / nemo-toolkit.
RUN python -m pip install --no-cache-dir --no-deps . \
 && python -c "import nemo_longctx, nemo_longctx.attention, nemo_longctx.memory.planner, nemo_longctx.plan; print('nemo_longctx', nemo_longctx.__file__)" \
 && python -c "from nemo.collections import llm; import megatron.core; from nemo_longctx.integrations.megatron.spec import long_context_layer_spec; print('NeMo LLM collection + integration import OK')" \
 && nemo-longctx plan model=llama3_8b plan.seq_length=1048576 plan.gpus=8 plan.gpu_memory_gb=80 plan.show=3

WORKDIR /workspace
CMD ["nemo-longctx", "--help"]
