"""Performance accounting: FLOPs from the architecture (`flops`), the per-step FLOPs / MFU / peak-memory meter the
recipes log (`meter`), and the configs of real architectures for memory and throughput checks (`architectures`)."""

from mmrl.perf.flops import FLOP_FAMILIES, FlopsEstimator, Pass, flops_estimator, register_flops  # noqa: F401
