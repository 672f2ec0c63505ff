"""Performance accounting: FLOPs from the architecture (`flops`), the per-step FLOPs / MFU / peak-memory meter the
recipes log (`meter`), and the configs of real architectures for memory and throughput checks (`architectures`).
Both registries (`register_flops`, `register_architecture`) are filled by the model families' own files."""

from mmrl.perf.architectures import (  # noqa: F401
    ARCHITECTURES, Architecture, get_architecture, register_architecture,
)
from mmrl.perf.flops import (  # noqa: F401
    FLOP_FAMILIES, FlopsEstimator, Pass, flops_estimator, input_arg, packed_joint_estimator, register_flops,
)
