"""Recipes that use both trainer families: a VLM/LLM policy (`mmrl.vlm`) and a text-to-image model
(`mmrl.diffusion`). This package imports both; `mmrl.vlm` and `mmrl.diffusion` never import each other or it.

- `rewriter` (algorithm `prompt_rewriter`): GRPO trains a Qwen-VL policy to rewrite the user's prompt; a frozen
  text-to-image model of any registry family renders the rewrite; image rewards score the render against the user's
  prompt (or its intent).
- `synonyms`: the tiny demo's data (user prompts naming colours in words the tiny renderer never saw).
"""
