"""Autoregressive image generation RL: image-token policies (Janus / Janus-Pro) trained with the GRPO family on
token log-probs, their decoded images scored by the image rewards (`mmrl.rewards`). A recipe layer beside
`mmrl.diffusion` and `mmrl.vlm`: it imports the shared layers only."""
