"""Image reward models, one module per model; each registers its names with `mmrl.rewards.register` and is
imported lazily by `mmrl.rewards.load(name, ...)` (see the `register_lazy` lines in `mmrl/rewards/__init__.py`).

| name | module | weights (local path, never downloaded) |
|---|---|---|
| pickscore | pickscore.py | yuvalkirstain/PickScore_v1 (+ processor laion/CLIP-ViT-H-14-laion2B-s32B-b79K) |
| clip_score | clip_score.py | a CLIP directory, e.g. openai/clip-vit-large-patch14 |
| hpsv2, hpsv21 | hps.py | xswu/HPSv2: HPS_v2_compressed.pt / HPS_v2.1_compressed.pt |
| aesthetic | aesthetic.py | sac+logos+ava1-l14-linearMSE.pth + openai/clip-vit-large-patch14 |
| imagereward | imagereward.py | THUDM/ImageReward: ImageReward.pt + a bert-base-uncased tokenizer directory |
| ocr | ocr.py | none (rapidocr-onnxruntime ships its PP-OCRv4 models; extra [ocr]) |
"""
