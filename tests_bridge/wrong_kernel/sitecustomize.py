"""On PYTHONPATH of a control run only (tests_bridge/test_bridge_app.py): registers the self-test's deliberately wrong
attention kernel (``injected_wrong``: ignores the causal mask) so that ``cp.kwargs.kernel=injected_wrong`` can select
it in every process of the run. If the model's attention layers are ours, the losses must change."""

from nemo_longctx.attention import kernels
from nemo_longctx.selftest.kernel_checks import WRONG_KERNEL

kernels.KERNELS[WRONG_KERNEL.name] = WRONG_KERNEL
