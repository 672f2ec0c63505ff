"""Flow-matching text-to-image RL: stateless sampler math (`sde`), model wrappers (`models`), group
rollouts (`sampling`) and recipes (`flow_grpo`; `dpo`, `nft` reuse the first three)."""

from mmrl.diffusion.models import FlowModel, FluxModel, PromptEmbeds, SD3Model, load_flow_model  # noqa: F401
from mmrl.diffusion.sampling import Trajectory, sample_groups, sde_window, step_log_prob  # noqa: F401
from mmrl.diffusion.sde import StepOutput, ode_step, sde_step_with_logprob  # noqa: F401
