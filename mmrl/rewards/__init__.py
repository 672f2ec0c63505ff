"""Reward-model zoo: `load(name, **kw)`, `available()`; every model returns RewardOutput(scores[B], details)."""

from mmrl.rewards.base import RewardModel, RewardOutput, load, to_image_list, to_image_tensor  # noqa: F401
from mmrl.rewards.callable import FunctionReward, from_callable  # noqa: F401  (plain functions as rewards)
from mmrl.rewards.registry import available, register, register_lazy  # noqa: F401

# image rewards (mmrl/rewards/image/*), imported on first use
register_lazy("mmrl.rewards.image.pickscore", "pickscore")
register_lazy("mmrl.rewards.image.clip_score", "clip_score")
register_lazy("mmrl.rewards.image.hps", "hpsv2", "hpsv21")
register_lazy("mmrl.rewards.image.aesthetic", "aesthetic")
register_lazy("mmrl.rewards.image.ocr", "ocr")
register_lazy("mmrl.rewards.image.imagereward", "imagereward")
register_lazy("mmrl.rewards.image.hpsv3", "hpsv3")
# a reward trained by `mmrl reward train` (reward_bt), from the directory it exported
register_lazy("mmrl.rewards.learned", "learned_pref")

# text / composite / remote / VLM-judge rewards (rewards helper: text, composite, remote, vlm_judge)
register_lazy("mmrl.rewards.text", "math_accuracy", "multiple_choice", "number_match", "exact_match", "format",
              "iou", "accuracy_format", "geo3k")
register_lazy("mmrl.rewards.composite", "composite")
register_lazy("mmrl.rewards.remote", "remote")
register_lazy("mmrl.rewards.vlm_judge", "vlm_judge", "vlm_edit_judge")
register_lazy("mmrl.rewards.unified_reward", "unified_reward")
register_lazy("mmrl.rewards.image.color_match", "prompt_color")
register_lazy("mmrl.rewards.image.edit", "edit_preservation", "clip_direction", "edit_region_color")
register_lazy("mmrl.rewards.image.edit_reward", "edit_reward")
register_lazy("mmrl.rewards.image.shapes_geneval", "shapes_geneval")

# group-wise / pairwise rewards (a sample scored against the other samples of its group)
register_lazy("mmrl.rewards.group", "group_rank", "pickscore_rank", "pairwise_winrate")

# video rewards (videos [B, F, 3, H, W]): any image reward per frame, temporal consistency, motion amount
register_lazy("mmrl.rewards.video", "video_frames", "temporal_consistency", "motion_amount")

# latent rewards (a diffusion family's final latents + the prompt, no VAE decode: mmrl.rewards.latent)
register_lazy("mmrl.rewards.latent_dina", "dina_lrm")
register_lazy("mmrl.rewards.latent_lpo", "lpo_lrm")

# audio rewards (an audio-video family's waveforms + sample rate: mmrl.rewards.audio)
register_lazy("mmrl.rewards.audio", "audio_loudness")

# VideoAlign's VideoReward (Qwen2-VL reward model: visual quality, motion quality, text alignment)
register_lazy("mmrl.rewards.video_align", "videoalign", "videoreward")
